"""Gaps a mutation audit of ``bidkv_ext.replay.cli`` and ``bidkv_ext.replay.arms`` found.

Each test kills at least one hand-made mutant that survived every other replay test; its
docstring names the rule and the mutant. Behaviours guarded:

- the clairvoyant reference (O1) returns its argmax whatever its value: a request already
  at (or past) its true length is still a victim, never an abstention;
- the reference BidKV 0.2.1 rule weighs completion by 0.5 (reference-lessons.md section 1);
- ``--policies``: empty entries are skipped, a list naming no arm is refused, an unknown
  name lists every accepted name (the reference arms too), ``prefill_chunk_tokens`` is an
  engine setting no arm may set;
- policy wiring: a named arm forces its strategy on (over a user kill switch) and merges
  its settings over the user's ``"bidkv"`` section; ``--policy-class`` refuses an empty
  module or object part for its shape, walks ``Outer.Inner`` attributes, and accepts a
  policy instance (so does ``--preemption-policy``); ``check_arms`` validates a subclass of
  our selector like the selector;
- number checks name the flag at their exact bounds: ``--num-gpu-blocks 1``,
  ``--max-requests 0``, ``--blocks-per-page 0``, ``--duration 0``, ``--rate-scale 0``, and
  ``--max-num-batched-tokens`` equal to ``--max-num-seqs`` is accepted;
  ``--additional-config`` must hold a JSON object; a vLLM configuration error is one line;
- KV sizing: a request needs ceil((prompt + output - 1) / block_size) blocks and is kept
  when that exactly fills the pool; a capacity schedule's time counts from the first
  replayed arrival, and a request arriving at the last change counts as late;
- defaults: the sample's 1600 blocks vs 4096 for any other trace; the default arms
  builtin, least-computed-first, bidkv; prefix caching on and the other documented
  settings;
- conservation: each rule of ``_conserved`` can fail an arm, and a violation exits 1 after
  the outputs are written.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pytest

from bidkv_ext.contract import PreemptionContext
from bidkv_ext.replay import cli
from bidkv_ext.replay.arms import (
    ArmError,
    ClairvoyantShortestRemaining,
    ReferenceBidkv021,
    arm_config,
    check_arms,
    named_arm,
    parse_arms,
)
from bidkv_ext.replay.cli import main
from bidkv_ext.selector import BidkvPreemptionPolicy
from bidkv_ext.strategies import STRATEGY_NAMES
from tests.conftest import HAVE_VLLM
from tests.policy_helpers import cand, ctx
from tests.test_replay_cli_errors import _refused

NEEDS_VLLM = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (real-scheduler tier)")


def test_clairvoyant_picks_a_victim_when_nothing_remains() -> None:
    """O1 is the argmax of (true remaining, -computed) over every candidate, even when no
    candidate has output left. Kills ``if best_id is None or key > best_key`` ->
    ``if key > best_key`` (its (0, 0) start then beats every key, and it abstains)."""
    oracle = ClairvoyantShortestRemaining({"a": 5, "b": 5})
    done = [cand("a", computed=40, output=5), cand("b", computed=20, output=5)]
    # Both are at their true length (remaining 0): the least computed of the two.
    assert oracle.select_victim(ctx(done)) == "b"
    # A request past its length (remaining < 0) is still a victim when it is the only one.
    assert oracle.select_victim(ctx([cand("a", computed=40, output=9)])) == "a"


def test_reference_rule_weighs_completion_by_one_half() -> None:
    """U = computed / (1 + 0.5 c + 0.3 P + 1e-6): a fully generated request (c = 1) with
    1000 computed has U = 666.7, below a fresh one's 700. Kills ``0.5 * progress`` ->
    ``0.3 * progress`` (then U = 769.2 and the finished request is evicted)."""
    finished = cand("finished", computed=1000, output=1024, max_tokens=1024)
    fresh = cand("fresh", computed=700)
    tiny = cand("req", computed=1)
    context = ctx([finished, fresh, tiny], requester="req")
    assert ReferenceBidkv021().select_victim(context) == "fresh"


def test_policies_skip_empty_entries() -> None:
    """``--policies`` drops empty entries (a doubled or trailing comma) rather than refusing
    an unknown policy ''. Kills ``return [n for n in names if n]`` -> ``return names``."""
    arms = parse_arms(" builtin,, bidkv ,", preemption_policy=None, policy_classes=[], seed=0)
    assert [a.label for a in arms] == ["builtin", "bidkv"]


def test_an_arm_cannot_set_the_prefill_chunk(capsys: pytest.CaptureFixture[str],
                                             tmp_path: Path) -> None:
    """``prefill_chunk_tokens`` is the engine's token budget, which replaces it in every arm;
    an arm setting it is refused naming --max-num-batched-tokens (exit 2, one line). Kills
    dropping ``prefill_chunk_tokens`` from ``_ENGINE_SETTINGS`` (the arm then ran with the
    engine's value while its label claimed its own)."""
    spec = "bidkv{prefill_chunk_tokens=512}"
    assert _refused(capsys, tmp_path, "--policies", spec) == (
        f"bidkv-replay: error: --policies {spec!r}: prefill_chunk_tokens describes the engine, "
        "not one arm; set it for every arm with --max-num-batched-tokens")


def test_a_named_arm_overrides_the_users_kill_switch() -> None:
    """A ``--policies`` strategy arm runs its strategy even when ``--additional-config``
    turns the kill switch on (which would make the selector the built-in victim while the
    arm's label says otherwise). Kills dropping ``"kill_switch": False`` from the arm's
    overrides."""
    arm = named_arm("bidkv", 0)
    config = arm_config(arm, {"bidkv": {"kill_switch": True, "enabled": False}}, environ={},
                        block_size=16, prefix_caching=True)
    assert config.enabled is True and config.kill_switch is False
    assert config.strategy == "bidkv"


def test_an_unknown_policy_lists_every_accepted_name(capsys: pytest.CaptureFixture[str],
                                                     tmp_path: Path) -> None:
    """An unknown ``--policies`` name is refused listing every accepted name, the reference
    arms included. Kills ``sorted(known | {CLAIRVOYANT, REFERENCE_BIDKV})`` ->
    ``sorted(known)`` (the message then hid two names the flag takes)."""
    accepted = ", ".join(sorted({*STRATEGY_NAMES, "clairvoyant", "bidkv-0.2.1"}))
    assert _refused(capsys, tmp_path, "--policies", "bidkv,nosuch") == (
        f"bidkv-replay: error: --policies: unknown policy 'nosuch'; accepted: {accepted}")


@pytest.mark.parametrize("spec", [":BidkvPreemptionPolicy", "bidkv_ext.selector:"])
def test_a_policy_class_without_module_or_object_is_a_shape_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, spec: str
) -> None:
    """``--policy-class`` with an empty module or object part is refused for its shape,
    naming the expected 'module:Object', not as an import failure. Kills
    ``if not sep or not module_name or not attr`` -> ``if not sep``."""
    assert _refused(capsys, tmp_path, "--policy-class", spec) == (
        f"bidkv-replay: error: --policy-class must look like 'module:Object', got {spec!r}")


