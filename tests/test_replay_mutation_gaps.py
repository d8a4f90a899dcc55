"""Behaviours a mutation audit of the replay, peer-rule, contract and host-adapter modules
found unguarded by any other test.

- Metrics (evaluation.md section 1): every rate over an empty denominator is 0.0, never its
  numerator; ``output_tokens`` and the token throughput count completed requests only; an
  output longer than the trace asked for breaks ``exact_output_lengths`` as a short one does.
- Traces: an explicit format overrides the suffix; an Azure count may carry a plus sign and
  blanks; a bad value is shown whole up to 60 characters, cut to 57 and "..." beyond; equal
  Azure timestamps are in order; requests are numbered 0, 1, 2 in file order (Mooncake blank
  lines not counted); a boolean Mooncake timestamp is refused; a Mooncake row has exactly
  ceil(input_length / 512) hash ids.
- Fake prompts: the ids follow the seed for Azure rows and Mooncake blocks, and two Azure
  requests do not share a first block.
- Step-time model files: each coefficient refuses Infinity and NaN by name; JSON nested
  too deeply is one error.
- Peer rules: ``ShortestRemaining()`` and ``CostAware()`` built directly use the default
  ``BidKVConfig``'s max_tokens substitute and block size.
- Host adapter (real vLLM scheduler): ``needed_blocks`` is never negative; a page holding
  a block another running request shares is not released by preempting the candidate;
  ``policy_scheduler`` without a ``VllmConfig`` is a one-line TypeError.
- Contract: an unknown name of the contract module is an AttributeError (only
  ``PreemptionPolicyController`` resolves lazily); ``CandidateFacts.pages_released`` is
  ``None`` unless given; ``PreemptionContextFacts`` without per-candidate facts carries an
  empty mapping a policy can decide from.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from bidkv_ext import BidKVConfig, BidkvPreemptionPolicy, contract
from bidkv_ext.contract import CandidateFacts, PreemptionContextFacts
from bidkv_ext.controller import PreemptionPolicyController as PolicyControllerAlias
from bidkv_ext.replay.engine import ArmRun, RequestOutcome
from bidkv_ext.replay.metrics import arm_metrics
from bidkv_ext.replay.steptime import StepTimeModelError, load_step_model
from bidkv_ext.replay.tokens import PromptFactory
from bidkv_ext.replay.trace import TraceError, TraceRequest, load_trace
from bidkv_ext.strategies.simple import CostAware, ShortestRemaining
from kvcached_provider import signals
from tests.policy_helpers import PageModelSource, cand, ctx

# -- metrics (evaluation.md section 1) -----------------------------------------------------


def _run(*outcomes: RequestOutcome, **fields: Any) -> ArmRun:
    """A hand-built arm result: every counter 0 unless given."""
    base: dict[str, Any] = dict(
        label="hand", kind="builtin", outcomes=outcomes, steps=0, computed_tokens=0,
        recomputed_tokens=0, recompute_upper_bound=0, preemption_events=0, pressure_steps=0,
        controller={}, free_blocks_end=9, usable_blocks=9, wall_seconds=0.0,
    )
    base.update(fields)
    return ArmRun(**base)


def test_a_rate_over_an_empty_denominator_is_zero_not_its_numerator() -> None:
    """Every rate is 0.0 when its denominator is 0, whatever the numerator: preemptions
    without a completed request are not "per 1k completions", and tokens delivered in a
    zero-length makespan are no throughput (rather than an unbounded one)."""
    unfinished = RequestOutcome("u", 0.0, math.nan, math.nan, 0, 4, 2, 0)
    m = arm_metrics(_run(unfinished, preemption_events=2, recomputed_tokens=5))
    assert m["completed"] == 0 and m["preemptions"] == 2
    assert m["preemptions_per_1k"] == 0.0
    assert m["victims_per_pressure_step"] == 0.0  # 2 victims, no pressure step recorded
    assert m["recompute_tax"] == 0.0  # 5 recomputed, nothing computed recorded

    instant = RequestOutcome("i", 1.0, 1.0, 1.0, 1, 1, 0, 1)  # arrives and ends at once
    m = arm_metrics(_run(instant, steps=0, free_block_steps=7, return_steps=3))
    assert m["makespan_s"] == 0.0 and m["output_tokens"] == 1 and m["completed"] == 1
    assert m["throughput_output_tok_s"] == m["throughput_req_s"] == 0.0
    assert m["goodput_req_s"] == 0.0
    assert m["kv_free_blocks_mean"] == 0.0 and m["steps_to_return_mean"] == 0.0


def test_output_tokens_and_throughput_count_completed_requests_only() -> None:
    """An unfinished request's partial output is not delivered output: ``output_tokens``
    and the token throughput count the tokens of completed requests only, as the request
    rates do (the makespan still starts at its arrival)."""
    done = RequestOutcome("d", 0.0, 1.0, 2.0, 3, 3, 0, 1)
    partial = RequestOutcome("p", 0.0, 1.0, math.nan, 5, 8, 0, 0)
    m = arm_metrics(_run(done, partial))
    assert m["output_tokens"] == done.output_tokens
    assert m["makespan_s"] == done.finish - done.arrival
    assert m["throughput_output_tok_s"] == pytest.approx(done.output_tokens / m["makespan_s"])


def test_an_output_longer_than_the_trace_breaks_conservation() -> None:
    """``exact_output_lengths`` means equal, not "at least": a request that produced more
    tokens than its trace row asked for breaks conservation as a short one does."""
    exact = RequestOutcome("e", 0.0, 1.0, 2.0, 3, 3, 0, 1)
    assert arm_metrics(_run(exact))["conservation"]["exact_output_lengths"] is True
    long = dataclasses.replace(exact, output_tokens=exact.expected_output + 1)
    assert arm_metrics(_run(exact, long))["conservation"]["exact_output_lengths"] is False


# -- trace parsing (trace.py) ----------------------------------------------------------------

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
MOONCAKE_ROWS = (
    '{"timestamp": 100, "input_length": 600, "output_length": 3, "hash_ids": [7, 8]}\n'
    '{"timestamp": 1600, "input_length": 700, "output_length": 1, "hash_ids": [7, 9]}\n'
)


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_an_explicit_format_overrides_the_suffix(tmp_path: Path) -> None:
    """``load_trace(path, fmt)`` with a format other than ``auto`` parses that format
    whatever the file is called (``--trace-format``)."""
    mooncake = load_trace(_write(tmp_path, "rows.csv", MOONCAKE_ROWS), "mooncake")
    assert [r.hash_ids for r in mooncake] == [(7, 8), (7, 9)]
    azure = load_trace(_write(tmp_path, "rows.jsonl",
                              AZURE_HEADER + "2023-11-16 18:15:46.5,374,44\n"), "azure")
    assert [(r.input_length, r.output_length, r.hash_ids) for r in azure] == [(374, 44, None)]



def test_an_azure_count_may_carry_a_plus_sign_and_blanks(tmp_path: Path) -> None:
    """A CSV count is ASCII digits with an optional sign (as ``int`` reads it) and
    surrounding blanks: "+374" and " 44 " are 374 and 44."""
    path = _write(tmp_path, "a.csv", AZURE_HEADER + "2023-11-16 18:15:46.5,+374, 44 \n")
    (row,) = load_trace(path)
    assert (row.input_length, row.output_length) == (374, 44)


def test_a_bad_value_is_shown_whole_up_to_60_characters(tmp_path: Path) -> None:
    """The bad value in a trace error is its ``repr`` when that fits 60 characters, and
    otherwise its first 57 characters and "..." (60 in all): never longer."""

    def shown(value: str) -> str:
        path = _write(tmp_path, "m.jsonl", '{"timestamp": 0, "input_length": "' + value
                      + '", "output_length": 1, "hash_ids": [1]}\n')
        with pytest.raises(TraceError) as info:
            load_trace(path)
        return str(info.value).split(", got ", 1)[1]

    fits = "x" * 58  # repr adds two quotes: 60 characters
    assert shown(fits) == repr(fits)
    longer = "y" * 59
    assert shown(longer) == repr(longer)[:57] + "..."
    assert len(shown("z" * 200)) == 60


def test_equal_azure_timestamps_are_in_order(tmp_path: Path) -> None:
    """Azure rows with the same TIMESTAMP (common at 100 ns resolution once cut to
    microseconds) are sorted: only a timestamp going back is refused."""
    row = "2023-11-16 18:15:46.6805900,374,44\n"
    later = "2023-11-16 18:15:46.6805904,10,2\n"  # the same microsecond
    first, second, third = load_trace(_write(tmp_path, "a.csv", AZURE_HEADER + row + row + later))
    assert first.arrival == second.arrival == third.arrival == 0.0
    assert [r.index for r in (first, second, third)] == [0, 1, 2]


def test_mooncake_requests_are_numbered_in_order_past_blank_lines(tmp_path: Path) -> None:
    """Each Mooncake request gets the next index (its request id in a replay): 0, 1, 2 in
    file order, blank lines not counted, so no two requests share an id."""
    rows = MOONCAKE_ROWS.splitlines(keepends=True)
    path = _write(tmp_path, "m.jsonl", rows[0] + "\n  \n" + rows[1] + rows[1])
    assert [r.index for r in load_trace(path)] == [0, 1, 2]


def test_a_boolean_mooncake_timestamp_is_refused(tmp_path: Path) -> None:
    """``true`` is no number of milliseconds (Python reads it as 1): the row is a trace
    error naming the field and the value, as for the length fields."""
    path = _write(tmp_path, "m.jsonl", '{"timestamp": true, "input_length": 5, '
                  '"output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert str(info.value) == (f"{path}:1: timestamp must be a finite number of "
                               "milliseconds >= 0, got True")


@pytest.mark.parametrize(
    ("input_length", "ids"), [(1, 1), (511, 1), (512, 1), (513, 2), (1024, 2), (1025, 3)]
)
def test_hash_ids_are_exactly_the_prompt_blocks(
    tmp_path: Path, input_length: int, ids: int
) -> None:
    """A Mooncake row has ceil(input_length / 512) hash ids: a prompt filling whole blocks
    has no extra id, and one id more or fewer is refused."""
    def row(count: int) -> str:
        return json.dumps({"timestamp": 0, "input_length": input_length, "output_length": 1,
                           "hash_ids": list(range(count))}) + "\n"

    (request,) = load_trace(_write(tmp_path, "m.jsonl", row(ids)))
    assert request.hash_ids == tuple(range(ids))
    for wrong in (ids - 1, ids + 1):
        with pytest.raises(TraceError, match=f"hash_ids has {wrong} ids, expected "
                           rf"ceil\(input_length/512\) = {ids}"):
            load_trace(_write(tmp_path, "m.jsonl", row(wrong)))


# -- fake prompts (tokens.py) -------------------------------------------------------------


def test_fake_prompts_follow_the_seed_and_differ_between_azure_requests() -> None:
    """The prompt ids are a function of the seed (``--seed`` changes them, the same seed
    repeats them) for Azure rows and Mooncake blocks alike, and two Azure requests never
    share a prompt prefix by accident."""
    azure = TraceRequest(index=1, arrival=0.0, input_length=64, output_length=1)
    other = TraceRequest(index=2, arrival=0.0, input_length=64, output_length=1)
    mooncake = TraceRequest(index=1, arrival=0.0, input_length=64, output_length=1,
                            hash_ids=(5,))
    for request in (azure, mooncake):
        assert PromptFactory(seed=0).prompt(request) == PromptFactory(seed=0).prompt(request)
        assert PromptFactory(seed=0).prompt(request) != PromptFactory(seed=1).prompt(request)
    prompts = PromptFactory(seed=0)
    # The first 16 ids are one vLLM block: a shared first block would be a prefix hit.
    assert prompts.prompt(azure)[:16] != prompts.prompt(other)[:16]


# -- step-time model files (steptime.py) ------------------------------------------------------


@pytest.mark.parametrize("key", ["a", "b", "c", "d"])
@pytest.mark.parametrize("value", ["Infinity", "NaN"])
def test_every_step_coefficient_must_be_finite(tmp_path: Path, key: str, value: str) -> None:
    """Each of a, b, c, d refuses Infinity and NaN (which ``json.loads`` accepts) with an
    error naming that key, before any replay runs."""
    fields = {"a": "0.001", "b": "0", "c": "0", "d": "0"} | {key: value}
    path = tmp_path / "model.json"
    path.write_text('{"name": "x", ' + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}")
    with pytest.raises(StepTimeModelError, match=rf"^{path}: {key}: "):
        load_step_model(str(path))


def test_a_deeply_nested_step_model_file_is_one_error(tmp_path: Path) -> None:
    """JSON nested past the parser's recursion limit is a one-line model error, not a
    RecursionError traceback."""
    path = tmp_path / "model.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(StepTimeModelError, match=rf"^{path}: JSON/TOML nested too deeply$"):
        load_step_model(str(path))


# -- peer rules (strategies/simple.py) ----------------------------------------------------


def test_peer_rule_defaults_match_the_configured_defaults() -> None:
    """``ShortestRemaining()`` and ``CostAware()`` built directly (as a user's own policy
    may) behave as the registry's instances under a default ``BidKVConfig``: the same
    ``max_tokens`` substitute and the same block size."""
    config = BidKVConfig()
    assert ShortestRemaining().default_max_tokens == config.default_max_tokens
    assert CostAware().block_size == config.block_size
    # No max_tokens: "unknown" has default - 1 tokens left, "known" default - 2.
    unknown = cand("unknown", output=1, max_tokens=0)
    known = cand("known", output=0, max_tokens=config.default_max_tokens - 2)
    context = ctx([unknown, known])
    assert ShortestRemaining().choose(context.candidates, context, None) is unknown
    # At block size bs, "two" (bs + 1 tokens) holds 2 blocks: 2 / (bs + 1) > 1 / bs, the
    # score of "one" (bs tokens, 1 block). With any larger block size both hold one block
    # and "one" scores higher.
    bs = config.block_size
    two = cand("two", computed=bs + 1, prompt=bs + 1, output=0, max_tokens=100)
    one = cand("one", computed=bs, prompt=bs, output=0, max_tokens=100)
    context = ctx([two, one])
    assert CostAware().choose(context.candidates, context, None) is two


# -- the contract module (contract.py) ----------------------------------------------------


def test_an_unknown_contract_name_is_an_attribute_error() -> None:
    """The module's lazy ``__getattr__`` resolves ``PreemptionPolicyController`` only: any
    other missing name is an AttributeError (so ``from ... import Typo`` fails at import
    instead of binding ``None``)."""
    assert contract.PreemptionPolicyController is PolicyControllerAlias
    assert not hasattr(contract, "PreemptionPolicyControler")  # a typo
    with pytest.raises(AttributeError, match="PreemptionPolicyControler"):
        _ = contract.PreemptionPolicyControler  # type: ignore[attr-defined]
    with pytest.raises(ImportError):
        exec("from bidkv_ext.contract import PreemptionVictim", {})


def test_candidate_facts_leave_pages_released_unknown_by_default() -> None:
    """``pages_released`` is ``None`` (unknown: no elastic KV) unless a host supplies it;
    0 would claim that preempting the candidate releases no page."""
    facts = CandidateFacts(exclusive_blocks=2, cached_blocks=1, total_blocks=3)
    assert facts.pages_released is None
    assert CandidateFacts(2, 1, 3, 0).pages_released == 0


def test_context_facts_without_candidate_facts_are_an_empty_mapping() -> None:
    """``PreemptionContextFacts(block_size, needed_blocks)`` carries an empty per-candidate
    mapping, so a policy can look any id up; the bidkv policy decides from such facts
    (every candidate then lacks block facts) without failing."""
    facts = PreemptionContextFacts(block_size=16, needed_blocks=1)
    assert dict(facts.facts) == {} and facts.facts.get("a") is None
    cands = [cand("a", computed=64), cand("b", computed=320), cand("req", computed=16)]
    context = ctx(cands, requester="req")
    chosen = BidkvPreemptionPolicy(BidKVConfig()).select_victim_with_facts(context, facts)
    assert chosen is None or chosen in {c.request_id for c in cands}


# -- the host adapter's block facts (hosts/vllm/scheduler.py) --------------------------------


class _Wants:
    """Asks for host facts and always abstains."""

    wants_host_facts = True

    def select_victim(self, context: Any) -> str | None:
        return None

    def select_victim_with_facts(self, context: Any, facts: Any) -> str | None:
        return None


def test_needed_blocks_is_a_shortfall_never_negative(
    vllm_offline: Any, make_scheduler: Any
) -> None:
    """``needed_blocks`` is the blocks the requester lacks beyond the free pool: 0, not a
    negative number, when the free pool could hold its next tokens (facts on the real
    scheduler, one 48-token request in a 64-block pool)."""
    block = 16
    scheduler = make_scheduler(num_gpu_blocks=64, preemption_policy=_Wants(), block_size=block)
    scheduler.add_request(vllm_offline.make_request("a", list(range(100, 148)), 8, 1.0))
    out = scheduler.schedule()
    scheduler.update_from_output(out, vllm_offline.runner_output_for(out, scheduler))
    (request,) = scheduler.running
    free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    facts = scheduler._host_facts(request, 1)
    # 48 + 1 tokens need 4 blocks; it holds the prompt's 3, so it lacks 1 and the pool
    # has more than that free.
    assert facts.facts["a"].total_blocks == 48 // block and free > 1
    assert facts.needed_blocks == 0


def _prompt(seed: int, blocks: int) -> list[int]:
    return [100 + seed * 1000 + i for i in range(16 * blocks)]


def test_a_page_with_a_block_another_request_shares_is_not_released(
    vllm_offline: Any, make_scheduler: Any
) -> None:
    """``pages_released`` counts a page only when every held block on it is exclusive to
    the candidate: a page whose blocks are all the candidate's, one of them shared with
    another running request (a prefix hit), stays held after preempting it."""
    # 21 blocks in pages of 4: {0 null, 1, 2, 3} {4, 5, 6, 7} {8, 9, 10, 11} ...
    scheduler = make_scheduler(num_gpu_blocks=21)
    # "c" starts with b's first block (a prefix hit: block 4 has two holders).
    layout = {"a": _prompt(1, 3), "b": _prompt(2, 4), "c": _prompt(2, 1) + _prompt(3, 1)}
    for i, (rid, prompt) in enumerate(layout.items()):
        scheduler.add_request(vllm_offline.make_request(rid, prompt, 4, float(i)))
    scheduler.schedule()
    ids = {rid: [b.block_id for b in scheduler.kv_cache_manager.get_blocks(rid).blocks[0]]
           for rid in layout}
    assert ids == {"a": [1, 2, 3], "b": [4, 5, 6, 7], "c": [4, 8]}
    with signals.signals_source(PageModelSource(signals.PageModel(4, 21))):
        facts = scheduler._host_facts(scheduler.requests["a"], 1)
    # a: page 0 also holds the null block. b: page 1 is all b's but block 4 is c's too.
    # c: page 2 holds only its block 8.
    assert {rid: f.pages_released for rid, f in facts.facts.items()} == {"a": 0, "b": 0, "c": 1}
    assert facts.facts["b"].exclusive_blocks == 3


def test_policy_scheduler_without_a_vllm_config_is_a_type_error(vllm_offline: Any) -> None:
    """The ``scheduler_cls`` factory names what it needs when called without a
    ``VllmConfig`` (positional or ``vllm_config=``), instead of failing inside vLLM."""
    from bidkv_ext.hosts.vllm.scheduler import policy_scheduler

    for args, kwargs in (((), {}), ((object(),), {}), ((), {"vllm_config": None})):
        with pytest.raises(TypeError, match=r"^policy_scheduler needs vllm_config \(a "
                           r"VllmConfig\)$"):
            policy_scheduler(*args, **kwargs)
