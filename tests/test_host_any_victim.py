"""Any valid victim keeps the real vLLM scheduler consistent (property test).

Behaviour guarded: whatever valid victim a preemption policy picks -- any candidate, the
requesting request itself, or ``None`` (abstain, so vLLM's own victim is taken) -- stock
vLLM 0.33.0's real v1 scheduler, driven through our adapter
(:mod:`bidkv_ext.hosts.vllm`), stays consistent, and every request completes exactly once
with exactly its output length.

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
computes block facts on every state the scripts reach.

After every ``schedule()`` and every ``update_from_output()`` the test checks, against the
real scheduler and KV-cache manager (no mocks):

* the requests preempted in the step are exactly the victims the controller returned;
* nothing preempted in a step is scheduled in it, every scheduled request is running and
  holds KV blocks for all its computed tokens, and the step stays within the token budget
  and ``max_num_seqs``;
* ``running`` and the waiting queues hold no duplicates and are disjoint, their union is
  exactly the added, unfinished requests (none lost, none invented), and
  ``scheduler.requests`` is that same set;
* every non-null block's ``ref_cnt`` equals the number of live requests holding it, only
  running requests hold blocks, and the pool's free count equals the unreferenced blocks;
* each context lists ``running`` in order with the requester and the built-in victim among
  the candidates, and host facts (when asked for) match the blocks each candidate holds;

and at the end: every request finished exactly once, with exactly ``max_tokens`` output
tokens (emitted and held), the pool has all usable blocks free with no ``ref_cnt`` above 0
outside the null block, the controller recorded no invalid selection and no failure, and
the run ended within a step bound proportional to the workload's tokens.

The property must not be vacuous: every run is checked, but only runs that preempted
count as examples (``assume``), they must be most of the runs, and across them the
policy's picks must include the requester, victims already visited in the step and
victims other than vLLM's own, with every scheduler setting and host facts represented.
Examples are derandomized (no example database), so CI runs the same ones every time.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from bidkv_ext.contract import PreemptionContext, PreemptionContextFacts

BLOCK = 4  # tokens per KV block: small, so decodes cross block boundaries often
MAX_MODEL_LEN = 160
MAX_PREFIX = 24
MAX_TAIL = 24
MAX_OUTPUT = 64  # MAX_PREFIX + MAX_TAIL + MAX_OUTPUT < MAX_MODEL_LEN
MAX_ARRIVAL_STEP = 4
STEPS_PER_TOKEN = 4  # step bound per prompt or output token (runs here use under 1)
SCRIPT_CODES = 16  # policy codes 0..15
MAX_SCRIPT = 64
PRESSURE = 4  # pool: at most the largest request or 1/PRESSURE of the total KV demand


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


def _step_bound(workload: Workload) -> int:
    """Steps a run may take: generous (runs here need under one step per token), so
    reaching it means the scheduler stopped making progress."""
    tokens = sum(len(s.prompt) + s.max_tokens for s in workload.requests)
    return STEPS_PER_TOKEN * (MAX_ARRIVAL_STEP + tokens)


def _blocks_for(spec: Spec) -> int:
    # Prompt plus every output token, plus one slot of slack for async scheduling's
    # in-flight token; ceiling division.
    return -(-(len(spec.prompt) + spec.max_tokens + 1) // BLOCK)


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    """A small workload whose KV demand exceeds the pool, while each request fits alone."""
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
    needs = [_blocks_for(s) for s in specs]
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
        async_scheduling=draw(st.booleans()),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
    )


@st.composite
def scripts(draw: st.DrawFn) -> list[int]:
    """The policy's answers: a length first, so runs see long scripts, shrinking to none."""
    length = draw(st.integers(0, MAX_SCRIPT))
    return [draw(st.integers(0, SCRIPT_CODES - 1)) for _ in range(length)]


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
    bad_contexts: list[str] = field(default_factory=list)
    picked_requester: int = 0
    picked_visited: int = 0  # a candidate before the requester: already visited this step
    picked_other_than_builtin: int = 0

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
        if choice is not None and requester in ids:
            self.picked_requester += choice == requester
            self.picked_visited += ids.index(choice) < ids.index(requester)
            self.picked_other_than_builtin += choice != context.builtin_victim_id
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


def _waiting(scheduler: Any) -> list[Any]:
    return [*scheduler.waiting, *scheduler.kv_holding_waiting]


