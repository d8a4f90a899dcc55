"""``benchmarks/replay/predictability.py``: the scores behind "what could an online rule know".

Guards: the C-index and AUC are 1 for a perfect ranking, 0 for a reversed one and 1/2 for a
constant (ties count half); running moments never have a request finished (remaining >= 1)
and weight long requests more; a predictor that sees the prompt bin recovers an output
length that depends on the prompt non-monotonically (as on the Azure conversation trace)
where output so far alone cannot; Spearman's rank correlation handles ties; the command
prints its table for the real shared traces without touching the README when told so, and
a malformed trace is one line and exit 2.
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest

from bidkv_ext.replay.trace import TraceRequest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "replay"))

import predictability as pr  # noqa: E402

TRACES = REPO.parent / "shared" / "traces"


def _requests(pairs: list[tuple[int, int]]) -> list[TraceRequest]:
    return [TraceRequest(index=i, arrival=float(i), input_length=p, output_length=o)
            for i, (p, o) in enumerate(pairs)]


def test_concordance_is_one_for_truth_zero_reversed_half_constant() -> None:
    rng = random.Random(1)
    truth = [float(rng.randrange(1, 500)) for _ in range(400)]
    assert pr.concordance(truth, truth, 5000, random.Random(2)) == 1.0
    assert pr.concordance([-t for t in truth], truth, 5000, random.Random(2)) == 0.0
    assert pr.concordance([7.0] * 400, truth, 5000, random.Random(2)) == 0.5


def test_concordance_without_a_differing_pair_is_nan() -> None:
    assert math.isnan(pr.concordance([1.0, 2.0], [3.0, 3.0], 100, random.Random(0)))


def test_soon_auc_orders_and_ties() -> None:
    finishes = [True, False] * 50
    perfect = [1.0 if f else 0.0 for f in finishes]
    assert pr.soon_auc(perfect, finishes, 2000, random.Random(0)) == 1.0
    assert pr.soon_auc([1 - c for c in perfect], finishes, 2000, random.Random(0)) == 0.0
    assert pr.soon_auc([0.3] * 100, finishes, 2000, random.Random(0)) == 0.5


def test_moments_are_running_and_weighted_by_length() -> None:
    requests = _requests([(100, 1), (100, 99)])
    drawn = pr.moments(requests, 20_000, random.Random(3))
    assert all(m.remaining >= 1 and m.produced >= 0 for m in drawn)
    assert all(m.produced + m.remaining in (1, 99) for m in drawn)
    long_share = sum(m.produced + m.remaining == 99 for m in drawn) / len(drawn)
    assert 0.98 < long_share < 1.0  # 99 of 100 weight units


def test_prompt_bin_recovers_a_non_monotonic_output_length() -> None:
    # Like the conversation trace: middle prompts get long outputs, the others short ones.
    rng = random.Random(5)
    pairs = []
    for _ in range(4000):
        p = rng.randrange(100, 3000)
        pairs.append((p, 400 if 1000 <= p < 2000 else 50))
    requests = _requests(pairs)
    train = pr.moments(requests[:2000], 50_000, rng)
    test = pr.moments(requests[2000:], 20_000, rng)
    truth = [float(m.remaining) for m in test]
    by_k = pr.fit_output_so_far(train)
    by_prompt = pr.fit_prompt_and_output(train, pr.decile_bin(train))
    c_k = pr.concordance([by_k(m) for m in test], truth, 20_000, rng)
    c_prompt = pr.concordance([by_prompt(m) for m in test], truth, 20_000, rng)
    assert c_prompt > c_k + 0.05
    assert c_prompt > 0.8


def test_power_of_two_bin_and_default_cap() -> None:
    assert [pr.power_of_two_bin(p) for p in (1, 2, 3, 4, 1023, 1024)] == [1, 2, 2, 3, 10, 11]
    cap = pr.default_cap(1000)
    assert cap(pr.Moment(prompt=300, produced=200, remaining=5)) == 500.0


def test_spearman_with_ties() -> None:
    assert pr.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert pr.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert pr._ranks([5.0, 1.0, 5.0]) == [1.5, 0.0, 1.5]


def test_malformed_trace_is_one_line_and_exit_2(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / pr.CONV).write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                    "2023-11-16 18:17:03.9799600,x,10\n")
    assert pr.main(["--traces", str(tmp_path), "--no-readme"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert pr.CONV in err and "ContextTokens" in err and "Traceback" not in err


@pytest.mark.skipif(not (TRACES / pr.CONV).exists(), reason="../shared/traces not beside the repo")
def test_real_traces_table_and_readme_untouched(capsys: pytest.CaptureFixture[str]) -> None:
    readme = (REPO / "benchmarks" / "replay" / "README.md").read_bytes()
    assert pr.main(["--traces", str(TRACES), "--samples", "4000", "--no-readme"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 5 and out[0].startswith("| trace |")
    conv = out[2].split(" | ")
    assert conv[0] == f"| {pr.CONV}"
    clairvoyant = float(conv[7])
    assert clairvoyant == 1.0
    assert all(0.0 <= float(cell) <= 1.0 for cell in conv[3:8])
    assert (REPO / "benchmarks" / "replay" / "README.md").read_bytes() == readme


def test_bundled_sample_and_a_small_mooncake_file(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Runs where ../shared/traces is absent (CI's clean clone): the bundled Azure sample
    under both Azure names, and a small Mooncake file with a prompt-dependent output."""
    from bidkv_ext.replay.cli import SAMPLE_TRACE

    for name in (pr.CONV, pr.CODE):
        (tmp_path / name).write_bytes(SAMPLE_TRACE.read_bytes())
    rng = random.Random(9)
    lines = []
    for i in range(600):
        p = rng.randrange(512, 8192)
        lines.append(f'{{"timestamp": {i * 100}, "input_length": {p}, '
                     f'"output_length": {600 if p > 4096 else 20 + i % 7}, '
                     f'"hash_ids": {list(range(-(-p // 512)))}}}')
    (tmp_path / pr.MOON).write_text("\n".join(lines) + "\n")
    assert pr.main(["--traces", str(tmp_path), "--samples", "3000", "--no-readme"]) == 0
    rows = [r.split(" | ") for r in capsys.readouterr().out.splitlines()[2:]]
    assert [r[0] for r in rows] == [f"| {pr.CONV}", f"| {pr.CODE}", f"| {pr.MOON}"]
    assert rows[0][1:] == rows[1][1:]  # same file, same seed: same figures
    moon_prompt, moon_k = float(rows[2][4]), float(rows[2][3])
    assert moon_prompt > moon_k  # the prompt tells long from short here


