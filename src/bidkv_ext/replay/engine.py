"""The replay loop: a trace through the real vLLM 0.33.0 scheduler on a simulated clock.

Per step: admit the requests that have arrived, call ``schedule()``, read what it decided
(scheduled positions per request, preempted requests), charge the step-time model, emit
one fake token per request that completes a position, and call ``update_from_output``.
All accounting reads the scheduler's own decisions; nothing about scheduling is modelled.

Recompute tax (evaluation.md section 1): each request keeps a high-water mark of computed
positions. A step that schedules positions ``[start, end)`` for it, with ``end`` its
``num_computed_tokens`` after ``schedule()``, re-executes ``min(end, mark) - start``
positions when ``start < mark``. Prefix-cache hits move ``start`` forward without executing
anything, so they are neither computed nor recomputed. The upper bound adds each victim's
``num_computed_tokens`` at preemption time (ignores prefix hits).

Simulated time: the scheduler module's ``time`` is swapped for the replay clock while a
replay runs, so the host's ``now`` (``scheduled_timestamp``) and the requests' arrival times
share one clock and policies that read them stay deterministic.

Elastic capacity (``ReplaySettings.capacity_schedule``): an
:class:`~bidkv_ext.replay.capacity.ElasticPool` holds blocks of the real block pool back
before each step (kvcached semantics, see :mod:`bidkv_ext.replay.capacity`) and, with
``capacity_signals`` on, is registered as the ``kvcached_provider.signals`` source for the
arm (unregistered when the arm ends, also on errors). When the engine empties, before a
gap to the next arrival or at the end of the replay, a pending shrink takes the freed
blocks at that time (not after the gap; at the end, not never). When nothing can be
scheduled (two steps in a row that neither schedule nor preempt) the clock jumps to the
next arrival or the next capacity change, whichever comes first.

Observers: a policy that also implements :class:`ReplayObserver` follows the replay it
decides in: it sees the loop's state (:class:`ReplayState`) before the first step, the
clock after every step, and the end of the replay. Only benchmarks use this (the lookahead
oracle of ``benchmarks/replay/headroom.py`` forks the replay and must stop its forks at a
horizon); the vLLM-HUST contract has no such call, and no shipped policy implements it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from bidkv_ext.config import BidKVConfig
from bidkv_ext.contract import PreemptionPolicy
from bidkv_ext.replay.arms import Arm, arm_additional_config, error_line
from bidkv_ext.replay.steptime import StepTimeModel
from bidkv_ext.replay.tokens import PromptFactory
from bidkv_ext.replay.trace import TraceRequest
from bidkv_ext.selector import BidkvPreemptionPolicy

if TYPE_CHECKING:
    from bidkv_ext.replay.capacity import CapacitySchedule, ElasticPool

__all__ = [
    "ArmRun",
    "ReplayError",
    "ReplayObserver",
    "ReplaySettings",
    "ReplayState",
    "RequestOutcome",
    "run_arm",
]


class ReplayError(RuntimeError):
    """The replay cannot make progress (for example a request larger than the KV pool)."""


class Progress(Protocol):
    def update(self, n: int = 1) -> object: ...


class ReplayState(Protocol):
    """What an observer may read of the replay loop: lists indexed by trace position."""

    requests: Sequence[TraceRequest]
    # Output lengths that end requests (by EOS, under the default ``max_tokens="model-len"``);
    # an observer may rewrite an unfinished request's entry to end it elsewhere.
    lengths: list[int]
    tokens: list[int]  # output tokens produced so far
    first: list[float]  # simulated time of the first output token, NaN before it
    finish: list[float]  # simulated finish time, NaN while unfinished
    mark: list[int]  # high-water mark of computed positions
    position: list[int]  # computed positions now (0 after a preemption)
    recomputed: int  # positions re-executed so far, over all requests


@runtime_checkable
class ReplayObserver(Protocol):
    """Optional methods of a policy that follows the replay it decides in (see module doc)."""

    def replay_started(self, state: ReplayState) -> None:
        """Before the first step."""

    def replay_stepped(self, now: float) -> None:
        """After every step that ran the model, with the clock already advanced."""

    def replay_ended(self, error: BaseException | None) -> None:
        """After the last step, or with the error that stopped the replay."""


@dataclass(frozen=True, slots=True)
class ReplaySettings:
    """Scheduler settings shared by every arm of a replay."""

    num_gpu_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 32768
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    additional_config: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0
    # "model-len": max_tokens is vLLM's default cap (max_model_len - prompt) and the request
    # ends by sampling EOS at its trace length, so no policy can read the true output
    # length from max_tokens. "exact": max_tokens = trace length (clairvoyant max_tokens).
    max_tokens: str = "model-len"
    # Elastic KV capacity (None: the pool keeps all its blocks); see capacity.py.
    capacity_schedule: CapacitySchedule | None = None
    blocks_per_page: int = 32
    capacity_signals: bool = True


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """What happened to one trace request (times in simulated seconds)."""

    request_id: str
    arrival: float
    first_token: float
    finish: float
    output_tokens: int
    expected_output: int
    preemptions: int
    completions: int


@dataclass(frozen=True, slots=True)
class ArmRun:
    """The raw result of replaying one arm."""

    label: str
    kind: str
    outcomes: tuple[RequestOutcome, ...]
    steps: int
    computed_tokens: int
    recomputed_tokens: int
    recompute_upper_bound: int
    preemption_events: int
    pressure_steps: int
    controller: dict[str, object]
    free_blocks_end: int
    usable_blocks: int
    wall_seconds: float
    capacity: Mapping[str, object] | None = None
    # Sum over scheduler steps of the KV blocks no request held after scheduling (vLLM's
    # free count, evictable cached blocks included): / steps is the mean idle KV.
    free_block_steps: int = 0
    # Scheduler steps from each preemption to the victim's next scheduled step, summed over
    # the victims that came back (``returns``).
    return_steps: int = 0
    returns: int = 0
    # The resolved BidKVConfig of a selector arm (None for other policies): what a claim
    # about "bidkv" ran with, so reports from different defaults cannot be confused.
    policy_config: Mapping[str, object] | None = None
    # A selector arm's decision counts (BidkvPreemptionPolicy.decision_stats), read after
    # the run; None for other policies.
    policy_decisions: Mapping[str, object] | None = None


class _SimTime:
    """Stands in for the ``time`` module inside vLLM's scheduler module."""

    def __init__(self, real: ModuleType) -> None:
        self._real = real
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@contextmanager
def _simulated_clock(module: ModuleType) -> Iterator[_SimTime]:
    # setattr/getattr: mypy does not know the module's own ``time`` import.
    real: ModuleType = getattr(module, "time")  # noqa: B009
    shim = _SimTime(real)
    setattr(module, "time", shim)  # noqa: B010
    try:
        yield shim
    finally:
        setattr(module, "time", real)  # noqa: B010


