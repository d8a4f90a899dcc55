"""Replay outputs: terminal table, JSON (deterministic), Markdown report and PNG plots.

``report.json`` holds no wall-clock value, so the same inputs and seed give a
byte-identical file; replay speed (simulated seconds per wall second) goes to
``timing.json``, the terminal and the Markdown report.
"""

from __future__ import annotations

import json
import math
import os
import secrets
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

__all__ = [
    "NonFiniteError",
    "OutputError",
    "atomic_output",
    "capacity_markdown",
    "format_capacity_table",
    "format_table",
    "markdown_report",
    "output_error",
    "prepare_output_dir",
    "write_atomic",
    "write_json",
    "write_plots",
]

_COLUMNS: tuple[tuple[str, str], ...] = (
    ("policy", "{label}"),
    ("done", "{completed}"),
    ("tok/s", "{throughput_output_tok_s:.0f}"),
    ("TTFT p50", "{ttft_p50}"),
    ("TTFT p95", "{ttft_p95}"),
    ("TTFT p99", "{ttft_p99}"),
    ("TPOT p99", "{tpot_p99}"),
    ("E2E p99", "{e2e_p99}"),
    ("tax", "{recompute_tax:.2%}"),
    ("tax UB", "{recompute_tax_upper_bound:.2%}"),
    ("pre/1k", "{preemptions_per_1k:.1f}"),
    ("max pre", "{max_preemptions_one_request}"),
    ("goodput", "{goodput_req_s:.2f}"),
    ("calls/sel/abst", "{counters}"),
    ("sim s/wall s", "{speed}"),
)


def _seconds(value: object) -> str:
    if not isinstance(value, float) or math.isnan(value):
        return "-"
    # Below 0.9995 s: from there ms would round up to "1000ms" rather than read "1.00s".
    return f"{value * 1000:.0f}ms" if value < 0.9995 else f"{value:.2f}s"


def _row(arm: Mapping[str, Any], speed: float | None) -> list[str]:
    ttft, tpot, e2e = arm["ttft_s"], arm["tpot_s"], arm["e2e_s"]
    ctrl = arm["controller"]
    label = arm["label"]
    fields = dict(arm)
    fields.update(
        label=label,
        ttft_p50=_seconds(ttft["p50"]),
        ttft_p95=_seconds(ttft["p95"]),
        ttft_p99=_seconds(ttft["p99"]),
        tpot_p99=_seconds(tpot["p99"]),
        e2e_p99=_seconds(e2e["p99"]),
        counters=f"{ctrl.get('calls', 0)}/{ctrl.get('selections', 0)}/{ctrl.get('abstentions', 0)}",
        speed="-" if speed is None else f"{speed:.1f}",
    )
    return [template.format(**fields) for _, template in _COLUMNS]


def _rows(arms: Sequence[Mapping[str, Any]], speeds: Mapping[str, float]) -> list[list[str]]:
    return [_row(arm, speeds.get(str(arm["label"]))) for arm in arms]


def format_table(arms: Sequence[Mapping[str, Any]], speeds: Mapping[str, float]) -> str:
    """A fixed-width table for the terminal."""
    header = [name for name, _ in _COLUMNS]
    rows = _rows(arms, speeds)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in
                       enumerate(zip(row, widths, strict=True))) for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(arms: Sequence[Mapping[str, Any]], speeds: Mapping[str, float]) -> str:
    header = [name for name, _ in _COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in _rows(arms, speeds)]
    return "\n".join(lines)


_CAPACITY_COLUMNS: tuple[str, ...] = (
    "policy", "shrinks done", "shrink time max", "time in shrink", "steps in shrink",
    "min capacity", "free pages at shrink end", "over target in shrink",
    "overcommit after shrink", "reserve released",
)


