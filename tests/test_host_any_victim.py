"""Any valid victim keeps the real vLLM scheduler consistent (property tests).

Behaviour guarded: whatever valid victim a preemption policy picks -- any candidate, the
requesting request itself, or ``None`` (abstain, so vLLM's own victim is taken) -- stock
vLLM 0.33.0's real v1 scheduler, driven through our adapter
(:mod:`bidkv_ext.hosts.vllm`), stays consistent, and every request completes exactly once
with exactly its output length; with speculative decoding too, where the adapter's
rollback of a victim already scheduled in the step must also take back its scheduled
draft tokens and the draft slots they charged to the input budget.

Hypothesis draws small workloads (3-12 requests, random prompt and output lengths,
arrivals over a few steps, optional shared prompt prefixes and duplicated prompts, random
priorities) and scheduler settings (prefix caching, chunked prefill, FCFS or priority
scheduling, synchronous or async scheduler, batch limits), with a KV pool that holds the
largest request alone but usually not the requests that run together, so the scheduler
preempts. The policy under test is :class:`ScriptedPolicy`: its answers come from a drawn
list of integers (0 abstains, 1 names the requester, ``k >= 2`` names candidate
``(k - 2) % len``), and it abstains once the list is used up, so every run ends under
vLLM's own victim rule and hypothesis shrinks towards stock behaviour. Half the runs ask
through the optional host-facts call (:class:`ScriptedFactsPolicy`), so the adapter also
computes block facts on every state the scripts reach. The async runs get
``PolicyAsyncScheduler`` from ``build_vllm_config(async_scheduling=True)`` (which keeps the
flag although vLLM's CPU platform switches it off); the speculative-decoding runs, whose
config vLLM rebuilds, name the class explicitly.

The speculative-decoding test draws the same workloads plus a method (``ngram``: no
drafter, no lookahead, no draft slots; ``draft_model`` on the bundled tiny config:
``num_lookahead_tokens = k`` and one draft slot per request, as in
tests/test_host_spec_decode.py), ``k`` = 1-3 speculative tokens and a seed. After every
synchronous step the requests of the batch get random drafts through
``Scheduler.update_draft_token_ids``, as from a model runner (``ngram`` 0 to ``k`` of
them, ``draft_model`` exactly ``k``); under async scheduling (``draft_model`` only: vLLM's
V1 runner refuses it with CPU n-gram) the engine does not call that and the scheduler
schedules its own placeholders instead. Runner outputs accept a random prefix of each
request's scheduled drafts (never vLLM's ``-1`` padding of a request scheduled from the
waiting queue), so positions are rolled back, and vLLM trims at ``max_tokens``.

After every ``schedule()`` and every ``update_from_output()`` the tests check, against the
real scheduler and KV-cache manager (no mocks):

* the requests preempted in the step are exactly the victims the controller returned;
* nothing preempted in a step is scheduled in it, every scheduled request is running and
  holds KV slots for all its computed tokens (scheduled drafts included) plus the drafter
  lookahead that ``allocate_slots`` reserves, the step's token total is the sum of its
  scheduled tokens and stays, with one draft slot per scheduled request, within the input
  budget, and at most ``max_num_seqs`` requests run;
* a running request is left unscheduled only when the input budget is spent or, under
  FCFS, a requester preempted itself (vLLM then stops the running loop);
* inside ``schedule`` (its locals, read at every policy call and when it hands its output
  to ``_update_after_schedule``): the token and input budgets equal the batch limit minus
  what is still scheduled (one draft slot per request), and the scheduled requests, their
  new blocks and their scheduled drafts name the same requests, so every rollback gave
  back everything its victim had taken;
* ``running`` and the waiting queues hold no duplicates and are disjoint, their union is
  exactly the added, unfinished requests (none lost, none invented), and
  ``scheduler.requests`` is that same set;
* every non-null block's ``ref_cnt`` equals the number of live requests holding it, only
  running requests hold blocks, and the pool's free count equals the unreferenced blocks;
* each context lists ``running`` in order with the requester and the built-in victim among
  the candidates, and host facts (when asked for) match the blocks each candidate holds;
* with speculative decoding: a victim has no entry in the step's
  ``scheduled_spec_decode_tokens`` and no drafts left, every entry belongs to a scheduled
  request that runs one position plus exactly those drafts (a prefix of what it was given,
  or vLLM's placeholders), and after the outputs every decoding request of the batch has
  its rejected positions rolled back;

and at the end: every request finished exactly once, with exactly ``max_tokens`` output
tokens (emitted and held), the pool has all usable blocks free with no ``ref_cnt`` above 0
outside the null block, the controller recorded no invalid selection and no failure, and
the run ended within a step bound proportional to the workload's tokens.

The properties must not be vacuous: every run is checked, but only runs that preempted
count as examples (``assume``), they must be most of the runs, and across them the
policy's picks must include the requester, victims already visited in the step and
victims other than vLLM's own, with every scheduler setting and host facts represented;
with speculative decoding also both methods, every ``k``, drafts scheduled, accepted and
rejected, and victims picked while their drafts were scheduled in the same step.
Examples are derandomized (no example database), so CI runs the same ones every time.
"""