def _host() -> ModuleType:
    from bidkv_ext.hosts.vllm import offline

    return offline


def run_arm(
    requests: Sequence[TraceRequest],
    arm: Arm,
    settings: ReplaySettings,
    step_model: StepTimeModel,
    *,
    progress: Progress | None = None,
    policy: PreemptionPolicy | None = None,
) -> ArmRun:
    """Replay ``requests`` (sorted by arrival) with ``arm``'s policy; see the module doc.

    ``policy`` is the arm's policy as :func:`preflight_arms` built it, used as it is (one
    run per built policy: a policy may keep state between decisions); without it the host
    builds the arm's policy here.
    """
    offline = _host()
    from vllm.v1.core.sched import scheduler as sched_module
    from vllm.v1.outputs import ModelRunnerOutput

    _check_requests(requests, settings)
    spec = arm.factory(_true_output(requests)) if policy is None else _built_spec(policy)
    scheduler, usable_blocks = _build_scheduler(offline, arm, settings, spec)
    elastic = _elastic_pool(scheduler, requests, settings)
    built = scheduler.controller.policy
    observer = built if isinstance(built, ReplayObserver) else None
    # The settings the arm's policy actually ran with (read before a fault could drop it).
    config = getattr(built, "config", None)
    policy_config = config.model_dump() if isinstance(config, BidKVConfig) else None
    with _simulated_clock(sched_module) as clock, _published(elastic, settings):
        started = time.perf_counter()
        state = _Loop(requests, [str(r.index) for r in requests], scheduler, offline,
                      PromptFactory(settings.seed), step_model, settings, clock, elastic)
        _observed_run(state, observer, ModelRunnerOutput, progress)
        wall = time.perf_counter() - started
    decisions = (asdict(built.decision_stats())
                 if isinstance(built, BidkvPreemptionPolicy) else None)
    return state.result(arm, wall, usable_blocks, policy_config, decisions)