def _capacity_rows(arms: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    rows = []
    for arm in arms:
        cap = arm.get("capacity")
        if not isinstance(cap, Mapping):
            continue
        rows.append([
            str(arm["label"]),
            f"{cap['shrinks_completed']}/{cap['shrinks']}",
            _seconds(cap["shrink_completion_s"]["max"]),
            _seconds(float(cap["time_in_shrink_s"])),
            str(cap["steps_in_shrink"]),
            str(cap["min_effective_blocks"]),
            _pages(cap["free_pages_at_shrink_end"]),
            str(cap["max_over_target_during_shrink_blocks"]),
            str(cap["max_overcommit_after_shrink_blocks"]),
            "yes" if cap["reserve_released"] else "NO",
        ])
    return rows


def _pages(pages: Mapping[str, Any]) -> str:
    if pages["min"] is None:
        return "-"
    return f"{pages['min']} (reserve {pages['reserve_pages_max']})"


def format_capacity_table(arms: Sequence[Mapping[str, Any]]) -> str:
    """The elastic-capacity table for the terminal; empty without a capacity schedule."""
    rows = _capacity_rows(arms)
    if not rows:
        return ""
    header = list(_CAPACITY_COLUMNS)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in
                       enumerate(zip(row, widths, strict=True))) for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def capacity_markdown(document: Mapping[str, Any]) -> list[str]:
    """The report's "Elastic capacity" section; no lines without a capacity schedule."""
    schedule = document["settings"].get("capacity_schedule")
    rows = _capacity_rows(document["arms"])
    if not schedule or not rows:
        return []
    points = ", ".join(f"{p['blocks']} blocks from t={p['t']:g} s" for p in schedule["points"])
    header = list(_CAPACITY_COLUMNS)
    return [
        "## Elastic capacity (kvcached semantics)",
        "",
        f"Schedule `{schedule['file']}`: {points} (t from the first arrival; "
        f"{schedule['blocks_per_page']} blocks per page; capacity signals "
        f"{'published' if schedule['signals'] else 'not published'} to the policy). A shrink "
        "takes effect only as blocks free (no block a request holds is revoked); growth is "
        "immediate.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] * len(header)) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
        "Columns: shrinks done = shrinks that reached their target / target decreases; "
        "shrink time max = longest time from a decrease to its target; min capacity = "
        "lowest usable blocks in force; free pages at shrink end = fewest pages whose blocks "
        "were all free or reserved when a shrink reached its target (reserve = the reserve "
        "in whole pages, what a page-perfect shrink frees); over target in shrink = most "
        "blocks in use above the target while a shrink was pending; overcommit after shrink "
        "= most blocks in use above the capacity once no shrink was pending (must be 0).",
        "",
    ]


class OutputError(Exception):
    """The output directory or a file in it cannot be written; the message is one line."""


def prepare_output_dir(out: Path, names: Sequence[str]) -> None:
    """Create ``out`` (with parents) and prove that ``names`` can be written there.

    Run before any replay, so a bad ``--output-dir`` costs nothing: the directory must be
    a directory, accept a new file, and no output name in it may be a directory (os.replace
    cannot put a file there).
    """
    flag = f"--output-dir {str(out)!r}"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise OutputError(f"{flag} exists and is not a directory") from None
    except OSError as exc:
        raise OutputError(f"{flag}: cannot create the directory: {_reason(exc)}") from None
    for name in names:
        if (out / name).is_dir():
            raise OutputError(f"{flag}: {name} in it is a directory, not a file")
    try:
        fd, probe = _create_temporary(out / "write-probe")
    except OSError as exc:
        raise OutputError(f"{flag}: cannot write there: {_reason(exc)}") from None
    os.close(fd)
    probe.unlink(missing_ok=True)


def output_error(path: Path, exc: OSError) -> OutputError:
    """The one-line error for an output file that could not be written."""
    return OutputError(f"cannot write {path}: {_reason(exc)}")


def _reason(exc: OSError) -> str:
    # strerror alone ("Not a directory") when the OS gives one: the path is named already.
    return exc.strerror or str(exc)


