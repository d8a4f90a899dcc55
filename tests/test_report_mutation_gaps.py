"""Report-file and runtime-evidence behaviour that a mutation audit found unpinned.

``bidkv_ext.replay.report``: latency cells switch from ms to s at exactly one second and
show "-" for NaN; the terminal table left-aligns the policy column and right-aligns the
figures; the capacity table skips arms without a capacity section but keeps later ones,
shows shrinks as done/total, reserve release as yes/NO and a page count of 0 as a number;
the report's capacity section needs both a schedule and a capacity row and says whether
the signals are published; ``prepare_output_dir`` creates parents and leaves no probe
file; ``atomic_output`` creates a missing parent and retries a taken temporary name;
``write_json`` names an infinite figure by its dotted/indexed path and leaves the old file
untouched; the Markdown report shows the first 16 hex digits of the trace hash, the
prefix-caching setting and the trace attribution; ``write_plots`` raises the first
failure when both plots fail.

``bidkv_ext.evidence``: ``start_identity`` gives None for a short or non-numeric stat
line; the sink appends (never overwrites) compact lines with sorted keys.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from bidkv_ext import evidence
from bidkv_ext.replay import report
from bidkv_ext.replay.report import (
    NonFiniteError,
    atomic_output,
    capacity_markdown,
    format_capacity_table,
    format_table,
    markdown_report,
    prepare_output_dir,
    write_atomic,
    write_json,
    write_plots,
)

# --- helpers --------------------------------------------------------------------------


def _arm(label: str, ttft_p50: float = 0.5,
         capacity: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A metrics dict with every field the tables read."""
    latency = {"p50": ttft_p50, "p95": 0.5, "p99": 0.5, "mean": 0.5}
    arm: dict[str, Any] = {
        "label": label, "completed": 7, "throughput_output_tok_s": 12.0,
        "ttft_s": latency, "tpot_s": dict(latency), "e2e_s": dict(latency),
        "recompute_tax": 0.1, "recompute_tax_upper_bound": 0.2, "preemptions_per_1k": 3.0,
        "max_preemptions_one_request": 1, "goodput_req_s": 1.5,
        "controller": {"calls": 1, "selections": 1, "abstentions": 0},
    }
    if capacity is not None:
        arm["capacity"] = capacity
    return arm


def _capacity(completed: int = 1, shrinks: int = 2, released: bool = True,
              pages_min: int | None = 0) -> dict[str, Any]:
    return {
        "shrinks_completed": completed, "shrinks": shrinks,
        "shrink_completion_s": {"max": 0.25}, "time_in_shrink_s": 2.0,
        "steps_in_shrink": 5, "min_effective_blocks": 40,
        "free_pages_at_shrink_end": {"min": pages_min, "reserve_pages_max": 3},
        "max_over_target_during_shrink_blocks": 6,
        "max_overcommit_after_shrink_blocks": 0, "reserve_released": released,
    }


def _schedule(signals: bool = True) -> dict[str, Any]:
    return {"file": "cap.json", "points": [{"blocks": 40, "t": 1.5}],
            "blocks_per_page": 4, "signals": signals}


def _document(arms: list[dict[str, Any]], **trace_extra: Any) -> dict[str, Any]:
    trace = {"name": "t.csv", "format": "azure", "sha256": "0123456789abcdef" + "f" * 48,
             "requests": 5, "start_s": 0, "duration_s": 5, "max_requests": None,
             "rate_scale": 1.0, "filtered_too_long": 0, "filtered_kv_capacity": 0,
             **trace_extra}
    settings = {"max_model_len": 4096, "num_gpu_blocks": 64, "block_size": 16,
                "max_num_seqs": 8, "max_num_batched_tokens": 2048,
                "enable_prefix_caching": True}
    return {"trace": trace, "settings": settings, "arms": arms, "seed": 0,
            "step_model": {"name": "unit", "a": 1.0, "b": 0, "c": 0, "d": 0},
            "host": {"vllm_version": "0.0", "scheduler": "Scheduler"}}


def _data_row(table: str, label: str) -> str:
    (line,) = [line for line in table.splitlines() if line.startswith(label)]
    return line


# --- terminal and Markdown tables -----------------------------------------------------