def _build_scheduler(
    offline: ModuleType, arm: Arm, settings: ReplaySettings, spec: object
) -> tuple[Any, int]:
    """The arm's policy scheduler and the KV blocks it can use (all but vLLM's null block)."""
    try:
        vllm_config, kv_cache_config = _vllm_config(offline, arm, settings)
        scheduler = offline.build_scheduler(
            vllm_config, kv_cache_config, preemption_policy=spec, log_stats=False,
        )
    except Exception as exc:
        # The arm's own code (its from_vllm_config) runs here and may raise anything.
        raise ReplayError(f"arm {arm.label!r}: the engine cannot be built: "
                          f"{error_line(exc)}") from None
    return scheduler, kv_cache_config.num_blocks - 1


def _check_requests(requests: Sequence[TraceRequest], settings: ReplaySettings) -> None:
    """Refuse, before any step, a request the scheduler cannot replay as the trace says.

    vLLM rejects a ``max_tokens`` below 1 only when the request is admitted (with
    ``max_tokens="model-len"``, a prompt of ``max_model_len`` tokens or more), mid-replay;
    and it ends a request at ``max_model_len`` tokens, so a longer prompt plus output, or an
    output of 0 tokens, would finish with another output length than the trace's.
    ``select_requests`` removes such requests from a trace (and counts them).
    """
    limit = settings.max_model_len
    for r in requests:
        if r.input_length < 1 or r.output_length < 1:
            raise ReplayError(f"request {r.index}: {r.input_length} prompt and "
                              f"{r.output_length} output tokens; expected at least 1 of each")
        if r.input_length + r.output_length > limit:
            raise ReplayError(f"request {r.index}: {r.input_length} prompt + {r.output_length} "
                              f"output tokens exceed max_model_len {limit}")


def _true_output(requests: Sequence[TraceRequest]) -> dict[str, int]:
    return {str(r.index): r.output_length for r in requests}


def _vllm_config(offline: ModuleType, arm: Arm, settings: ReplaySettings) -> tuple[Any, Any]:
    """The arm's ``VllmConfig`` and ``KVCacheConfig``; raises vLLM's own errors."""
    return offline.build_vllm_config(  # type: ignore[no-any-return]
        num_gpu_blocks=settings.num_gpu_blocks,
        block_size=settings.block_size,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=settings.max_model_len,
        enable_prefix_caching=settings.enable_prefix_caching,
        policy=settings.scheduling_policy,
        enable_chunked_prefill=settings.enable_chunked_prefill,
        additional_config=arm_additional_config(arm, settings.additional_config),
    )


def preflight_arms(
    requests: Sequence[TraceRequest], arms: Sequence[Arm], settings: ReplaySettings
) -> list[PreemptionPolicy | None]:
    """Build every arm's vLLM configuration and policy as :func:`run_arm` will, before any
    arm runs, so a policy that fails to build costs no finished arm; returns the policies in
    arm order, for :func:`run_arm` (``policy=``) to use as they are.

    vLLM's configuration errors are ValueErrors naming the setting and propagate as such
    (the same for every arm); anything else, and every error of the policy's own code
    (``from_vllm_config``, its constructor, a result that is no policy), becomes a
    :class:`ReplayError` naming the arm. The engine's scheduler is not built here, so no
    evidence event is emitted twice, and each policy's constructor runs once: all of them
    before the first arm runs (a policy that draws from the process-wide random generators
    in its constructor draws in arm order, before any arm's replay).
    """
    from bidkv_ext.controller import load_policy

    offline = _host()
    true_output = _true_output(requests)
    built: list[PreemptionPolicy | None] = []
    for arm in arms:
        try:
            vllm_config, _ = _vllm_config(offline, arm, settings)
        except ValueError:
            raise
        except Exception as exc:
            raise ReplayError(f"arm {arm.label!r}: the engine's configuration cannot be "
                              f"built: {error_line(exc)}") from None
        try:
            built.append(load_policy(arm.factory(true_output), vllm_config))
        except Exception as exc:
            raise ReplayError(f"arm {arm.label!r}: its policy cannot be built: "
                              f"{error_line(exc)}") from None
    return built