def _held_blocks(scheduler: Any, request_id: str) -> list[Any]:
    groups = scheduler.kv_cache_manager.get_blocks(request_id).blocks
    return [b for group in groups for b in group if not b.is_null]


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
    scheduler: Any, out: Any, workload: Workload, expected_victims: set[str], where: str
) -> None:
    """One ``SchedulerOutput`` is self-consistent and preempted exactly the chosen victims."""
    preempted = set(out.preempted_req_ids or ())
    assert preempted == expected_victims, (
        f"{where}: preempted {sorted(preempted)}, policy/controller chose "
        f"{sorted(expected_victims)}"
    )
    scheduled = out.num_scheduled_tokens
    assert not preempted & set(scheduled), f"{where}: preempted yet scheduled"
    assert out.total_num_scheduled_tokens == sum(scheduled.values())
    assert out.total_num_scheduled_tokens <= workload.max_num_batched_tokens
    assert len(scheduled) <= workload.max_num_seqs
    running = {r.request_id: r for r in scheduler.running}
    for request_id in preempted:
        assert request_id not in running, f"{where}: victim {request_id} still running"
        assert not _held_blocks(scheduler, request_id), f"{where}: victim {request_id} holds KV"
    for request_id, tokens in scheduled.items():
        assert tokens > 0, f"{where}: {request_id} scheduled for {tokens} tokens"
        request = running.get(request_id)
        assert request is not None, f"{where}: scheduled {request_id} is not running"
        # schedule() has already advanced num_computed_tokens past this step's tokens.
        slots = len(_held_blocks(scheduler, request_id)) * BLOCK
        assert slots >= request.num_computed_tokens, (
            f"{where}: {request_id} has {slots} KV slots for "
            f"{request.num_computed_tokens} computed tokens"
        )


def run_workload(
    offline: ModuleType, workload: Workload, script: list[int], *, host_facts: bool = False
) -> Outcome:
    """Drive the real scheduler through ``workload`` with a :class:`ScriptedPolicy`
    (:class:`ScriptedFactsPolicy` when ``host_facts``)."""
    vllm_config, kv_cache_config = offline.build_vllm_config(
        num_gpu_blocks=workload.num_gpu_blocks,
        block_size=BLOCK,
        max_num_seqs=workload.max_num_seqs,
        max_num_batched_tokens=workload.max_num_batched_tokens,
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=workload.prefix_caching,
        policy=workload.policy,
        enable_chunked_prefill=workload.chunked_prefill,
        async_scheduling=workload.async_scheduling,
    )
    policy = (ScriptedFactsPolicy if host_facts else ScriptedPolicy)(list(script))
    scheduler = offline.build_scheduler(vllm_config, kv_cache_config, preemption_policy=policy)
    policy.scheduler = scheduler
    assert scheduler.controller.policy is policy
    assert scheduler.controller.wants_facts is host_facts

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
        out = scheduler.schedule()
        _check_step(scheduler, out, workload, set(policy.victims[calls_before:]), where)
        _check_state(scheduler, live, f"{where} after schedule")
        outcome.preemptions += len(out.preempted_req_ids or ())
        outcome.prefix_hits += sum(1 for r in out.scheduled_new_reqs if r.num_computed_tokens)

        engine_outputs = scheduler.update_from_output(
            out, offline.runner_output_for(out, scheduler)
        )
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

    stats = scheduler.controller.export_stats()
    assert stats["enabled"] is True
    assert stats["failures"] == 0 and stats["invalid_selections"] == 0, stats
    assert stats["calls"] == policy.calls == stats["selections"] + stats["abstentions"], stats
    assert outcome.preemptions == policy.calls  # every preemption went through the policy

    outcome.calls = policy.calls
    outcome.picked_requester = policy.picked_requester
    outcome.picked_visited = policy.picked_visited
    outcome.picked_other_than_builtin = policy.picked_other_than_builtin
    outcome.facts_calls = getattr(policy, "facts_calls", 0)
    assert outcome.facts_calls == (policy.calls if host_facts else 0)
    outcome.steps = step
    return outcome


def test_any_valid_victim_keeps_the_real_scheduler_consistent(vllm_offline: ModuleType) -> None:
    runs: list[Outcome] = []  # every run (all are checked)
    pressured: list[tuple[Workload, Outcome]] = []  # the runs that preempted

    @settings(
        max_examples=50,
        deadline=None,
        derandomize=True,  # the same examples on every run, so CI is deterministic
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
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
    covered = {
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
    rare = {case: n for case, n in covered.items() if n < total // 8}
    assert not rare, f"cases seen in under an eighth of {total} examples: {rare}"