class _FirstCandidate:
    """A contract implementation: always the first candidate."""

    def select_victim(self, context: PreemptionContext) -> str | None:
        return context.candidates[0].request_id


FIRST_CANDIDATE = _FirstCandidate()
"""An instance, as a policy module may export one."""


def test_a_policy_instance_is_accepted_as_an_arm() -> None:
    """An object with ``select_victim`` (an instance, not a class) is a policy the host's
    loader takes, so ``--policy-class`` and ``--preemption-policy`` accept it and the arm
    hands the host that very object. Kills dropping the ``isinstance(obj,
    PreemptionPolicy)`` acceptance in ``_not_a_policy`` (the instance was then refused as
    'not a preemption policy')."""
    arms = parse_arms(None, preemption_policy=f"{__name__}.FIRST_CANDIDATE",
                      policy_classes=[f"{__name__}:FIRST_CANDIDATE"], seed=0)
    assert [a.kind for a in arms] == ["host", "class"]
    assert arms[1].factory({}) is FIRST_CANDIDATE


def test_a_named_arm_keeps_the_users_bidkv_section_under_its_own_settings() -> None:
    """A ``--policies`` arm's settings are merged over the user's ``--additional-config``
    ``"bidkv"`` section, not in place of it: a setting the arm does not name keeps the
    user's value, one it names is the arm's. Kills ``merged = dict(section) if section is
    not None else {}`` -> ``merged = {}`` (the user's section was then silently ignored
    while report.json still recorded it)."""
    user = {"bidkv": {"preempt_weight": 2.5, "base_cost": 10.0}, "other": 1}
    plain = arm_config(named_arm("bidkv", 0), user, environ={}, block_size=16,
                       prefix_caching=True)
    assert (plain.preempt_weight, plain.base_cost) == (2.5, 10.0)
    own = arm_config(named_arm("bidkv{preempt_weight=3}", 0), user, environ={},
                     block_size=16, prefix_caching=True)
    assert (own.preempt_weight, own.base_cost) == (3, 10.0)