@pytest.mark.parametrize("rows", [1, 3])
def test_a_trace_too_short_to_split_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], rows: int
) -> None:
    """Fitted on the first half and scored on the second: a one-row trace crashed with an
    IndexError traceback (an empty half to sample from)."""
    from bidkv_ext.replay.cli import SAMPLE_TRACE

    head = SAMPLE_TRACE.read_text().splitlines()[:rows + 1]
    (tmp_path / pr.CONV).write_text("\n".join(head) + "\n")
    assert pr.main(["--traces", str(tmp_path), "--no-readme"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{pr.CONV}: {rows} usable request(s), expected at least 4" in err


def test_the_readme_line_names_the_options_the_table_was_made_with(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The README section's command carries every option that differs from its default
    (it was a fixed string, so a table made with --horizon 64 said it came from the
    default command)."""
    written: dict[str, str] = {}
    monkeypatch.setattr(pr, "write_section", lambda name, text: written.update({name: text}))
    monkeypatch.setattr(pr, "load_trace", lambda path: _requests(
        [(100 + 37 * i % 900, 10 + i % 50) for i in range(60)]))
    assert pr.main(["--traces", str(tmp_path), "--samples", "200", "--horizon", "64"]) == 0
    line = written["predictability"].splitlines()[0]
    assert line.startswith("`.venv/bin/python benchmarks/replay/predictability.py "
                           f"--samples 200 --horizon 64 --traces {tmp_path}`")
    assert "horizon 64 tokens, max_model_len 32,768" in line