from __future__ import annotations

import inspect
import random
from collections import Counter
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from bidkv_ext.contract import PreemptionContext, PreemptionContextFacts
from tests.property_settings import REAL_SCHEDULER
from tests.test_host_spec_decode import (
    propose,
    runner_output_with_drafts,
    spec_scheduler,
)

BLOCK = 4  # tokens per KV block: small, so decodes cross block boundaries often
MAX_MODEL_LEN = 160
MAX_PREFIX = 24
MAX_TAIL = 24
MAX_OUTPUT = 64  # MAX_PREFIX + MAX_TAIL + MAX_OUTPUT + 2 * MAX_SPEC < MAX_MODEL_LEN
MAX_ARRIVAL_STEP = 4
STEPS_PER_TOKEN = 4  # step bound per prompt or output token (runs here use under 1)
SCRIPT_CODES = 16  # policy codes 0..15
MAX_SCRIPT = 64
PRESSURE = 4  # pool: at most the largest request or 1/PRESSURE of the total KV demand
MAX_SPEC = 3  # speculative tokens per step
PADDING = -1  # vLLM's draft placeholder (padding, or async drafts filled in by the worker)


@dataclass(frozen=True)
class Spec:
    """One request of a workload."""

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    arrival_step: int
    priority: int


@dataclass(frozen=True)
class Workload:
    """Requests plus the scheduler settings they run under."""

    requests: tuple[Spec, ...]
    num_gpu_blocks: int  # includes vLLM's null block
    prefix_caching: bool
    chunked_prefill: bool
    policy: str  # "fcfs" or "priority"
    async_scheduling: bool
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass(frozen=True)
class SpecDecoding:
    """Speculative decoding of a run: vLLM's settings plus the seed of its drafts and of
    the runner's acceptances."""

    method: str  # "ngram" or "draft_model"
    num_speculative_tokens: int
    seed: int

    @property
    def extra_slots(self) -> int:
        """KV slots a decode may take past its output: ``k`` drafts (vLLM schedules them
        even for the last token), plus ``k`` drafter lookahead slots with a draft model."""
        k = self.num_speculative_tokens
        return 2 * k if self.method == "draft_model" else k


def _step_bound(workload: Workload) -> int:
    """Steps a run may take: generous (runs here need under one step per token), so
    reaching it means the scheduler stopped making progress."""
    tokens = sum(len(s.prompt) + s.max_tokens for s in workload.requests)
    return STEPS_PER_TOKEN * (MAX_ARRIVAL_STEP + tokens)