class _OurSelectorTuned(BidkvPreemptionPolicy):
    """A subclass of our selector: the host builds it with the selector's from_vllm_config."""


def test_check_arms_validates_a_subclass_of_our_selector() -> None:
    """An arm whose policy is a subclass of our selector builds its BidKV configuration as
    the selector does, so ``check_arms`` refuses a bad ``"bidkv"`` section for it up front
    too. Kills ``issubclass(obj, selector)`` -> ``obj is selector`` (the bad section then
    surfaced only when the engine built the arm)."""
    arms = parse_arms(None, preemption_policy=f"{__name__}._OurSelectorTuned",
                      policy_classes=[f"{__name__}:_OurSelectorTuned"], seed=0)
    for arm in arms:
        with pytest.raises(ArmError, match=re.escape("additional_config['bidkv']['zz']")):
            check_arms([arm], {"bidkv": {"zz": 1}}, environ={}, block_size=16,
                       prefix_caching=True)


class _Policies:
    """A namespace holding a policy class, as ``module:Outer.Inner`` names it."""

    First = _FirstCandidate


def test_a_policy_class_path_walks_dotted_attributes() -> None:
    """``--policy-class module:Outer.Inner`` walks the attributes after the colon one by
    one (the host's loader rule). Kills ``attr.split(".")`` -> ``[attr]`` (one getattr of
    'Outer.Inner', which fails and refused the arm as unimportable)."""
    (arm,) = parse_arms(None, preemption_policy=None,
                        policy_classes=[f"{__name__}:_Policies.First"], seed=0)
    assert arm.label == f"{__name__}:_Policies.First"
    assert arm.factory({}) is _FirstCandidate


def test_a_token_budget_equal_to_the_sequence_cap_is_accepted(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """vLLM's rule is max_num_batched_tokens >= max_num_seqs, so equal values pass the
    number checks (the run then stops at the next check, an empty --output-dir, proving
    the numbers were accepted). Kills ``<`` -> ``<=`` in that check."""
    assert _refused(capsys, tmp_path, "--max-num-seqs", "64", "--max-num-batched-tokens",
                    "64", "--output-dir", " ") == (
        "bidkv-replay: error: --output-dir must name a directory, got an empty value")


def test_a_request_needs_blocks_for_all_but_its_last_token(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A request holds ceil((prompt + output - 1) / block_size) blocks (the last token is
    sampled, never fed back): 31 + 2 tokens need 2 blocks of 16, which exactly fill the 2
    usable blocks of ``--num-gpu-blocks 3``, so the request is kept (then a final capacity
    of 1 block is refused naming it and its 2 blocks). Kills ``output_length - 1`` ->
    ``output_length`` in ``_blocks`` and ``<= usable_blocks`` -> ``< usable_blocks`` in
    ``_fits`` (both drop the request: 'no request left'), and ``r.arrival >= last_change``
    -> ``>`` (the request arrives at the change, t = 0, and must count as late)."""
    trace = tmp_path / "one.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 31, "output_length": 2,
                                 "hash_ids": [0]}) + "\n")
    schedule = tmp_path / "one.json"
    schedule.write_text('[{"t": 0, "blocks": 1}]')
    message = _refused(capsys, tmp_path, "--trace", str(trace), "--num-gpu-blocks", "3",
                       "--capacity-schedule", str(schedule))
    assert message.startswith(f"bidkv-replay: error: --capacity-schedule {schedule}: its "
                              "final capacity of 1 blocks cannot hold request ")
    assert "(31 prompt + 2 output tokens, 2 blocks of 16 tokens)" in message
    assert "expected a final capacity of at least 2 blocks" in message


def test_capacity_schedule_time_counts_from_the_first_selected_arrival(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A schedule's ``t`` is seconds from the first arrival replayed (--help), which with
    ``--start`` is not the window start: with the window starting at 1 s, the first
    request at 1 s and a change at t = 2.5, the last change falls at 3.5 s, so only the
    request at 4 s counts as late (the one at 3 s arrives before the shrink). Kills
    ``requests[0].arrival + capacity.points[-1].t`` -> ``capacity.points[-1].t`` (the
    change then fell at 2.5 s and the refusal named the request at 3 s)."""
    rows = [(0, 10, 2), (2000, 10, 2), (4000, 180, 100), (5000, 200, 100)]  # ms, in, out
    trace = tmp_path / "four.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": i, "output_length": o,
                                         "hash_ids": [n]}) + "\n"
                             for n, (t, i, o) in enumerate(rows)))
    schedule = tmp_path / "late.json"
    schedule.write_text('[{"t": 2.5, "blocks": 17}]')
    message = _refused(capsys, tmp_path, "--trace", str(trace), "--start", "1",
                       "--duration", "10", "--num-gpu-blocks", "21",
                       "--capacity-schedule", str(schedule))
    assert "cannot hold request 3 (200 prompt + 100 output tokens, 19 blocks of 16 tokens), " \
           "arriving after the last change" in message


