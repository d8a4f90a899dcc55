"""The lookahead oracle of ``benchmarks/replay/headroom.py`` (``rollout`` suites).

Guards: the oracle forks the whole replay at each decision, so its children must stop and
report without touching the parent's output, and the parent must keep the cheapest
option. With an unbounded horizon each child plays its option to the end of the trace,
and the replay is deterministic, so the oracle can never recompute more than LCF, its
base policy (the rollout cost-improvement property); on the window below it recomputes
strictly less, which fails if the children's costs did not reach the parent. With sampled
output lengths the children rewrite lengths in their own copy only: the parent's requests
still end at exactly their trace lengths. Runs the real ``bidkv-replay`` in a subprocess
(the oracle forks; pytest's process must not be forked) through the real vLLM scheduler.
Each ``--objective`` keeps the option it names (``tax-no-later`` never one that makes
requests wait longer than LCF's), and LCF's choice unless another is strictly better.
``BIDKV_ROLLOUT_KNOWN=1`` (every true length kept in the sampled futures) decides exactly as
the clairvoyant oracle. A malformed ``BIDKV_ROLLOUT_*`` knob stops the replay with one line
naming it, before any report is written.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.conftest import HAVE_VLLM

pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (real-scheduler tier)")

REPO = Path(__file__).resolve().parents[1]
ORACLE = "headroom:RolloutOracle"
WINDOW = ["--max-requests", "80", "--num-gpu-blocks", "250",
          "--no-prefix-caching", "--no-plots", "--no-progress"]


def _replay(tmp_path: Path, **knobs: str) -> dict[str, Any]:
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(REPO / "benchmarks" / "replay"), **knobs)
    code = ("import sys; from bidkv_ext.replay.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    done = subprocess.run(
        [sys.executable, "-c", code, *WINDOW, "--policies", "least-computed-first",
         "--policy-class", ORACLE, "--output-dir", str(out)],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    return report


def test_oracle_never_recomputes_more_than_lcf_and_children_stay_silent(tmp_path: Path) -> None:
    report = _replay(tmp_path, BIDKV_ROLLOUT_HORIZON="inf", BIDKV_ROLLOUT_WIDTH="3")
    arms = {arm["label"]: arm for arm in report["arms"]}
    assert list(arms) == ["least-computed-first", ORACLE]  # one report, both arms, in order
    lcf, oracle = arms["least-computed-first"], arms[ORACLE]
    for arm in (lcf, oracle):
        assert arm["conservation"]["all_completed_once"], arm["label"]
        assert arm["conservation"]["exact_output_lengths"], arm["label"]
    assert lcf["preemptions"] > 0
    assert oracle["controller"]["calls"] == oracle["preemptions"]
    assert oracle["recomputed_tokens"] < lcf["recomputed_tokens"]


def test_sampled_lengths_stay_in_the_children(tmp_path: Path) -> None:
    report = _replay(tmp_path, BIDKV_ROLLOUT_HORIZON="5", BIDKV_ROLLOUT_WIDTH="1",
                     BIDKV_ROLLOUT_SAMPLES="2")
    oracle = {arm["label"]: arm for arm in report["arms"]}[ORACLE]
    assert oracle["controller"]["calls"] > 0
    assert oracle["conservation"]["all_completed_once"]
    assert oracle["conservation"]["exact_output_lengths"]


def test_known_lengths_reproduce_the_clairvoyant_oracle(tmp_path: Path) -> None:
    """BIDKV_ROLLOUT_KNOWN=1 keeps every true length in the sampled futures, so each option
    costs twice its clairvoyant cost and the oracle decides exactly as the clairvoyant one."""
    knobs = {"BIDKV_ROLLOUT_HORIZON": "5", "BIDKV_ROLLOUT_WIDTH": "2"}

    def oracle(path: Path, **more: str) -> dict[str, Any]:
        report = _replay(path, **knobs, **more)
        return {arm["label"]: arm for arm in report["arms"]}[ORACLE]

    clairvoyant = oracle(tmp_path / "c")
    known = oracle(tmp_path / "k", BIDKV_ROLLOUT_SAMPLES="2", BIDKV_ROLLOUT_KNOWN="1")
    figures = ("recomputed_tokens", "preemptions", "max_preemptions_one_request")
    assert [known[f] for f in figures] == [clairvoyant[f] for f in figures]
    assert known["ttft_s"] == clairvoyant["ttft_s"]


@pytest.mark.parametrize("share", [0.0, 0.5])
def test_resample_keeps_exactly_the_known_lengths(
    monkeypatch: pytest.MonkeyPatch, share: float
) -> None:
    """The requests picked as known keep their true lengths in every sampled future; the
    others are redrawn (longer than what they produced); the pick is the share, seeded."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks" / "replay"))
    from headroom import _Rollout

    from bidkv_ext.replay.trace import TraceRequest

    monkeypatch.setattr(_Rollout, "samples", 2)
    monkeypatch.setattr(_Rollout, "known", share)
    n = 400
    requests = [TraceRequest(index=i, arrival=float(i), input_length=300 + i % 50,
                             output_length=1000 + 7 * i) for i in range(n)]
    truth = [r.output_length for r in requests]
    loop = SimpleNamespace(requests=requests, lengths=list(truth), tokens=[5] * n,
                           finish=[math.nan] * (n - 1) + [3.0])
    _Rollout.start(loop)  # type: ignore[arg-type]
    known = _Rollout.known_ids
    assert abs(len(known) - share * n) <= 0.1 * n
    _Rollout.resample(123)
    for i in range(n - 1):
        if i in known:
            assert loop.lengths[i] == truth[i]
        else:
            assert loop.lengths[i] > 5
    redrawn = sum(loop.lengths[i] != truth[i] for i in range(n - 1) if i not in known)
    assert redrawn >= 0.9 * (n - 1 - len(known))
    assert loop.lengths[n - 1] == truth[n - 1]  # finished: untouched
    _Rollout.start(loop)  # type: ignore[arg-type]
    assert _Rollout.known_ids == known  # the same requests every time