def test_latency_cell_switches_to_seconds_at_exactly_one_second() -> None:
    """1.0 s is "1.00s", just under is milliseconds, and NaN is "-" (never "nans")."""
    cells = _data_row(format_table([_arm("one", 1.0)], {}), "one").split()
    assert cells[3] == "1.00s"
    assert _data_row(format_table([_arm("under", 0.999)], {}), "under").split()[3] == "999ms"
    assert _data_row(format_table([_arm("nan", math.nan)], {}), "nan").split()[3] == "-"


def test_terminal_table_left_aligns_policy_and_right_aligns_figures() -> None:
    """The policy column is padded on the right; figures are padded on the left."""
    table = format_table([_arm("a-much-longer-label"), _arm("b")], {"b": 1234.5})
    header, rule, _, short = table.splitlines()
    assert header.startswith("policy ")
    assert set(rule.replace(" ", "")) == {"-"}
    assert short.startswith("b" + " " * len("a-much-longer-label"))
    assert short.endswith(" 1234.5")
    widths = [len(part) for part in rule.split("  ")]
    done_cell = short[widths[0] + 2: widths[0] + 2 + widths[1]]
    assert done_cell == "7".rjust(widths[1])


def test_capacity_table_skips_arms_without_capacity_but_keeps_later_ones() -> None:
    """An arm without a capacity section is skipped, not the end of the table; shrinks
    read done/total, reserve release yes/NO, a page minimum of 0 is a number."""
    arms = [_arm("plain"), _arm("held", capacity=_capacity(1, 2, False, 0)),
            _arm("freed", capacity=_capacity(2, 2, True, None))]
    table = format_capacity_table(arms)
    assert "plain" not in table
    held = _data_row(table, "held").split()
    assert held[1] == "1/2" and held[-1] == "NO"
    assert "0 (reserve 3)" in _data_row(table, "held")
    freed = _data_row(table, "freed")
    assert freed.split()[-1] == "yes"
    assert " - " in freed  # no page minimum recorded


def test_capacity_table_and_section_are_empty_without_capacity() -> None:
    """No capacity row gives "" and no report section even with a schedule; a capacity
    row without a schedule gives no section either."""
    assert format_capacity_table([_arm("plain")]) == ""
    document = _document([_arm("plain")])
    document["settings"]["capacity_schedule"] = _schedule()
    assert capacity_markdown(document) == []
    with_rows = _document([_arm("c", capacity=_capacity())])
    assert capacity_markdown(with_rows) == []


@pytest.mark.parametrize(("signals", "said"), [(True, "signals published"),
                                               (False, "signals not published")])
def test_capacity_section_says_whether_signals_reach_the_policy(
    signals: bool, said: str
) -> None:
    document = _document([_arm("c", capacity=_capacity())])
    document["settings"]["capacity_schedule"] = _schedule(signals)
    text = "\n".join(capacity_markdown(document))
    assert said in text
    assert "40 blocks from t=1.5 s" in text


# --- output directory and atomic writes -----------------------------------------------


def test_prepare_output_dir_creates_parents_and_leaves_no_probe(tmp_path: Path) -> None:
    out = tmp_path / "a" / "b" / "out"
    prepare_output_dir(out, ["report.json", "report.md"])
    assert out.is_dir()
    assert list(out.iterdir()) == []


def test_output_dir_under_a_file_is_a_one_line_strerror(tmp_path: Path) -> None:
    """The reason is the OS's strerror, not the exception's repr with the path again."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(report.OutputError) as info:
        prepare_output_dir(blocker / "sub", ["report.json"])
    assert str(info.value) == (f"--output-dir {str(blocker / 'sub')!r}: cannot create the "
                               "directory: Not a directory")


def test_output_dir_that_refuses_files_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe's failure is reported by strerror (also where root bypasses modes)."""
    def refuse(_path: Path) -> tuple[int, Path]:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(report, "_create_temporary", refuse)
    with pytest.raises(report.OutputError) as info:
        prepare_output_dir(tmp_path, ["report.json"])
    assert str(info.value) == f"--output-dir {str(tmp_path)!r}: cannot write there: " \
                              "Permission denied"


def test_atomic_output_creates_a_missing_parent(tmp_path: Path) -> None:
    target = tmp_path / "new" / "dir" / "report.md"
    write_atomic(target, b"body")
    assert target.read_bytes() == b"body"
    assert [p.name for p in target.parent.iterdir()] == ["report.md"]