def _blocks_for(spec: Spec, extra_slots: int) -> int:
    # Prompt plus every output token, plus one slot of slack for async scheduling's
    # in-flight token and ``extra_slots`` for speculative decoding; ceiling division.
    return -(-(len(spec.prompt) + spec.max_tokens + 1 + extra_slots) // BLOCK)


@st.composite
def workloads(
    draw: st.DrawFn, *, extra_slots: int = 0, async_scheduling: bool | None = None
) -> Workload:
    """A small workload whose KV demand exceeds the pool, while each request fits alone
    (with ``extra_slots`` more slots at its end); async scheduling is drawn unless given."""
    prefixes = [
        tuple(50_000 + 100 * k + j for j in range(length))
        for k, length in enumerate(draw(st.lists(st.integers(1, MAX_PREFIX), max_size=2)))
    ]
    num_requests = draw(st.integers(3, 12))
    specs: list[Spec] = []
    for i in range(num_requests):
        copy_of = draw(st.sampled_from([None, *range(i)])) if i and draw(st.booleans()) else None
        if copy_of is not None:
            # The same prompt as an earlier request: a full prefix hit when cached.
            prompt = specs[copy_of].prompt
        else:
            prefix = draw(st.sampled_from([(), *prefixes]))
            tail_len = draw(st.integers(0 if prefix else 1, MAX_TAIL))
            prompt = prefix + tuple(1_000 * (i + 1) + j for j in range(tail_len))
        specs.append(
            Spec(
                request_id=f"r{i}",
                prompt=prompt,
                max_tokens=draw(st.integers(1, MAX_OUTPUT)),
                arrival_step=draw(st.integers(0, MAX_ARRIVAL_STEP)),
                priority=draw(st.integers(0, 3)),
            )
        )
    needs = [_blocks_for(s, extra_slots) for s in specs]
    # At least the largest request alone (else no scheduler can finish it), at most about
    # a quarter of the total demand, so that concurrent requests must be preempted.
    usable = draw(st.integers(max(needs), max(max(needs), sum(needs) // PRESSURE)))
    chunked = draw(st.booleans())
    max_num_seqs = draw(st.integers(2, 8))
    if chunked:
        budget = draw(st.integers(max(BLOCK, max_num_seqs), MAX_MODEL_LEN))
    else:
        budget = MAX_MODEL_LEN  # vLLM requires >= max_model_len without chunked prefill
    return Workload(
        requests=tuple(specs),
        num_gpu_blocks=usable + 1,
        prefix_caching=draw(st.booleans()),
        chunked_prefill=chunked,
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        async_scheduling=draw(st.booleans()) if async_scheduling is None else async_scheduling,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
    )


@st.composite
def spec_workloads(draw: st.DrawFn) -> tuple[SpecDecoding, Workload]:
    """Speculative decoding settings and a workload whose pool fits each request alone
    with its drafts and lookahead."""
    # vLLM's V1 model runner supports async scheduling with a draft model, not CPU n-gram.
    method, async_scheduling = draw(
        st.sampled_from([("ngram", False), ("draft_model", False), ("draft_model", True)])
    )
    decoding = SpecDecoding(
        method=method,
        num_speculative_tokens=draw(st.sampled_from(range(1, MAX_SPEC + 1))),
        seed=draw(st.integers(0, 2**32 - 1)),
    )
    workload = draw(workloads(extra_slots=decoding.extra_slots, async_scheduling=async_scheduling))
    return decoding, workload


@st.composite
def scripts(draw: st.DrawFn) -> list[int]:
    """The policy's answers: a length first, so runs see long scripts, shrinking to none."""
    length = draw(st.integers(0, MAX_SCRIPT))
    return [draw(st.integers(0, SCRIPT_CODES - 1)) for _ in range(length)]


def _schedule_locals() -> dict[str, Any] | None:
    """The locals of the ``Scheduler.schedule`` call that is asking the policy (a
    snapshot, read only), or ``None`` when no such frame is on the stack."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "schedule" and "input_budget" in frame.f_locals:
            return frame.f_locals
        frame = frame.f_back
    return None


def _ledger_error(scheduler: Any, ledger: dict[str, Any], *, final: bool = False) -> str | None:
    """Why ``schedule``'s budgets and per-request maps disagree, or ``None``.

    Every scheduled request has taken its tokens from both budgets, one draft slot from
    the input budget, a ``req_to_new_blocks`` entry and possibly drafts; each rollback must
    give all of it back, so at the next decision and at the end of ``schedule`` (``final``)
    the books balance exactly. Before the end only the running loop (the only place that
    preempts) has scheduled requests.
    """
    tokens: dict[str, int] = ledger["num_scheduled_tokens"]
    draft_slots: int = ledger["draft_slots"]
    total = sum(tokens.values())
    expected_token_budget = scheduler.max_num_scheduled_tokens - total
    batched = scheduler.scheduler_config.max_num_batched_tokens
    expected_input_budget = batched - total - draft_slots * len(tokens)
    running = [r.request_id for r in ledger["scheduled_running_reqs"]]
    drafts = set(ledger["scheduled_spec_decode_tokens"])
    if ledger["token_budget"] != expected_token_budget:
        return f"token_budget {ledger['token_budget']} != {expected_token_budget}"
    if ledger["input_budget"] != expected_input_budget:
        return f"input_budget {ledger['input_budget']} != {expected_input_budget}"
    in_order = set(running) <= set(tokens) if final else running == list(tokens)
    if not in_order or set(ledger["req_to_new_blocks"]) != set(tokens):
        return f"scheduled {running}, tokens {list(tokens)}"
    if not drafts <= set(tokens):
        return f"drafts scheduled for {sorted(drafts - set(tokens))}, not in the batch"
    return None


def _watch_final_ledger(scheduler: Any, errors: list[str]) -> None:
    """Check ``schedule``'s books when it hands its output to ``_update_after_schedule``
    (its last step, after every rollback), appending what disagrees to ``errors``."""
    update_after_schedule = scheduler._update_after_schedule

    def checked(scheduler_output: Any) -> None:
        ledger = _schedule_locals()
        if ledger is None:
            errors.append("no Scheduler.schedule frame")
        elif (error := _ledger_error(scheduler, ledger, final=True)) is not None:
            errors.append(error)
        update_after_schedule(scheduler_output)

    scheduler._update_after_schedule = checked  # an instance attribute: the class is intact


@dataclass
class ScriptedPolicy:
    """A ``vllm.preemption-policy.v1`` policy that follows a drawn script of choices.

    Code 0 abstains, 1 names the requester, ``k >= 2`` names candidate ``(k - 2) % len``;
    past the script's end it abstains. It never raises (an exception would make the
    controller disable it): what it observes is recorded and asserted by the test.
    """

    script: list[int]
    scheduler: Any = None
    calls: int = 0
    victims: list[str] = field(default_factory=list)  # what the controller should return
    requesters: list[str] = field(default_factory=list)  # one per call, as victims
    bad_contexts: list[str] = field(default_factory=list)
    picked_requester: int = 0
    picked_visited: int = 0  # a candidate before the requester: already visited this step
    picked_other_than_builtin: int = 0
    picked_with_drafts: int = 0  # a victim whose drafts were already scheduled in the step

    def select_victim(self, context: PreemptionContext) -> str | None:
        self.calls += 1
        ids = [c.request_id for c in context.candidates]
        requester = context.requesting_request_id
        running = [r.request_id for r in self.scheduler.running]
        if ids != running or requester not in ids or context.builtin_victim_id not in ids:
            self.bad_contexts.append(f"call {self.calls}: {ids} vs running {running}")
        for candidate in context.candidates:
            request = self.scheduler.requests.get(candidate.request_id)
            live = None if request is None else (
                request.priority,
                request.arrival_time,
                request.num_prompt_tokens,
                request.num_output_tokens,
                request.num_computed_tokens,
                request.num_preemptions,
                request.max_tokens,
            )
            if live != (
                candidate.priority,
                candidate.arrival_time,
                candidate.num_prompt_tokens,
                candidate.num_output_tokens,
                candidate.num_computed_tokens,
                candidate.num_preemptions,
                candidate.max_tokens,
            ):
                self.bad_contexts.append(f"call {self.calls}: {candidate} vs request {live}")
        ledger = _schedule_locals()
        error = (
            "no Scheduler.schedule frame"
            if ledger is None
            else _ledger_error(self.scheduler, ledger)
        )
        if error is not None:
            self.bad_contexts.append(f"call {self.calls}: {error}")
        code = self.script[self.calls - 1] if self.calls <= len(self.script) else 0
        choice: str | None
        if code == 0:
            choice = None
        elif code == 1:
            choice = requester
        else:
            choice = ids[(code - 2) % len(ids)]
        victim = context.builtin_victim_id if choice is None else choice
        self.victims.append(str(victim))
        self.requesters.append(requester)
        with_drafts = ledger is not None and victim in ledger["scheduled_spec_decode_tokens"]
        if choice is not None and requester in ids:
            self.picked_requester += choice == requester
            self.picked_visited += ids.index(choice) < ids.index(requester)
            self.picked_other_than_builtin += choice != context.builtin_victim_id
            self.picked_with_drafts += with_drafts
        return choice


@dataclass
class ScriptedFactsPolicy(ScriptedPolicy):
    """The same script, asked through the optional host-facts call.

    The adapter then computes :class:`PreemptionContextFacts` on the live block pool at
    each decision; they are checked against that pool here.
    """

    facts_calls: int = 0

    def select_victim_with_facts(
        self, context: PreemptionContext, facts: PreemptionContextFacts | None
    ) -> str | None:
        if facts is None:
            self.bad_contexts.append(f"call {self.calls + 1}: no host facts")
        else:
            self.facts_calls += 1
            ids = {c.request_id for c in context.candidates}
            held = {rid: len(_held_blocks(self.scheduler, rid)) for rid in ids}
            if (
                set(facts.facts) != ids
                or facts.block_size != BLOCK
                or facts.needed_blocks < 0
                or any(
                    not 0 <= f.cached_blocks <= f.exclusive_blocks <= f.total_blocks == held[rid]
                    for rid, f in facts.facts.items()
                    if rid in held
                )
            ):
                self.bad_contexts.append(f"call {self.calls + 1}: facts {facts} vs held {held}")
        return self.select_victim(context)


@dataclass
class Outcome:
    """What one example exercised (for the non-vacuity checks over all examples)."""

    preemptions: int = 0
    calls: int = 0
    picked_requester: int = 0
    picked_visited: int = 0
    picked_other_than_builtin: int = 0
    prefix_hits: int = 0
    facts_calls: int = 0
    steps: int = 0
    drafts_scheduled: int = 0
    drafts_accepted: int = 0
    drafts_rejected: int = 0
    picked_with_drafts: int = 0


def _waiting(scheduler: Any) -> list[Any]:
    return [*scheduler.waiting, *scheduler.kv_holding_waiting]


def _held_blocks(scheduler: Any, request_id: str) -> list[Any]:
    groups = scheduler.kv_cache_manager.get_blocks(request_id).blocks
    return [b for group in groups for b in group if not b.is_null]


def _draft_slots(scheduler: Any) -> int:
    speculative_config = scheduler.vllm_config.speculative_config
    return 0 if speculative_config is None else speculative_config.max_num_new_slots_for_drafting


def _check_state(scheduler: Any, live: set[str], where: str) -> None:
    """Queues, request table and block pool agree with each other and with ``live``."""
    running = [r.request_id for r in scheduler.running]
    waiting = [r.request_id for r in _waiting(scheduler)]
    assert len(set(running)) == len(running), f"{where}: duplicate in running {running}"
    assert len(set(waiting)) == len(waiting), f"{where}: duplicate in waiting {waiting}"
    both = set(running) & set(waiting)
    assert not both, f"{where}: {sorted(both)} both running and waiting"
    assert set(running) | set(waiting) == live, (
        f"{where}: queues hold {sorted(set(running) | set(waiting))}, live {sorted(live)}"
    )
    assert set(scheduler.requests) == live, f"{where}: request table {sorted(scheduler.requests)}"
    assert len(running) <= scheduler.max_num_running_reqs, f"{where}: too many running"
    for request in scheduler.running:
        assert request.status.name == "RUNNING", f"{where}: {request.request_id} {request.status}"

    pool = scheduler.kv_cache_manager.block_pool
    references: Counter[int] = Counter()
    for request_id in live:
        held = _held_blocks(scheduler, request_id)
        if held:
            assert request_id in running, f"{where}: {request_id} holds blocks but is not running"
        references.update(b.block_id for b in held)
    for block in pool.blocks:
        if block.is_null:
            continue
        assert block.ref_cnt == references[block.block_id], (
            f"{where}: block {block.block_id} ref_cnt {block.ref_cnt}, "
            f"held by {references[block.block_id]} live request(s)"
        )
    unreferenced = sum(1 for b in pool.blocks if not b.is_null and b.ref_cnt == 0)
    assert pool.get_num_free_blocks() == unreferenced, (
        f"{where}: free count {pool.get_num_free_blocks()} != {unreferenced} unreferenced"
    )


def _check_step(
    scheduler: Any,
    out: Any,
    workload: Workload,
    expected_victims: set[str],
    where: str,
    *,
    self_preempted: bool,
) -> None:
    """One ``SchedulerOutput`` is self-consistent and preempted exactly the chosen victims.

    ``self_preempted``: a requester was its own victim in this step.
    """
    preempted = set(out.preempted_req_ids or ())
    assert preempted == expected_victims, (
        f"{where}: preempted {sorted(preempted)}, policy/controller chose "
        f"{sorted(expected_victims)}"
    )
    scheduled = out.num_scheduled_tokens
    assert not preempted & set(scheduled), f"{where}: preempted yet scheduled"
    drafts = out.scheduled_spec_decode_tokens
    assert not preempted & set(drafts), f"{where}: drafts of victims {preempted & set(drafts)}"
    assert set(drafts) <= set(scheduled), f"{where}: drafts of {set(drafts) - set(scheduled)}"
    assert out.total_num_scheduled_tokens == sum(scheduled.values())
    draft_slots = _draft_slots(scheduler)
    # What the step charged to the input budget: its tokens plus a draft slot each.
    charged = out.total_num_scheduled_tokens + draft_slots * len(scheduled)
    assert charged <= workload.max_num_batched_tokens, f"{where}: {charged} tokens charged"
    assert len(scheduled) <= workload.max_num_seqs
    running = {r.request_id: r for r in scheduler.running}
    for request_id in preempted:
        assert request_id not in running, f"{where}: victim {request_id} still running"
        assert not _held_blocks(scheduler, request_id), f"{where}: victim {request_id} holds KV"
        assert not scheduler.requests[request_id].spec_token_ids, f"{where}: victim's drafts"
    lookahead = scheduler.num_lookahead_tokens
    for request_id, tokens in scheduled.items():
        assert tokens > 0, f"{where}: {request_id} scheduled for {tokens} tokens"
        request = running.get(request_id)
        assert request is not None, f"{where}: scheduled {request_id} is not running"
        # schedule() has already advanced num_computed_tokens past this step's tokens
        # (drafts included); allocate_slots reserves the drafter's lookahead past them.
        needed = min(request.num_computed_tokens + lookahead, MAX_MODEL_LEN)
        slots = len(_held_blocks(scheduler, request_id)) * BLOCK
        assert slots >= needed, (
            f"{where}: {request_id} has {slots} KV slots for {request.num_computed_tokens} "
            f"computed tokens and {lookahead} lookahead"
        )
    # vLLM's running loop leaves a running request unscheduled only when the input budget
    # is spent, or under FCFS after a requester preempted itself (the loop then breaks).
    idle = sorted(set(running) - set(scheduled))
    if idle and not (workload.policy == "fcfs" and self_preempted):
        left = workload.max_num_batched_tokens - charged
        assert left <= draft_slots, f"{where}: {idle} unscheduled with {left} input budget left"


def _check_drafts(
    scheduler: Any,
    out: Any,
    decoding: SpecDecoding,
    drafts_before: dict[str, list[int]],
    where: str,
) -> None:
    """Each scheduled draft list belongs to a request that runs one position plus exactly
    those drafts: a prefix of the drafts it held (or the async scheduler's placeholders),
    or, for a request scheduled from the waiting queue, vLLM's padding."""
    k = decoding.num_speculative_tokens
    for request_id, drafts in out.scheduled_spec_decode_tokens.items():
        assert 0 < len(drafts) <= k, f"{where}: {request_id} drafts {drafts}"
        assert out.num_scheduled_tokens[request_id] == 1 + len(drafts), (
            f"{where}: {request_id} runs {out.num_scheduled_tokens[request_id]} tokens "
            f"with drafts {drafts}"
        )
        held = drafts_before.get(request_id)
        expected = [PADDING] * k if held is None else held[: len(drafts)]
        assert list(drafts) == expected, f"{where}: {request_id} drafts {drafts}, had {held}"


def _runner_output_with_drafts(
    offline: ModuleType, out: Any, scheduler: Any, rng: random.Random, *, is_async: bool
) -> tuple[Any, int, int]:
    """A ``ModelRunnerOutput`` that accepts a random number of each request's drafts;
    returns it with the numbers of accepted and rejected drafts.

    Synchronously, ``-1`` drafts are vLLM's padding and never match a sampled token; under
    async scheduling every draft is a ``-1`` placeholder for one the worker proposed.
    """
    totals = [0, 0]  # accepted, rejected

    def accept(_req_id: str, _request: Any, drafts: list[int]) -> int:
        acceptable = len(drafts)
        if not is_async and PADDING in drafts:
            acceptable = drafts.index(PADDING)
        accepted = rng.randint(0, acceptable)
        totals[0] += accepted
        totals[1] += len(drafts) - accepted
        return accepted

    output = runner_output_with_drafts(offline, out, scheduler, accept)
    return output, totals[0], totals[1]


def _propose_random(
    scheduler: Any, out: Any, decoding: SpecDecoding, rng: random.Random
) -> None:
    """Random drafts for the requests of the batch, as a model runner's drafter hands them
    over after the step (vLLM drops those of finished requests and prefill chunks)."""
    k = decoding.num_speculative_tokens
    drafts: dict[str, list[int]] = {}
    for req_id in out.num_scheduled_tokens:
        count = k if decoding.method == "draft_model" else rng.randint(0, k)  # n-gram: a match
        drafts[req_id] = [rng.randrange(10, 30_000) for _ in range(count)]
    propose(scheduler, drafts)


def run_workload(
    offline: ModuleType,
    workload: Workload,
    script: list[int],
    *,
    host_facts: bool = False,
    decoding: SpecDecoding | None = None,
) -> Outcome:
    """Drive the real scheduler through ``workload`` with a :class:`ScriptedPolicy`
    (:class:`ScriptedFactsPolicy` when ``host_facts``), with speculative decoding when
    ``decoding`` is given."""
    from bidkv_ext.hosts.vllm import PolicyAsyncScheduler, PolicyScheduler

    config = {
        "block_size": BLOCK,
        "max_num_seqs": workload.max_num_seqs,
        "max_num_batched_tokens": workload.max_num_batched_tokens,
        "max_model_len": MAX_MODEL_LEN,
        "enable_prefix_caching": workload.prefix_caching,
        "policy": workload.policy,
        "enable_chunked_prefill": workload.chunked_prefill,
        "async_scheduling": workload.async_scheduling,
    }
    policy = (ScriptedFactsPolicy if host_facts else ScriptedPolicy)(list(script))
    cls = PolicyAsyncScheduler if workload.async_scheduling else PolicyScheduler
    scheduler: Any
    if decoding is None:
        # build_vllm_config keeps async_scheduling on CPU, so the variant is picked from it.
        vllm_config, kv_cache_config = offline.build_vllm_config(
            num_gpu_blocks=workload.num_gpu_blocks, **config
        )
        scheduler = offline.build_scheduler(vllm_config, kv_cache_config, preemption_policy=policy)
    else:
        scheduler = spec_scheduler(
            offline,
            method=decoding.method,
            num_speculative_tokens=decoding.num_speculative_tokens,
            num_gpu_blocks=workload.num_gpu_blocks,
            scheduler_cls=cls,
            preemption_policy=policy,
            **config,
        )
        k = decoding.num_speculative_tokens
        with_drafter = decoding.method == "draft_model"
        assert scheduler.num_spec_tokens == k
        assert scheduler.num_lookahead_tokens == (k if with_drafter else 0)
        assert _draft_slots(scheduler) == (1 if with_drafter else 0)
    assert type(scheduler) is cls
    policy.scheduler = scheduler
    assert scheduler.controller.policy is policy
    assert scheduler.controller.wants_facts is host_facts
    ledger_errors: list[str] = []
    _watch_final_ledger(scheduler, ledger_errors)
    rng = random.Random(decoding.seed if decoding is not None else 0)

    specs = {s.request_id: s for s in workload.requests}
    pending = sorted(workload.requests, key=lambda s: (s.arrival_step, s.request_id))
    live: set[str] = set()
    emitted: Counter[str] = Counter()
    finishes: Counter[str] = Counter()
    requests: dict[str, Any] = {}
    outcome = Outcome()
    step, max_steps = 0, _step_bound(workload)
    while pending or scheduler.has_unfinished_requests():
        assert step < max_steps, f"no completion within {max_steps} steps; live {sorted(live)}"
        while pending and pending[0].arrival_step <= step:
            spec = pending.pop(0)
            request = offline.make_request(
                spec.request_id,
                list(spec.prompt),
                spec.max_tokens,
                arrival_time=spec.arrival_step + 0.001 * int(spec.request_id[1:]),
                priority=spec.priority,
                block_size=BLOCK,
            )
            requests[spec.request_id] = request
            scheduler.add_request(request)
            live.add(spec.request_id)
        where = f"step {step}"
        calls_before = policy.calls
        drafts_before = {r.request_id: list(r.spec_token_ids) for r in scheduler.running}
        out = scheduler.schedule()
        assert not ledger_errors, f"{where}: at the end of schedule, {ledger_errors[0]}"
        decisions = zip(
            policy.requesters[calls_before:], policy.victims[calls_before:], strict=True
        )
        _check_step(
            scheduler,
            out,
            workload,
            set(policy.victims[calls_before:]),
            where,
            self_preempted=any(requester == victim for requester, victim in decisions),
        )
        _check_state(scheduler, live, f"{where} after schedule")
        outcome.preemptions += len(out.preempted_req_ids or ())
        outcome.prefix_hits += sum(1 for r in out.scheduled_new_reqs if r.num_computed_tokens)

        if decoding is None:
            runner_output = offline.runner_output_for(out, scheduler)
        else:
            _check_drafts(scheduler, out, decoding, drafts_before, where)
            outcome.drafts_scheduled += sum(map(len, out.scheduled_spec_decode_tokens.values()))
            runner_output, accepted, rejected = _runner_output_with_drafts(
                offline, out, scheduler, rng, is_async=workload.async_scheduling
            )
            outcome.drafts_accepted += accepted
            outcome.drafts_rejected += rejected
        engine_outputs = scheduler.update_from_output(out, runner_output)
        for outputs in engine_outputs.values():
            for output in outputs.outputs:
                request_id = output.request_id
                assert request_id in specs, f"{where}: output for unknown {request_id}"
                assert not finishes[request_id], f"{where}: output after {request_id} finished"
                emitted[request_id] += len(output.new_token_ids)
                if output.finish_reason is not None:
                    finishes[request_id] += 1
                    live.discard(request_id)
        _check_state(scheduler, live, f"{where} after update")
        if decoding is not None:
            for request_id, index in runner_output.req_id_to_index.items():
                request = scheduler.requests.get(request_id)
                if request is None or not runner_output.sampled_token_ids[index]:
                    continue  # finished, or a prefill chunk that sampled nothing
                # Rejected drafts rolled back: one position left to compute (the last
                # sampled token), no placeholder left over under async scheduling.
                assert request.num_computed_tokens == request.num_tokens - 1, (
                    f"{where}: {request_id} computed {request.num_computed_tokens} of "
                    f"{request.num_tokens} tokens after its outputs"
                )
                assert request.num_output_placeholders == 0
            if not workload.async_scheduling:
                _propose_random(scheduler, out, decoding, rng)
        step += 1

    assert not policy.bad_contexts, policy.bad_contexts[:3]
    for request_id, spec in specs.items():
        assert finishes[request_id] == 1, f"{request_id} finished {finishes[request_id]} times"
        assert emitted[request_id] == spec.max_tokens, (
            f"{request_id}: {emitted[request_id]} tokens emitted, max_tokens {spec.max_tokens}"
        )
        request = requests[request_id]
        assert request.num_output_tokens == spec.max_tokens
        assert request.status.name == "FINISHED_LENGTH_CAPPED", f"{request_id}: {request.status}"
    assert not scheduler.running and not _waiting(scheduler) and not scheduler.requests
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == workload.num_gpu_blocks - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks if not b.is_null)

    stats: dict[str, Any] = scheduler.controller.export_stats()
    assert stats["enabled"] is True
    assert stats["failures"] == 0 and stats["invalid_selections"] == 0, stats
    assert stats["calls"] == policy.calls == stats["selections"] + stats["abstentions"], stats
    assert outcome.preemptions == policy.calls  # every preemption went through the policy

    outcome.calls = policy.calls
    outcome.picked_requester = policy.picked_requester
    outcome.picked_visited = policy.picked_visited
    outcome.picked_other_than_builtin = policy.picked_other_than_builtin
    outcome.picked_with_drafts = policy.picked_with_drafts
    outcome.facts_calls = getattr(policy, "facts_calls", 0)
    assert outcome.facts_calls == (policy.calls if host_facts else 0)
    outcome.steps = step
    return outcome


def _rare_cases(covered: dict[str, int], total: int) -> dict[str, int]:
    """The cases seen in under an eighth of the ``total`` counted examples."""
    return {case: n for case, n in covered.items() if n < total // 8}


def _settings_covered(pressured: list[tuple[Workload, Outcome]]) -> dict[str, int]:
    """Per policy-pick kind and scheduler setting, the counted examples that had it."""
    outcomes = [o for _, o in pressured]
    return {
        "requester": sum(1 for o in outcomes if o.picked_requester),
        "already visited": sum(1 for o in outcomes if o.picked_visited),
        "not the built-in victim": sum(1 for o in outcomes if o.picked_other_than_builtin),
        "host facts": sum(1 for o in outcomes if o.facts_calls),
        "prefix hits": sum(1 for o in outcomes if o.prefix_hits),
        "priority": sum(1 for w, _ in pressured if w.policy == "priority"),
        "fcfs": sum(1 for w, _ in pressured if w.policy == "fcfs"),
        "prefix caching": sum(1 for w, _ in pressured if w.prefix_caching),
        "no prefix caching": sum(1 for w, _ in pressured if not w.prefix_caching),
        "chunked prefill": sum(1 for w, _ in pressured if w.chunked_prefill),
        "no chunked prefill": sum(1 for w, _ in pressured if not w.chunked_prefill),
        "async": sum(1 for w, _ in pressured if w.async_scheduling),
        "sync": sum(1 for w, _ in pressured if not w.async_scheduling),
    }


def test_any_valid_victim_keeps_the_real_scheduler_consistent(vllm_offline: ModuleType) -> None:
    runs: list[Outcome] = []  # every run (all are checked)
    pressured: list[tuple[Workload, Outcome]] = []  # the runs that preempted

    @settings(REAL_SCHEDULER, max_examples=50)
    @given(workload=workloads(), script=scripts(), host_facts=st.booleans())
    def any_victim(workload: Workload, script: list[int], host_facts: bool) -> None:
        outcome = run_workload(vllm_offline, workload, script, host_facts=host_facts)
        runs.append(outcome)
        # Every run is checked above; only runs that preempted count as examples, so the
        # max_examples budget is spent where the policy decides.
        assume(outcome.preemptions > 0)
        pressured.append((workload, outcome))

    any_victim()

    # Not vacuous: most runs preempt, and over the counted examples the policy's picks
    # and the scheduler settings cover every case this file is about.
    total = len(pressured)
    assert total >= 40, f"only {total} of {len(runs)} runs preempted"
    assert total >= len(runs) / 2, f"only {total} of {len(runs)} runs preempted"
    outcomes = [o for _, o in pressured]
    assert all(o.calls == o.preemptions > 0 for o in outcomes)
    assert sum(o.calls for o in outcomes) >= 2 * total
    rare = _rare_cases(_settings_covered(pressured), total)
    assert not rare, f"cases seen in under an eighth of {total} examples: {rare}"


def test_any_valid_victim_with_speculative_decoding(vllm_offline: ModuleType) -> None:
    """The same property with draft tokens: a victim scheduled earlier in the step must
    lose its scheduled drafts and give back its draft slot, and every request still ends
    with exactly ``max_tokens`` tokens whatever the runner accepts."""
    runs: list[Outcome] = []
    pressured: list[tuple[SpecDecoding, Workload, Outcome]] = []

    @settings(REAL_SCHEDULER, max_examples=80)
    @given(case=spec_workloads(), script=scripts(), host_facts=st.booleans())
    def any_victim_with_drafts(
        case: tuple[SpecDecoding, Workload], script: list[int], host_facts: bool
    ) -> None:
        decoding, workload = case
        outcome = run_workload(
            vllm_offline, workload, script, host_facts=host_facts, decoding=decoding
        )
        runs.append(outcome)
        assume(outcome.preemptions > 0)
        pressured.append((decoding, workload, outcome))

    any_victim_with_drafts()

    total = len(pressured)
    assert total >= 30, f"only {total} of {len(runs)} runs preempted"
    assert total >= len(runs) / 2, f"only {total} of {len(runs)} runs preempted"
    outcomes = [o for _, _, o in pressured]
    assert all(o.calls == o.preemptions > 0 for o in outcomes)
    covered = _settings_covered([(w, o) for _, w, o in pressured])
    covered |= {
        "ngram": sum(1 for d, _, _ in pressured if d.method == "ngram"),
        "draft_model": sum(1 for d, _, _ in pressured if d.method == "draft_model"),
        **{
            f"k={k}": sum(1 for d, _, _ in pressured if d.num_speculative_tokens == k)
            for k in range(1, MAX_SPEC + 1)
        },
        "drafts accepted": sum(1 for o in outcomes if o.drafts_accepted),
        "victim picked with drafts scheduled": sum(1 for o in outcomes if o.picked_with_drafts),
    }
    rare = _rare_cases(covered, total)
    assert not rare, f"cases seen in under an eighth of {total} examples: {rare}"
    # Drafts are the point here: scheduled and rejected in (nearly) every example.
    assert sum(1 for o in outcomes if o.drafts_scheduled and o.drafts_rejected) >= 0.9 * total
    picked = sum(1 for o in outcomes if o.picked_with_drafts)
    assert picked >= total // 4, f"a victim with drafts was picked in {picked} of {total}"