@NEEDS_VLLM
def test_a_model_length_vllm_refuses_is_one_line_naming_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A ``--max-model-len`` beyond the model's positions passes our number checks but not
    vLLM's own configuration (a pydantic ValueError of several lines): it is refused in the
    preflight as one line with the setting named and pydantic's 'Value error, ' prefix
    dropped, exit 2, no output directory. Kills ``except ValueError`` -> another type in
    ``main`` (a traceback) and dropping ``.removeprefix("Value error, ")``."""
    message = _refused(capsys, tmp_path, "--max-model-len", "200000", "--max-num-seqs", "1")
    assert "max_model_len" in message and "200000" in message
    assert "Value error" not in message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("sample", "usable"), [(True, 1599), (False, 4095)])
def test_the_default_kv_budget_depends_on_the_trace(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, sample: bool, usable: int
) -> None:
    """Without ``--num-gpu-blocks`` the bundled sample gets 1600 blocks (enough pressure to
    separate arms) and any other trace 4096 (--help); a capacity schedule above the usable
    blocks is refused naming that budget. Kills swapping the two defaults (``args.trace
    is None`` -> ``is not None``)."""
    schedule = tmp_path / "big.json"
    schedule.write_text('[{"t": 0, "blocks": 5000}]')
    trace = ["--trace", str(cli.SAMPLE_TRACE)] if not sample else []
    code = main([*trace, "--capacity-schedule", str(schedule), "--no-progress",
                 "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    assert f"blocks 5000 exceeds the usable KV blocks ({usable} = --num-gpu-blocks - 1)" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("policies", ["", ", ,"])
def test_policies_naming_no_arm_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, policies: str
) -> None:
    """A ``--policies`` value that names no arm (empty, or only commas) with no other policy
    flag is refused, not run as a replay of nothing that exits 0. Kills dropping the
    ``if not arms`` refusal in ``_policy_arms``."""
    assert _refused(capsys, tmp_path, "--policies", policies) == (
        "bidkv-replay: error: no policy arm: give --policies, --preemption-policy or "
        "--policy-class")
    assert not (tmp_path / "out").exists()


def _conserving_capacity_arm() -> dict[str, Any]:
    """The conservation and capacity figures of an arm that kept every rule."""
    return {
        "conservation": {"all_completed_once": True, "exact_output_lengths": True,
                         "free_blocks_end": 99, "usable_blocks": 99},
        "capacity": {"free_blocks_end": 90, "reserved_blocks_end": 9, "reserve_released": True,
                     "max_overcommit_after_shrink_blocks": 0},
    }


@pytest.mark.parametrize(("section", "key", "value"), [
    ("conservation", "free_blocks_end", 98),
    ("capacity", "reserve_released", False),
    ("capacity", "max_overcommit_after_shrink_blocks", 3),
])
def test_each_conservation_rule_can_fail_an_arm(section: str, key: str, value: object) -> None:
    """An arm conserves only if it ends with every block free (``free_blocks_end ==
    usable_blocks``), with an elastic pool's reserve released and no block over a completed
    shrink. Kills dropping the free-blocks comparison, dropping ``reserve_released`` and
    ``max_overcommit_after_shrink_blocks == 0`` -> ``>= 0`` in ``_conserved``."""
    arm = _conserving_capacity_arm()
    assert cli._conserved(arm)
    arm[section][key] = value
    assert not cli._conserved(arm)


@NEEDS_VLLM
def test_a_conservation_violation_exits_1_after_writing_the_outputs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, default_run: Path
) -> None:
    """An arm that breaks conservation still has its outputs written, then the run names it
    on stderr and exits 1 (report.json of a real replay, with that arm's figure flipped).
    Kills ``return 1`` -> ``return 0`` in ``_write_outputs``."""
    document = json.loads((default_run / "report.json").read_text())
    document["arms"][0]["conservation"]["all_completed_once"] = False
    out = tmp_path / "second"
    out.mkdir()
    capsys.readouterr()
    timing = json.loads((default_run / "timing.json").read_text())
    code = cli._write_outputs(argparse.Namespace(output_dir=out, no_plots=True), document, [],
                              timing["simulated_seconds_per_wall_second"],
                              timing["wall_seconds"])
    assert code == 1
    assert capsys.readouterr().err == "bidkv-replay: error: conservation violated for builtin\n"
    assert json.loads((out / "report.json").read_text()) == document


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real replay with the defaults (the bundled sample, its default arms and settings),
    cut to its first 3 requests and without plots; returns the output directory."""
    out = tmp_path_factory.mktemp("default") / "out"
    assert main(["--max-requests", "3", "--no-plots", "--no-progress",
                 "--output-dir", str(out)]) == 0
    return out


@NEEDS_VLLM
def test_the_default_run_uses_the_documented_arms_and_settings(default_run: Path) -> None:
    """With no policy flag the arms are builtin, least-computed-first and bidkv, in that
    order, on the sample's 1600-block budget with prefix caching on, blocks of 16, the
    model-length max_tokens and the sample's attribution (module docstring, --help, README).
    Kills dropping bidkv from ``DEFAULT_POLICIES`` and ``--prefix-caching`` defaulting off
    (and swapping the sample and trace block budgets)."""
    report = json.loads((default_run / "report.json").read_text())
    assert [arm["label"] for arm in report["arms"]] == [
        "builtin", "least-computed-first", "bidkv"]
    settings = report["settings"]
    assert settings["enable_prefix_caching"] is True
    assert (settings["num_gpu_blocks"], settings["block_size"]) == (1600, 16)
    assert (settings["max_num_seqs"], settings["max_num_batched_tokens"]) == (256, 8192)
    assert (settings["max_model_len"], settings["max_tokens"]) == (32768, "model-len")
    assert report["trace"]["attribution"] == cli.SAMPLE_ATTRIBUTION


@pytest.mark.parametrize("value", ["[1]", "3", '"text"', "null"])
def test_additional_config_that_is_not_an_object_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, value: str
) -> None:
    """``--additional-config`` must hold a JSON object (it becomes
    ``VllmConfig.additional_config``); valid JSON of another type is refused in one line.
    Kills dropping the ``isinstance(value, dict)`` check in ``_additional_config``."""
    assert _refused(capsys, tmp_path, "--additional-config", value) == (
        "bidkv-replay: error: --additional-config must contain a JSON object")


