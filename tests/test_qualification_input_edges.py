"""Qualification inputs that passed validation and failed later, or passed unseen:

- profile values a run cannot use are refused when the profile loads, in one line naming
  the field: an empty ``delays_s`` (division by zero in the first serve arm), infinite or
  NaN seconds and temperatures, an environment variable name or value no process can hold,
  a manager configuration JSON cannot carry (a TOML date), a capture size below 1;
- a replay report without a figure the verdict rests on is refused naming it (it became an
  ``inconclusive`` cell blamed on a zero baseline); ``null`` (no samples) stays accepted;
- ``deltas.png`` is replaced atomically like the record and the report;
- the recovery gate compares with the token the default prompt asks for, unless a profile
  says otherwise.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from qualification.errors import QualificationError
from qualification.profile import PROFILE_DIR, WorkloadSpec, load_profile
from qualification.replay import arm_from_report
from qualification.report import write_plot

CUDA = (PROFILE_DIR / "cuda.toml").read_text(encoding="utf-8")


def _profile(tmp_path: Path, old: str, new: str) -> Path:
    assert old in CUDA, old
    path = tmp_path / "p.toml"
    path.write_text(CUDA.replace(old, new, 1), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("old", "new", "named"),
    [
        ('name = "homogeneous-long"', 'name = "homogeneous-long"\ndelays_s = []', "delays_s"),
        ('name = "homogeneous-long"', 'name = "homogeneous-long"\ndelays_s = [inf]',
         "delays_s.0"),
        ('name = "homogeneous-long"', 'name = "homogeneous-long"\ndelays_s = [-1.0]',
         "delays_s.0"),
        ("temperature = 0.0", "temperature = nan", "workload.temperature"),
        ("temperature = 0.0", "temperature = -1.0", "workload.temperature"),
        ("cancel_drain_bound_s = 1.0", "cancel_drain_bound_s = inf",
         "workload.cancel_drain_bound_s"),
        ('extension_id = "org.vllm-hust.bidkv"',
         'extension_id = "org.vllm-hust.bidkv"\nshutdown_grace_seconds = inf',
         "manager.shutdown_grace_seconds"),
        ("ready_timeout_s = 1800", "ready_timeout_s = inf", "server.ready_timeout_s"),
        ('environment = { CUDA_VISIBLE_DEVICES = "0" }',
         'environment = { "CUDA=VISIBLE" = "0" }', "server.environment"),
        ('environment = { CUDA_VISIBLE_DEVICES = "0" }',
         'environment = { CUDA_VISIBLE_DEVICES = "0\\u0000" }', "server.environment"),
        ("configuration = {}", "configuration = { when = 1979-05-27T07:32:00Z }",
         "manager.configuration"),
        ("cudagraph_capture_sizes = [1, 2, 4, 8]", "cudagraph_capture_sizes = [-1, 0]",
         "server.cudagraph_capture_sizes.0"),
    ],
)
def test_a_profile_value_no_run_can_use_is_refused_on_load(
    tmp_path: Path, old: str, new: str, named: str
) -> None:
    path = _profile(tmp_path, old, new)
    with pytest.raises(QualificationError) as caught:
        load_profile(str(path))
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"profile {path}: "), message
    where = message.removeprefix(f"profile {path}: ").split(": ")[0]
    assert where.endswith(named), message
    load_profile(str(_profile(tmp_path, old, old)))  # the shipped value loads


REPORT: dict[str, Any] = {"arms": [{
    "label": "bidkv", "requests": 4, "completed": 4, "output_tokens": 40,
    "throughput_output_tok_s": 12.5, "ttft_s": {"p50": 0.1, "p95": 0.2, "p99": 0.3},
    "e2e_s": {"p50": 1.0, "p95": 2.0}, "controller": {"calls": 3, "enabled": True},
}]}


@pytest.mark.parametrize("path", [("throughput_output_tok_s",), ("ttft_s", "p95"),
                                  ("e2e_s", "p50"), ("e2e_s",)])
def test_a_report_missing_a_gated_figure_is_refused_naming_it(path: tuple[str, ...]) -> None:
    doc = copy.deepcopy(REPORT)
    node = doc["arms"][0]
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    with pytest.raises(QualificationError, match=r"expected '(throughput_output_tok_s|"
                       r"ttft_s\.p95|e2e_s\.p50|e2e_s\.p95)'"):
        arm_from_report("candidate", doc, ["bidkv-replay"], 1.0, "r.json")


def test_a_null_figure_is_no_samples_not_a_malformed_report() -> None:
    doc = copy.deepcopy(REPORT)
    doc["arms"][0]["ttft_s"]["p95"] = None
    result = arm_from_report("candidate", doc, ["bidkv-replay"], 1.0, "r.json")
    assert math.isnan(result.ttft_p95) and result.throughput == 12.5
    doc["arms"][0]["ttft_s"]["p95"] = "0.2"
    with pytest.raises(QualificationError, match=r"expected 'ttft_s\.p95' to be a number or null"):
        arm_from_report("candidate", doc, ["bidkv-replay"], 1.0, "r.json")


def test_the_deltas_plot_is_replaced_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                ) -> None:
    import matplotlib.figure

    target = tmp_path / "deltas.png"
    target.write_bytes(b"previous figure")

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", fail)
    with pytest.raises(OSError, match="disk full"):
        write_plot(target, [])
    assert target.read_bytes() == b"previous figure"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deltas.png"]
    monkeypatch.undo()
    write_plot(target, [])
    assert target.read_bytes().startswith(b"\x89PNG")
    assert oct(target.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_the_recovery_gate_expects_the_token_the_default_prompt_asks_for() -> None:
    workload = WorkloadSpec()
    assert workload.recovery_expected is not None
    assert workload.recovery_prompt.endswith(workload.recovery_expected)
    assert json.loads(WorkloadSpec(recovery_expected=None).model_dump_json())[
        "recovery_expected"] is None  # a profile may still accept any answer


def test_replay_pairs_carry_deltas_of_the_policy_figures_and_all_latencies() -> None:
    """qualification.md §5: a delta and interval for throughput and P95 latency "and any
    other reported metric": a replay arm's report gives TPOT and E2E P99 too, and the
    pair gets deltas of the recompute tax and the preemption rate, what the policy is for."""
    from qualification.verdict import Pair

    def arm(name: str, tax: float) -> Any:
        doc = copy.deepcopy(REPORT)
        entry = doc["arms"][0]
        entry.update(recompute_tax=tax, preemptions_per_1k=tax * 1000,
                     tpot_s={"p50": 0.01, "p95": 0.02, "p99": 0.03})
        entry["e2e_s"]["p99"] = 3.0
        return arm_from_report(name, doc, ["bidkv-replay"], 1.0, "r.json")

    baseline, candidate = arm("baseline", 0.04), arm("candidate", 0.03)
    assert (candidate.extra["tpot_p95"], candidate.extra["e2e_p99"]) == (0.02, 3.0)
    pair = Pair("cell", 0, "baseline", baseline, candidate)
    assert {"recompute_tax", "preemptions_per_1k", "tpot_p95", "e2e_p99"} <= set(pair.metrics())
    assert pair.delta("recompute_tax") == pytest.approx(-25.0)
    assert pair.delta("preemptions_per_1k") == pytest.approx(-25.0)