def _built_spec(policy: PreemptionPolicy) -> type:
    """A policy spec the host's loader turns into ``policy`` itself.

    The loader re-creates an instance whose class has ``from_vllm_config`` (as vLLM-HUST
    does), so the built instance is handed over by a class whose factory returns it.
    """

    class BuiltPolicy:
        @classmethod
        def from_vllm_config(cls, vllm_config: object) -> PreemptionPolicy:
            return policy

    return BuiltPolicy


def _observed_run(
    state: _Loop, observer: ReplayObserver | None, runner_output_cls: Any,
    progress: Progress | None,
) -> None:
    if observer is None:
        state.run(runner_output_cls, progress)
        return
    observer.replay_started(state)
    try:
        state.run(runner_output_cls, progress, stepped=observer.replay_stepped)
    except BaseException as exc:
        observer.replay_ended(exc)
        raise
    observer.replay_ended(None)


def _elastic_pool(
    scheduler: Any, requests: Sequence[TraceRequest], settings: ReplaySettings
) -> ElasticPool | None:
    if settings.capacity_schedule is None:
        return None
    from bidkv_ext.replay.capacity import ElasticPool

    return ElasticPool(
        scheduler.kv_cache_manager.block_pool,
        settings.capacity_schedule,
        blocks_per_page=settings.blocks_per_page,
        origin=requests[0].arrival if requests else 0.0,
    )


@contextmanager
def _published(elastic: ElasticPool | None, settings: ReplaySettings) -> Iterator[None]:
    """Register the elastic pool as the signals source for the arm, if asked to."""
    with ExitStack() as stack:
        if elastic is not None and settings.capacity_signals:
            from kvcached_provider.signals import signals_source

            stack.enter_context(signals_source(elastic))
        yield