@contextmanager
def atomic_output(path: Path) -> Iterator[BinaryIO]:
    """A binary handle on a temporary file in ``path``'s directory, renamed onto ``path``
    (``os.replace``) when the block ends without error and removed otherwise, so ``path``
    is never left half-written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_temporary(path)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _create_temporary(path: Path) -> tuple[int, Path]:
    # Not tempfile.mkstemp: it creates mode 0600. O_CREAT with 0o666 lets the kernel apply
    # the umask (and any default ACL), so outputs get the mode any new file would get.
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name next to {path}")


def write_atomic(path: Path, data: bytes) -> None:
    """Write via a temporary file in the same directory and ``os.replace``."""
    with atomic_output(path) as handle:
        handle.write(data)


def _clean(value: Any) -> Any:
    # JSON has no NaN; a missing latency is null.
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


class NonFiniteError(ValueError):
    """A figure JSON cannot hold (infinity); the message names the file and the figure."""


def _non_finite(value: Any, where: str) -> tuple[str, float] | None:
    """The first infinite float in ``value`` (NaN is already None) and where it is."""
    if isinstance(value, float) and not math.isfinite(value):
        return where or "<root>", value
    if isinstance(value, Mapping):
        items: Any = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _non_finite(item, f"{where}[{key}]" if isinstance(key, int) else
                            f"{where}.{key}" if where else str(key))
        if found:
            return found
    return None


def write_json(path: Path, document: Mapping[str, Any]) -> None:
    """Write ``document`` (NaN as null); raises :class:`NonFiniteError` before touching
    ``path`` if a figure is infinite, since JSON has no infinity."""
    cleaned = _clean(document)
    try:
        text = json.dumps(cleaned, indent=2, sort_keys=True, allow_nan=False) + "\n"
    except ValueError:
        # Only then is the document walked, to name the figure json.dumps refused.
        found = _non_finite(cleaned, "")
        if not found:
            raise
        raise NonFiniteError(f"cannot write {path}: {found[0]} is {found[1]}; JSON holds "
                             "only finite numbers") from None
    write_atomic(path, text.encode())


def markdown_report(
    document: Mapping[str, Any], speeds: Mapping[str, float], *, plots: bool = True
) -> str:
    """report.md. Without ``plots`` it links no figure: a folder reused from an earlier
    run may still hold that run's."""
    trace, settings, model = document["trace"], document["settings"], document["step_model"]
    arms = document["arms"]
    lines = [
        "# bidkv-replay report",
        "",
        f"Trace `{trace['name']}` ({trace['format']}, sha256 `{trace['sha256'][:16]}…`): "
        f"{trace['requests']} requests replayed (window start {trace['start_s']} s, duration "
        f"{trace['duration_s']}, max requests {trace['max_requests']}, rate scale "
        f"{trace['rate_scale']}; {trace['filtered_too_long']} longer than max_model_len "
        f"{settings['max_model_len']} removed, {trace['filtered_kv_capacity']} larger than the "
        "KV pool removed).",
        "",
        f"Scheduler: real vLLM {document['host']['vllm_version']} "
        f"`{document['host']['scheduler']}`, "
        f"{settings['num_gpu_blocks']} KV blocks of {settings['block_size']} tokens, "
        f"max_num_seqs {settings['max_num_seqs']}, max_num_batched_tokens "
        f"{settings['max_num_batched_tokens']}, prefix caching "
        f"{'on' if settings['enable_prefix_caching'] else 'off'}, seed {document['seed']}.",
        "",
        f"Step-time model `{model['name']}`: t = {model['a']} + {model['b']}·prefill_tokens + "
        f"{model['c']}·decode_reqs + {model['d']}·Σdecode_context (s). Simulated latencies are "
        "not hardware predictions; compare arms with each other.",
        "",
        markdown_table(arms, speeds),
        "",
        "Columns: tax = recomputed ÷ computed tokens (exact, prefix hits excluded); tax UB = "
        "upper bound from Σ num_computed_tokens at preemption; goodput = requests/s meeting "
        "TTFT ≤ 2 s and TPOT ≤ 100 ms; calls/sel/abst = controller counters. Arms marked "
        "(reference) know the true output lengths: a reference line, not a bound.",
        "",
        *capacity_markdown(document),
        *(["![TTFT CDF](ttft_cdf.png)", "", "![Recompute tax and P95 TTFT](bars.png)", ""]
          if plots else []),
    ]
    attribution = document["trace"].get("attribution")
    if attribution:
        lines += ["## Trace attribution", "", str(attribution), ""]
    return "\n".join(lines)


def write_plots(out_dir: Path, runs: Sequence[tuple[str, list[float]]],
                arms: Sequence[Mapping[str, Any]]) -> None:
    """``ttft_cdf.png`` (TTFT CDF per arm) and ``bars.png`` (recompute tax, P95 TTFT).

    Each is written atomically; if one cannot be written the other still is, then the
    first OSError is raised."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, ttft in runs:
        if not ttft:
            continue
        xs = np.sort(np.asarray(ttft))
        ys = np.arange(1, len(xs) + 1) / len(xs)
        ax.step(xs, ys, where="post", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (simulated s, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF per policy")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    failed: list[OSError] = []
    _save(plt, fig, out_dir / "ttft_cdf.png", failed)

    labels = [str(a["label"]) for a in arms]
    tax = [100.0 * float(a["recompute_tax"]) for a in arms]
    p95 = [a["ttft_s"]["p95"] or 0.0 for a in arms]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.5))
    left.bar(labels, tax, color="tab:red")
    left.set_ylabel("recompute tax (%)")
    left.set_title("Recompute tax")
    right.bar(labels, p95, color="tab:blue")
    right.set_ylabel("P95 TTFT (simulated s)")
    right.set_title("P95 TTFT")
    for axis in (left, right):
        axis.tick_params(axis="x", rotation=30, labelsize=8)
        axis.grid(True, axis="y", alpha=0.3)
    _save(plt, fig, out_dir / "bars.png", failed)
    if failed:
        raise failed[0]


def _save(plt: Any, fig: Any, path: Path, failed: list[OSError]) -> None:
    """Render ``fig`` to ``path`` atomically (a failed render leaves no partial PNG); an
    OSError goes to ``failed`` so the other plot is still written."""
    try:
        fig.tight_layout()
        with atomic_output(path) as handle:
            # format: the temporary file's name does not end in .png.
            fig.savefig(handle, format="png", dpi=110, metadata={"Software": None})
    except OSError as exc:
        failed.append(exc)
    finally:
        plt.close(fig)