def test_atomic_output_retries_a_taken_temporary_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A temporary name already taken is skipped (and left alone), not an error."""
    names = iter(["aaaaaaaaaaaa", "bbbbbbbbbbbb"])
    monkeypatch.setattr(report.secrets, "token_hex", lambda _n: next(names))
    taken = tmp_path / ".report.md.aaaaaaaaaaaa.tmp"
    taken.write_bytes(b"someone else's")
    with atomic_output(tmp_path / "report.md") as handle:
        handle.write(b"mine")
    assert (tmp_path / "report.md").read_bytes() == b"mine"
    assert taken.read_bytes() == b"someone else's"


# --- JSON -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("document", "where", "value"),
    [({"a": {"b": [1.0, math.inf]}}, "a.b[1]", "inf"),
     ({"top": -math.inf}, "top", "-inf"),
     ({"x": [{"y": (0.0, math.inf)}]}, "x[0].y[1]", "inf")],
)
def test_infinite_figure_is_named_and_the_old_file_kept(
    tmp_path: Path, document: dict[str, Any], where: str, value: str
) -> None:
    path = tmp_path / "report.json"
    path.write_text("old")
    with pytest.raises(NonFiniteError) as info:
        write_json(path, document)
    assert str(info.value) == (f"cannot write {path}: {where} is {value}; JSON holds only "
                               "finite numbers")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


# --- Markdown report and plots --------------------------------------------------------


def test_markdown_report_hash_prefix_caching_and_attribution() -> None:
    document = _document([_arm("builtin")], attribution="Trace by someone, CC-BY")
    text = markdown_report(document, {})
    assert "sha256 `0123456789abcdef…`" in text
    assert "prefix caching on," in text
    assert text.rstrip().endswith("## Trace attribution\n\nTrace by someone, CC-BY")
    document["settings"]["enable_prefix_caching"] = False
    del document["trace"]["attribution"]
    text = markdown_report(document, {})
    assert "prefix caching off," in text
    assert "Trace attribution" not in text


def test_write_plots_raises_the_first_failure(tmp_path: Path) -> None:
    """Both plots failing raises the TTFT plot's error (the first); nothing is left."""
    (tmp_path / "ttft_cdf.png").mkdir()
    (tmp_path / "bars.png").mkdir()
    arms = [{"label": "a", "recompute_tax": 0.1, "ttft_s": {"p95": 0.5}}]
    with pytest.raises(IsADirectoryError) as info:
        write_plots(tmp_path, [("a", [0.1, 0.2])], arms)
    assert str(info.value.filename2).endswith("ttft_cdf.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bars.png", "ttft_cdf.png"]


# --- runtime evidence -----------------------------------------------------------------


def _fake_stat(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str) -> None:
    stat_file = tmp_path / "stat"
    stat_file.write_text(text)
    monkeypatch.setattr(evidence, "Path", lambda _path: stat_file)


@pytest.mark.parametrize("text", ["42 (x) S 1 2 3\n", "42 (x) " + "S " * 19 + "soon 1\n"])
def test_start_identity_is_none_for_a_short_or_non_numeric_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str
) -> None:
    _fake_stat(monkeypatch, tmp_path, text)
    assert evidence.start_identity(42) is None


def test_sink_appends_sorted_compact_lines(tmp_path: Path) -> None:
    path = tmp_path / "ev.jsonl"
    sink = evidence.evidence_sink_from_env({evidence.EVIDENCE_PATH_ENV: str(path)})
    assert sink is not None
    sink("initialized", {"z": 1, "a": 2})
    sink("effective", {"calls": 3})
    lines = path.read_text().splitlines()
    assert [json.loads(line)["event"] for line in lines] == ["initialized", "effective"]
    for line in lines:
        assert line == json.dumps(json.loads(line), separators=(",", ":"), sort_keys=True)


def test_a_latency_that_rounds_to_a_second_reads_in_seconds() -> None:
    """0.9996 s rounds to a second: it reads "1.00s", never "1000ms"; 0.9994 s is "999ms"."""
    assert _data_row(format_table([_arm("edge", 0.9996)], {}), "edge").split()[3] == "1.00s"
    assert _data_row(format_table([_arm("below", 0.9994)], {}), "below").split()[3] == "999ms"