class _Loop:
    """Mutable per-arm state; flat lists indexed by trace position keep the step loop lean."""

    def __init__(
        self,
        requests: Sequence[TraceRequest],
        ids: list[str],
        scheduler: Any,
        offline: ModuleType,
        prompts: PromptFactory,
        step_model: StepTimeModel,
        settings: ReplaySettings,
        clock: _SimTime,
        elastic: ElasticPool | None = None,
    ) -> None:
        n = len(requests)
        self.requests = requests
        self.ids = ids
        self.index = {rid: i for i, rid in enumerate(ids)}
        self.scheduler = scheduler
        self.offline = offline
        self.prompts = prompts
        self.model = step_model
        self.settings = settings
        self.clock = clock
        self.elastic = elastic
        self.mark = [0] * n
        self.position = [0] * n
        self.first = [math.nan] * n
        self.finish = [math.nan] * n
        self.tokens = [0] * n
        self.preempted = [0] * n
        self.completions = [0] * n
        # Output lengths that end requests; an observer may rewrite them (the lookahead
        # oracle in benchmarks/replay/headroom.py resamples them in its forks).
        self.lengths = [r.output_length for r in requests]
        self.fake_token = [prompts.fake_output_token(r) for r in requests]
        self.steps = 0
        self.computed = 0
        self.recomputed = 0
        self.upper_bound = 0
        self.preemptions = 0
        self.pressure_steps = 0
        self.free_block_steps = 0
        # The step each waiting victim was preempted in (-1: not waiting to return).
        self.preempted_step = [-1] * n
        self.return_steps = 0
        self.returns = 0

    def _admit(self, i: int) -> None:
        r = self.requests[i]
        exact = self.settings.max_tokens == "exact"
        cap = r.output_length if exact else self.settings.max_model_len - r.input_length
        self.scheduler.add_request(
            self.offline.make_request(
                self.ids[i],
                self.prompts.prompt(r),
                cap,
                r.arrival,
                block_size=self.settings.block_size,
                ignore_eos=exact,
            )
        )

    def run(
        self,
        runner_output_cls: Any,
        progress: Progress | None,
        stepped: Callable[[float], None] | None = None,
    ) -> None:
        requests = self.requests
        n = len(requests)
        scheduler = self.scheduler
        step_seconds = self.model.step_seconds
        elastic = self.elastic
        free_blocks = scheduler.kv_cache_manager.block_pool.get_num_free_blocks
        now = requests[0].arrival if n else 0.0
        arrived = done = idle_steps = 0
        while done < n:
            while arrived < n and requests[arrived].arrival <= now:
                self._admit(arrived)
                arrived += 1
            if not scheduler.has_unfinished_requests():
                if elastic is not None:
                    elastic.idle(now, requests[arrived].arrival)
                now = requests[arrived].arrival
                continue
            self.clock.now = now
            if elastic is not None:
                elastic.before_step(now)
            out = scheduler.schedule()
            if elastic is not None:
                elastic.after_schedule()
            self.steps += 1
            self.free_block_steps += free_blocks()
            preempted = out.preempted_req_ids
            if preempted:
                self._record_preemptions(preempted)
            if not out.num_scheduled_tokens:
                scheduler.update_from_output(out, runner_output_cls(req_ids=[], req_id_to_index={}))
                # A step that preempted freed blocks and skipped admission, so the next step
                # may run what is left in `running`: only steps that changed nothing show
                # the scheduler waits for the next event.
                idle_steps = 0 if preempted else idle_steps + 1
                if idle_steps >= 2:
                    now = self._next_event(now, arrived)
                    idle_steps = 0
                continue
            idle_steps = 0
            req_ids, sampled, prefill, decode, context = self._execute(out.num_scheduled_tokens)
            self.computed += out.total_num_scheduled_tokens
            now += step_seconds(prefill, decode, context)
            self.clock.now = now
            if stepped is not None:
                stepped(now)
            runner_output = runner_output_cls(
                req_ids=req_ids,
                req_id_to_index={rid: j for j, rid in enumerate(req_ids)},
                sampled_token_ids=sampled,
            )
            done += self._deliver(scheduler.update_from_output(out, runner_output), now, progress)
        if elastic is not None:
            # The last finishes freed their blocks at `now` and the engine is empty, as
            # before an idle gap: a pending shrink takes them then.
            elastic.idle(now, None)

    def _execute(
        self, scheduled: Mapping[str, int]
    ) -> tuple[list[str], list[list[int]], int, int, int]:
        """Play the model for one step: the token each request samples, the step's prefill
        and decode work for the step-time model, and the positions computed a second time.

        Returns the scheduled ids, their sampled tokens, prefill tokens, decode requests and
        the decodes' summed context.
        """
        sched_requests = self.scheduler.requests
        index, mark, position, fake = self.index, self.mark, self.position, self.fake_token
        preempted_step, lengths = self.preempted_step, self.lengths
        # With a max_tokens cap the last token of a request is EOS, sampled at its length.
        eos_id: int = self.offline.EOS_TOKEN_ID
        stop_by_eos = self.settings.max_tokens != "exact"
        req_ids = list(scheduled)
        sampled: list[list[int]] = []
        prefill = decode = context = recomputed = 0
        for rid in req_ids:
            k = scheduled[rid]
            request = sched_requests[rid]
            end = request.num_computed_tokens
            start = end - k
            i = index[rid]
            if preempted_step[i] >= 0:
                self.return_steps += self.steps - preempted_step[i]
                self.returns += 1
                preempted_step[i] = -1
            high = mark[i]
            if start < high:
                recomputed += (end if end < high else high) - start
            if end > high:
                mark[i] = end
            position[i] = end
            if end >= request.num_tokens:
                last = stop_by_eos and request.num_output_tokens + 1 >= lengths[i]
                sampled.append([eos_id if last else fake[i]])
                if k == 1 and request.num_output_tokens > 0:
                    decode += 1
                    context += end
                else:
                    prefill += k
            else:
                sampled.append([])
                prefill += k
        self.recomputed += recomputed
        return req_ids, sampled, prefill, decode, context

    def _deliver(self, engine_outputs: Mapping[int, Any], now: float,
                 progress: Progress | None) -> int:
        """Record first tokens and finishes from one step's outputs; returns how many
        requests finished."""
        index, first, finish, tokens = self.index, self.first, self.finish, self.tokens
        finished = 0
        for client_outputs in engine_outputs.values():
            for output in client_outputs.outputs:
                i = index[output.request_id]
                count = len(output.new_token_ids)
                if count:
                    if tokens[i] == 0:
                        first[i] = now
                    tokens[i] += count
                if output.finish_reason is not None:
                    finish[i] = now
                    self.completions[i] += 1
                    finished += 1
                    if progress is not None:
                        progress.update(1)
        return finished

    def _next_event(self, now: float, arrived: int) -> float:
        """Where the clock goes when nothing can be scheduled: the next arrival or capacity
        change; with neither, the replay is stuck."""
        events = []
        if arrived < len(self.requests):
            events.append(self.requests[arrived].arrival)
        if self.elastic is not None:
            change = self.elastic.next_change_after(now)
            if change is not None:
                events.append(change)
        if not events:
            waiting = self.scheduler.waiting
            stuck = "a request"
            if waiting:
                r = self.requests[self.index[waiting.peek_request().request_id]]
                stuck = (f"request {r.index} ({r.input_length} prompt + {r.output_length} "
                         "output tokens)")
            if self.elastic is not None:
                raise ReplayError(
                    f"the scheduler cannot make progress: {stuck} needs more KV blocks than "
                    f"the capacity schedule's final {self.elastic.target} blocks provide"
                )
            raise ReplayError(
                f"the scheduler cannot make progress: {stuck} needs more KV "
                "blocks than --num-gpu-blocks provides"
            )
        return max(now, min(events))

    def _record_preemptions(self, preempted: set[str]) -> None:
        self.pressure_steps += 1
        for rid in preempted:
            i = self.index[rid]
            self.preemptions += 1
            self.preempted[i] += 1
            self.preempted_step[i] = self.steps
            self.upper_bound += self.position[i]
            self.position[i] = 0

    def result(
        self,
        arm: Arm,
        wall: float,
        usable_blocks: int,
        policy_config: dict[str, Any] | None,
        policy_decisions: dict[str, Any] | None = None,
    ) -> ArmRun:
        """The arm's record; finishes the elastic pool, so call it once, after the run."""
        capacity = None
        if self.elastic is not None:
            capacity = self.elastic.finish()
            capacity["signals_published"] = self.settings.capacity_signals
        return ArmRun(
            label=arm.label,
            kind=arm.kind,
            outcomes=self.outcomes(),
            steps=self.steps,
            computed_tokens=self.computed,
            recomputed_tokens=self.recomputed,
            recompute_upper_bound=self.upper_bound,
            preemption_events=self.preemptions,
            pressure_steps=self.pressure_steps,
            controller=dict(self.scheduler.controller.export_stats()),
            free_blocks_end=self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
            usable_blocks=usable_blocks,
            wall_seconds=wall,
            capacity=capacity,
            free_block_steps=self.free_block_steps,
            return_steps=self.return_steps,
            returns=self.returns,
            policy_config=policy_config,
            policy_decisions=policy_decisions,
        )

    def outcomes(self) -> tuple[RequestOutcome, ...]:
        return tuple(
            RequestOutcome(
                request_id=self.ids[i],
                arrival=r.arrival,
                first_token=self.first[i],
                finish=self.finish[i],
                output_tokens=self.tokens[i],
                expected_output=r.output_length,
                preemptions=self.preempted[i],
                completions=self.completions[i],
            )
            for i, r in enumerate(self.requests)
        )