@pytest.mark.parametrize(("flag", "value", "expected"), [
    # --num-gpu-blocks counts the null block, so 1 leaves no usable block.
    ("--num-gpu-blocks", "1", "--num-gpu-blocks must be between 2 and 10,000,000, got 1"),
    ("--max-requests", "0", "--max-requests must be >= 1, got 0"),
    ("--blocks-per-page", "0", "--blocks-per-page must be >= 1, got 0"),
    ("--rate-scale", "0", "--rate-scale must be a finite number > 0, got 0.0"),
    ("--duration", "0", "--duration must be a finite number of seconds > 0, got 0.0"),
])
def test_each_number_check_refuses_its_exact_bound(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flag: str, value: str, expected: str
) -> None:
    """The number checks refuse the first value outside each flag's range, naming the flag
    and what it takes, before any later check could refuse it without the flag's name (an
    empty window, 'no request left', a geometry error). Kills, one case each: ``not 2 <=
    blocks`` -> ``not 1 <= blocks``; ``< 1`` -> ``< 0`` in the --max-requests and
    --blocks-per-page checks; ``args.rate_scale > 0`` -> ``>= 0``; ``duration > 0`` ->
    ``duration >= 0``."""
    assert _refused(capsys, tmp_path, flag, value) == f"bidkv-replay: error: {expected}"