@pytest.mark.parametrize(
    ("objective", "chosen"),
    [("tax", "cheap-slow"), ("wait", "fast"), ("tax-no-later", "cheap-prompt")],
)
def test_each_objective_keeps_its_option_and_lcf_unless_strictly_better(
    monkeypatch: pytest.MonkeyPatch, objective: str, chosen: str
) -> None:
    monkeypatch.syspath_prepend(str(REPO / "benchmarks" / "replay"))
    from headroom import _Rollout

    monkeypatch.setattr(_Rollout, "objective", objective)
    costs = {  # option: [tax, wait]
        "lcf": [100.0, 50.0],
        "cheap-slow": [10.0, 60.0],  # least tax, but requests wait longer than under LCF
        "cheap-prompt": [40.0, 50.0],  # less tax, waits no longer than LCF
        "fast": [200.0, 20.0],
    }
    assert _Rollout.choose("lcf", costs) == chosen
    # LCF is kept on a tie: an option has to be strictly better to displace it.
    tie = {"lcf": [100.0, 50.0], "same": [100.0, 50.0]}
    assert _Rollout.choose("lcf", tie) == "lcf"


@pytest.mark.parametrize(
    ("knob", "value", "expected"),
    [("BIDKV_ROLLOUT_OBJECTIVE", "cheapest", "one of tax, wait, tax-no-later"),
     ("BIDKV_ROLLOUT_WIDTH", "four", "a whole number of candidates >= 1"),
     ("BIDKV_ROLLOUT_WIDTH", "-3", "a whole number of candidates >= 1"),
     ("BIDKV_ROLLOUT_HORIZON", "nan",
      "a number of seconds above 0 (inf: to the end of the trace)"),
     ("BIDKV_ROLLOUT_HORIZON", "0",
      "a number of seconds above 0 (inf: to the end of the trace)"),
     ("BIDKV_ROLLOUT_KNOWN", "1.5", "a share between 0 and 1"),
     ("BIDKV_ROLLOUT_KNOWN", "nan", "a share between 0 and 1")],
)
def test_a_bad_knob_stops_with_one_line_naming_it(
    tmp_path: Path, knob: str, value: str, expected: str
) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO / "benchmarks" / "replay"), **{knob: value})
    done = subprocess.run(
        [sys.executable, "-c", "import bidkv_ext.replay.cli as c, sys; "
         "sys.exit(c.main(sys.argv[1:]))", *WINDOW, "--policy-class", ORACLE,
         "--output-dir", str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == f"{knob}: expected {expected}, got {value!r}"
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out" / "report.json").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--width", "-3"], "argument --width: expected a whole number of candidates >= 1, got '-3'"),
     (["--horizon", "nan"], "argument --horizon: expected a number of seconds above 0 (inf: to "
                            "the end of the trace), got 'nan'"),
     (["--samples", "-1"], "argument --samples: expected a whole number >= 0 (0: true output "
                           "lengths), got '-1'"),
     (["--starts", "0,0"], "argument --starts: expected distinct comma-separated whole "
                           "seconds >= 0 such as 0,1400, got '0,0'")],
)
def test_headroom_refuses_a_bad_rollout_option_before_any_replay(
    tmp_path: Path, argv: list[str], message: str
) -> None:
    """``headroom.py rollout --width -3 --horizon nan`` used to start the 300 s replays: a
    negative width sliced candidates off the far end and a NaN deadline was never reached.
    Both are usage errors now, before any folder or replay."""
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "replay" / "headroom.py"), "rollout",
         *argv, "--out", str(tmp_path / "out"), "--no-write"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == f"headroom.py: error: {message}"
    assert not (tmp_path / "out").exists()
