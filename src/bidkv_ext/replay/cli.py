"""``bidkv-replay``: replay a request trace through the real vLLM scheduler, per victim policy.

With no arguments it replays the bundled Azure conversation sample for ``builtin``,
``least-computed-first`` and ``bidkv`` at a KV budget that causes preemptions, and writes
``report.json``, ``timing.json``, ``report.md``, ``ttft_cdf.png`` and ``bars.png`` to
``./bidkv-replay-out/``.

Host-shaped flags (as ``vllm serve`` takes them, so ``vllm-hust-ext run -- bidkv-replay``
works): ``--preemption-policy module.Object`` adds an arm whose policy the host loads
through the controller (``from_vllm_config`` sees ``--additional-config`` and the
``BIDKV_UTILITY_*`` environment); ``--additional-config JSON`` reaches every arm's
``VllmConfig.additional_config``.

Elastic capacity: ``--capacity-schedule FILE`` (JSON list of ``{"t": s, "blocks": n}`` or
CSV ``t,blocks``) lowers and raises the KV blocks available over simulated time with
kvcached's semantics (``bidkv_ext.replay.capacity``); ``--blocks-per-page`` sets the page
geometry and ``--no-capacity-signals`` keeps the elastic pool but publishes no signals.

Bad input (trace rows, files, flags, configuration) prints one line and exits 2. Everything
is checked before the first arm runs: the cheap checks first, then a preflight that builds
every arm's vLLM configuration and policy as the engine will (so what only vLLM or the
policy knows, such as a ``--max-model-len`` vLLM cannot serve or a ``from_vllm_config`` that
raises, fails there, naming the arm; each arm then runs with the policy built there, so a
policy is built once), and last the ``--output-dir`` (created then). So a bad input never
costs a finished arm. An arm that fails once the run has started (a capacity schedule
that shrinks below a request only some arms still run, an engine that cannot be built)
stops the run there, exit 2, with the outputs holding the arms before it. Report files
and plots are written atomically (temporary file in the directory + ``os.replace``); a
figure JSON cannot hold (infinity) fails only the file that holds it, with one line naming
the figure.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import stat
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from bidkv_ext.contract import PreemptionPolicy
from bidkv_ext.replay import jsontext
from bidkv_ext.replay.arms import (
    Arm,
    ArmError,
    check_arms,
    first_validation_error,
    parse_arms,
)
from bidkv_ext.replay.capacity import (
    DEFAULT_BLOCKS_PER_PAGE,
    CapacitySchedule,
    CapacityScheduleError,
    load_capacity_schedule,
)
from bidkv_ext.replay.limits import MAX_SIMULATED_SECONDS
from bidkv_ext.replay.report import OutputError, prepare_output_dir
from bidkv_ext.replay.steptime import (
    PRESETS,
    StepTimeModel,
    StepTimeModelError,
    check_step_bound,
    load_step_model,
)
from bidkv_ext.replay.trace import (
    TraceError,
    TraceRequest,
    TraceSelection,
    load_trace,
    select_requests,
)

if TYPE_CHECKING:  # the engine imports vLLM (seconds); usage errors must not wait for it
    from bidkv_ext.replay.engine import ReplaySettings

__all__ = ["DEFAULT_POLICIES", "SAMPLE_NUM_GPU_BLOCKS", "SAMPLE_TRACE", "build_parser", "main"]

SAMPLE_TRACE = Path(__file__).resolve().parent / "data" / "azure_conv_sample.csv"
SAMPLE_ATTRIBUTION = (
    "Bundled sample: the first 1,000 rows of the Azure LLM inference trace 2023 "
    "(conversation), CC-BY-4.0. P. Patel, E. Choukse, C. Zhang, A. Shah, I. Goiri, S. Maleki, "
    "R. Bianchini, \"Splitwise: Efficient generative LLM inference using phase splitting\", "
    "ISCA 2024. Source: https://github.com/Azure/AzurePublicDataset (see data/NOTICE)."
)
DEFAULT_POLICIES = "builtin,least-computed-first,bidkv"
SAMPLE_NUM_GPU_BLOCKS = 1600
"""KV budget of the embedded default: enough preemption on the sample to separate arms."""
DEFAULT_NUM_GPU_BLOCKS = 4096
MAX_NUM_GPU_BLOCKS = 10_000_000
"""Upper bound of ``--num-gpu-blocks``: vLLM builds a Python object per block before the
first step, so a typo of a few extra digits would run out of memory or never start. Ten
million 16-token blocks hold 160 M tokens, over 100 times the KV cache of the largest
single GPU (an H200's 141 GB holds about 1.1 M tokens of Llama-3.1-8B)."""
DEFAULT_OUTPUT_DIR = Path("bidkv-replay-out")
SCHEMA = "bidkv-replay/1"
REPORT_FILES = ("report.json", "timing.json", "report.md")
PLOT_FILES = ("ttft_cdf.png", "bars.png")


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, like every other refusal: argparse's own error would come after the
        # usage block of some forty options.
        self.exit(2, f"{self.prog}: error: {' '.join(message.splitlines())} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="bidkv-replay",
        description="Replay a request trace through the real vLLM scheduler and compare "
        "KV-cache victim policies on a simulated clock.",
    )
    add = p.add_argument
    add("--trace", type=Path, default=None,
        help="Azure 2023 CSV or Mooncake JSONL (default: the bundled Azure conv sample)")
    add("--format", choices=("auto", "azure", "mooncake"), default="auto")
    add("--start", type=float, default=0.0, help="window start, seconds of trace time")
    add("--duration", type=float, default=None, help="window length, seconds of trace time")
    add("--max-requests", type=int, default=None, help="keep the first N requests of the window")
    add("--rate-scale", type=float, default=1.0,
        help="divide inter-arrival gaps by this factor (>1 raises the rate)")
    add("--num-gpu-blocks", type=int, default=None,
        help=f"KV blocks incl. the null block (default {SAMPLE_NUM_GPU_BLOCKS} for the sample, "
        f"{DEFAULT_NUM_GPU_BLOCKS} otherwise)")
    add("--block-size", type=int, default=16)
    add("--max-num-seqs", type=int, default=256)
    add("--max-num-batched-tokens", type=int, default=8192)
    add("--max-model-len", type=int, default=32768,
        help="requests with prompt + output above this are removed (and counted)")
    add("--max-tokens", choices=("model-len", "exact"), default="model-len",
        help="each request's max_tokens: vLLM's default cap (max_model_len - prompt; the "
        "request ends by EOS at its trace length) or the exact trace length, which "
        "leaks the true output length to policies (default model-len)")
    add("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="vLLM automatic prefix caching (default on)")
    add("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs")
    add("--seed", type=int, default=0, help="seed for fake token ids and seeded policies")
    add("--policies", default=None,
        help=f"comma-separated policy names, 'clairvoyant' for the reference arm "
        f"(default {DEFAULT_POLICIES} unless another policy flag is given)")
    add("--policy-class", action="append", default=[], metavar="MODULE:OBJECT",
        help="add an arm for any vllm.preemption-policy.v1 implementation (repeatable)")
    add("--preemption-policy", default=None, metavar="MODULE.OBJECT",
        help="add an arm whose policy the host loads by dotted path, as vllm serve does")
    add("--additional-config", default=None, metavar="JSON",
        help="JSON object passed as VllmConfig.additional_config to every arm")
    add("--step-model", default="llama-3.1-8b-h100",
        help=f"preset ({', '.join(sorted(PRESETS))}) or a JSON/TOML file with name, a, b, c, d")
    add("--capacity-schedule", type=Path, default=None, metavar="FILE",
        help='elastic KV capacity over simulated time: JSON [{"t": s, "blocks": n}, ...] or '
        "CSV t,blocks (t from the first arrival; blocks <= --num-gpu-blocks - 1); shrinks "
        "wait for blocks to free, growth is immediate (kvcached semantics)")
    add("--blocks-per-page", type=int, default=DEFAULT_BLOCKS_PER_PAGE,
        help="KV blocks per physical page for the elastic pool (default "
        f"{DEFAULT_BLOCKS_PER_PAGE}: Llama-3.1-8B, 64 KiB per-layer block, 2 MiB page)")
    add("--capacity-signals", action=argparse.BooleanOptionalAction, default=True,
        help="publish the elastic pool's capacity signals to policies (default on)")
    # Read as text: Path("") is ".", so an empty value would write into the working
    # directory; _run refuses it and makes the Path.
    add("--output-dir", default=str(DEFAULT_OUTPUT_DIR))
    add("--no-plots", action="store_true", help="skip the PNG plots")
    add("--no-progress", action="store_true", help="no progress bar")
    return p


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: json.loads gives inf, which no report can hold
        raise _UsageError(f"--additional-config: number {text} is out of range; expected "
                          "finite numbers")
    return value


def _no_constant(name: str) -> object:
    # json.loads accepts NaN, Infinity and -Infinity, which are not JSON.
    raise _UsageError(f"--additional-config: {name} is not a JSON number; expected finite "
                      "numbers")


def _additional_config(raw: str | None) -> dict[str, Any]:
    if raw is None:
        return {}
    try:
        value = jsontext.loads(raw, parse_float=_finite_float, parse_constant=_no_constant)
    except jsontext.JsonTextError as exc:
        raise _UsageError(f"--additional-config: {exc}; expected a JSON object") from None
    if not isinstance(value, dict):
        raise _UsageError("--additional-config must contain a JSON object")
    return value


def _check_numbers(args: argparse.Namespace) -> None:
    positive = {
        "--block-size": args.block_size,
        "--max-num-seqs": args.max_num_seqs,
        "--max-num-batched-tokens": args.max_num_batched_tokens,
        "--max-model-len": args.max_model_len,
    }
    for flag, value in positive.items():
        if value < 1:
            raise _UsageError(f"{flag} must be >= 1, got {value}")
    blocks = args.num_gpu_blocks
    if blocks is not None and not 2 <= blocks <= MAX_NUM_GPU_BLOCKS:
        raise _UsageError(
            f"--num-gpu-blocks must be between 2 and {MAX_NUM_GPU_BLOCKS:,}, got {blocks}")
    if args.max_requests is not None and args.max_requests < 1:
        raise _UsageError(f"--max-requests must be >= 1, got {args.max_requests}")
    if args.max_num_batched_tokens < args.max_num_seqs:
        # vLLM's SchedulerConfig rule, checked here to fail before the engine starts.
        raise _UsageError(
            f"--max-num-batched-tokens ({args.max_num_batched_tokens}) must be >= "
            f"--max-num-seqs ({args.max_num_seqs})"
        )
    if args.blocks_per_page < 1:
        raise _UsageError(f"--blocks-per-page must be >= 1, got {args.blocks_per_page}")
    if args.seed < 0:
        # NumPy seeds the fake token ids; it refuses negative seeds, but only mid-replay.
        raise _UsageError(f"--seed must be an integer >= 0, got {args.seed}")
    _check_floats(args)


def _check_floats(args: argparse.Namespace) -> None:
    # argparse's float() takes "nan" and "inf"; every comparison with NaN is False, so
    # finiteness is checked first and explicitly.
    if not (math.isfinite(args.start) and args.start >= 0):
        raise _UsageError(f"--start must be a finite number of seconds >= 0, got {args.start}")
    duration = args.duration
    if duration is not None and not (math.isfinite(duration) and duration > 0):
        raise _UsageError(f"--duration must be a finite number of seconds > 0, got {duration}")
    if not (math.isfinite(args.rate_scale) and args.rate_scale > 0):
        raise _UsageError(f"--rate-scale must be a finite number > 0, got {args.rate_scale}")


def _output_dir(raw: str | Path) -> Path:
    if not str(raw).strip():
        raise _UsageError("--output-dir must name a directory, got an empty value")
    return Path(raw)


def _output_names(args: argparse.Namespace) -> tuple[str, ...]:
    return REPORT_FILES + (() if args.no_plots else PLOT_FILES)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _blocks(request: TraceRequest, block_size: int) -> int:
    """The KV blocks the request holds when it runs alone to its end: the positions the model
    executes, the prompt and every output token but the last, which is sampled and never
    fed back (vLLM allocates slots for ``num_computed_tokens + num_new_tokens``)."""
    positions = request.input_length + request.output_length - 1
    return -(-positions // block_size)


def _fits(request: TraceRequest, usable_blocks: int, block_size: int) -> bool:
    """Whether the request can run alone in the pool."""
    return _blocks(request, block_size) <= usable_blocks


def _check_final_capacity(
    capacity: CapacitySchedule, requests: Sequence[TraceRequest], block_size: int, path: Path
) -> None:
    """Refuse a schedule under which every arm stalls: a request arriving at or after the
    last change that the last capacity cannot hold alone never runs, whatever the policy.
    (One arriving earlier stalls only if some arm still has it unfinished then; such a
    stall stops the run at that arm, with the arms before it reported.)"""
    final = capacity.points[-1].blocks
    last_change = requests[0].arrival + capacity.points[-1].t  # schedule time is relative
    late = [(r, _blocks(r, block_size)) for r in requests if r.arrival >= last_change]
    too_large = [(r, need) for r, need in late if need > final]
    if too_large:
        request, need = too_large[0]
        most = max(need for _, need in too_large)  # the least capacity that holds them all
        others = f" and {len(too_large) - 1} more" if len(too_large) > 1 else ""
        raise _UsageError(
            f"--capacity-schedule {path}: its final capacity of {final} blocks cannot hold "
            f"request {request.index} ({request.input_length} prompt + "
            f"{request.output_length} output tokens, {need} blocks of {block_size} tokens)"
            f"{others}, arriving after the last change, so every arm would stall; expected a "
            f"final capacity of at least {most} blocks, or a window without them"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except (_UsageError, TraceError, StepTimeModelError, ArmError,
            CapacityScheduleError, OutputError) as exc:
        print(f"bidkv-replay: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        # Configuration errors raised while the host builds a policy (BidKVConfig and
        # friends, vLLM's own pydantic configs) are ValueErrors naming the setting.
        print(f"bidkv-replay: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C is the user's choice, not a fault: one line, the shell's 128 + SIGINT.
        # Output files are written atomically, so none is left half-written.
        print("bidkv-replay: interrupted", file=sys.stderr)
        return 130


def _one_line(exc: ValueError) -> str:
    """A pydantic ValidationError prints several lines; keep its first error's message."""
    first = first_validation_error(exc)
    if first is not None:
        where, message = first[0], first[1].removeprefix("Value error, ")
        return f"{where}: {message}" if where else message
    return " ".join(str(exc).split())


def _run(args: argparse.Namespace) -> int:
    # Usage errors first (numbers, config, step model, capacity schedule, arms, trace), all
    # before vLLM is imported; the output directory is created last.
    _check_numbers(args)
    args.output_dir = _output_dir(args.output_dir)
    additional = _additional_config(args.additional_config)
    step_model = _step_model(args)
    trace_path: Path = args.trace if args.trace is not None else SAMPLE_TRACE
    _rereadable(trace_path, "--trace")
    if args.capacity_schedule is not None:
        _rereadable(args.capacity_schedule, "--capacity-schedule")
    num_blocks = args.num_gpu_blocks or (
        SAMPLE_NUM_GPU_BLOCKS if args.trace is None else DEFAULT_NUM_GPU_BLOCKS)
    capacity = (None if args.capacity_schedule is None
                else load_capacity_schedule(args.capacity_schedule, num_blocks - 1))
    arms = _policy_arms(args, additional)
    raw = load_trace(trace_path, args.format)
    selection, requests = _window(args, raw, trace_path, num_blocks - 1)
    if capacity is not None:
        _check_final_capacity(capacity, requests, args.block_size, args.capacity_schedule)

    # Imported here: the engine pulls in vLLM (seconds), not needed for usage errors.
    from bidkv_ext.replay.engine import ReplayError, preflight_arms

    settings = _settings(args, num_blocks, additional, capacity)
    try:
        policies = preflight_arms(requests, arms, settings)
    except ReplayError as exc:
        print(f"bidkv-replay: error: {exc}", file=sys.stderr)
        return 2
    # Last check before the first engine: creates the directory, so only when all else passed.
    prepare_output_dir(args.output_dir, _output_names(args))
    trace_info = _trace_info(args, trace_path, raw, selection, requests)
    done = _replay_all(requests, arms, policies, settings, step_model, args)
    written = 0
    if done.results:
        document = _report_document(args, trace_info, settings, step_model, done.results)
        written = _write_outputs(args, document, done.ttfts, done.speeds, done.walls)
    if done.stopped is not None:
        # An arm failed mid-run (a stall that depends on the policy, an engine that cannot
        # be built): the arms before it keep their results.
        label = arms[len(done.results)].label
        reason = done.stopped.removeprefix(f"arm {label!r}: ")  # named once, just below
        kept = (f"; the outputs hold the {len(done.results)} arm(s) before it"
                if done.results else "")
        print(f"bidkv-replay: error: arm {label!r} stopped: {reason}{kept}", file=sys.stderr)
        return 2
    return written


def _rereadable(path: Path, option: str) -> None:
    """Refuse a pipe or device: the file is read again to record its sha256 (and a trace
    once more to guess its format), and a second read of a pipe sees nothing."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return  # the loader names a missing or unreadable file
    if not stat.S_ISREG(mode):
        raise _UsageError(
            f"{option} {path}: expected a regular file (it is read more than once, to record "
            "its sha256), got a pipe, device or directory; write it to a file first"
        )


def _step_model(args: argparse.Namespace) -> StepTimeModel:
    step_model = load_step_model(args.step_model)
    check_step_bound(step_model, args.step_model, MAX_SIMULATED_SECONDS,
                     prefill_tokens=args.max_num_batched_tokens,
                     decode_requests=args.max_num_seqs,
                     decode_context=args.max_num_seqs * args.max_model_len)
    return step_model


def _policy_arms(args: argparse.Namespace, additional: dict[str, Any]) -> tuple[Arm, ...]:
    policies = args.policies
    if policies is None and args.preemption_policy is None and not args.policy_class:
        policies = DEFAULT_POLICIES
    arms = parse_arms(
        policies,
        preemption_policy=args.preemption_policy,
        policy_classes=args.policy_class,
        seed=args.seed,
    )
    if not arms:
        raise _UsageError("no policy arm: give --policies, --preemption-policy or --policy-class")
    check_arms(arms, additional, environ=os.environ, block_size=args.block_size,
               prefix_caching=args.prefix_caching)
    return arms


def _window(
    args: argparse.Namespace, raw: Sequence[TraceRequest], trace_path: Path, usable_blocks: int
) -> tuple[TraceSelection, tuple[TraceRequest, ...]]:
    """The requests replayed: the selected window, less those the KV cache cannot hold."""
    selection = select_requests(
        raw,
        start=args.start,
        duration=args.duration,
        max_requests=args.max_requests,
        rate_scale=args.rate_scale,
        max_model_len=args.max_model_len,
    )
    requests = tuple(r for r in selection.requests if _fits(r, usable_blocks, args.block_size))
    if not requests:
        raise _UsageError(
            f"{trace_path}: no request left after the window (--start, --duration, "
            "--max-requests) and the length filters (--max-model-len, and the KV capacity of "
            "--num-gpu-blocks x --block-size); expected a window holding requests that fit")
    _check_arrivals(requests, args.rate_scale, trace_path)
    return selection, requests


def _settings(
    args: argparse.Namespace,
    num_blocks: int,
    additional: dict[str, Any],
    capacity: CapacitySchedule | None,
) -> ReplaySettings:
    from bidkv_ext.replay.engine import ReplaySettings

    return ReplaySettings(
        num_gpu_blocks=num_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.prefix_caching,
        max_tokens=args.max_tokens,
        scheduling_policy=args.scheduling_policy,
        additional_config=additional,
        seed=args.seed,
        capacity_schedule=capacity,
        blocks_per_page=args.blocks_per_page,
        capacity_signals=args.capacity_signals,
    )


def _trace_info(
    args: argparse.Namespace,
    trace_path: Path,
    raw: Sequence[TraceRequest],
    selection: TraceSelection,
    requests: Sequence[TraceRequest],
) -> dict[str, Any]:
    """What report.json says of the trace and the window taken from it."""
    return {
        "name": trace_path.name,
        "format": "mooncake" if raw[0].hash_ids is not None else "azure",
        "sha256": _sha256(trace_path),
        "rows": len(raw),
        "start_s": args.start,
        "duration_s": args.duration,
        "max_requests": args.max_requests,
        "rate_scale": args.rate_scale,
        "rows_in_window": selection.rows_in_window,
        "filtered_too_long": selection.filtered_too_long,
        "filtered_kv_capacity": len(selection.requests) - len(requests),
        "requests": len(requests),
        "attribution": SAMPLE_ATTRIBUTION if args.trace is None else None,
    }


def _check_arrivals(requests: Sequence[TraceRequest], rate_scale: float, trace: Path) -> None:
    """Arrivals the float clock cannot hold: a trace spanning centuries, or a tiny
    --rate-scale dividing its gaps into such times."""
    last = requests[-1].arrival
    if last <= MAX_SIMULATED_SECONDS:  # False for inf too (NaN cannot occur here)
        return
    if rate_scale == 1:
        raise _UsageError(f"{trace}: the last selected arrival is at {last:g} s; expected "
                          f"arrivals below {MAX_SIMULATED_SECONDS:g} s")
    raise _UsageError(
        f"--rate-scale {rate_scale:g} stretches the last arrival to {last:g} s; expected "
        f"a rate scale that keeps arrivals below {MAX_SIMULATED_SECONDS:g} s")


@dataclass(slots=True)
class _Replayed:
    """The arms replayed, in order, and why the run stopped early (None: every arm ran)."""

    results: list[dict[str, object]] = field(default_factory=list)
    ttfts: list[tuple[str, list[float]]] = field(default_factory=list)
    speeds: dict[str, float] = field(default_factory=dict)
    walls: dict[str, float] = field(default_factory=dict)
    stopped: str | None = None


def _replay_all(
    requests: tuple[TraceRequest, ...],
    arms: tuple[Arm, ...],
    policies: Sequence[PreemptionPolicy | None],
    settings: ReplaySettings,
    step_model: StepTimeModel,
    args: argparse.Namespace,
) -> _Replayed:
    from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]

    from bidkv_ext.replay.engine import ReplayError, run_arm
    from bidkv_ext.replay.metrics import arm_metrics

    done = _Replayed()
    total = len(requests) * len(arms)
    with tqdm(total=total, unit="req", file=sys.stderr, delay=2.0,
              disable=args.no_progress, desc="replay") as bar:
        # Each arm runs with the policy the preflight built for it (built once, used once).
        for arm, policy in zip(arms, policies, strict=True):
            bar.set_postfix_str(arm.label)
            try:
                run = run_arm(requests, arm, settings, step_model, progress=bar, policy=policy)
            except ReplayError as exc:
                done.stopped = str(exc)
                break
            metrics = arm_metrics(run)
            done.results.append(metrics)
            done.ttfts.append((arm.label, [o.first_token - o.arrival for o in run.outcomes
                                           if not math.isnan(o.first_token)]))
            makespan = float(metrics["makespan_s"])  # type: ignore[arg-type]
            done.walls[arm.label] = run.wall_seconds
            done.speeds[arm.label] = (makespan / run.wall_seconds if run.wall_seconds > 0
                                      else 0.0)
    return done


def _say(text: str) -> None:
    """Print results on stdout. A reader that left the pipe (``bidkv-replay | head``) must
    not cost the report files still to be written: output stops there, and the run goes on
    (flushed now, so a buffered stdout cannot fail instead at exit)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _write_outputs(
    args: argparse.Namespace,
    document: dict[str, Any],
    ttfts: list[tuple[str, list[float]]],
    speeds: dict[str, float],
    walls: dict[str, float],
) -> int:
    # Imported when called: a test stands in for a writer by patching the report module.
    from bidkv_ext.replay.report import (
        format_capacity_table,
        format_table,
        markdown_report,
        write_atomic,
        write_json,
        write_plots,
    )

    results: list[dict[str, object]] = document["arms"]
    # The table first: if a file cannot be written after all, the results are on stdout.
    _say(format_table(results, speeds))
    capacity_table = format_capacity_table(results)
    if capacity_table:
        _say(capacity_table)
    out: Path = args.output_dir
    timing = {"wall_seconds": walls, "simulated_seconds_per_wall_second": speeds}
    writers: list[tuple[Path, Callable[[], None]]] = [
        (out / "report.json", lambda: write_json(out / "report.json", document)),
        (out / "timing.json", lambda: write_json(out / "timing.json", timing)),
        (out / "report.md",
         lambda: write_atomic(out / "report.md", markdown_report(
             document, speeds, plots=not args.no_plots).encode())),
    ]
    if not args.no_plots:
        writers.append((out, lambda: write_plots(out, ttfts, results)))
    _write_all(writers)
    _say(f"outputs: {out}/ ({', '.join(_output_names(args))})")
    broken = [r["label"] for r in results if not _conserved(r)]
    if broken:
        print(f"bidkv-replay: error: conservation violated for {', '.join(map(str, broken))}",
              file=sys.stderr)
        return 1
    return 0


def _report_document(
    args: argparse.Namespace,
    trace_info: dict[str, Any],
    settings: ReplaySettings,
    step_model: StepTimeModel,
    results: list[dict[str, object]],
) -> dict[str, Any]:
    """report.json: the trace window, the engine's settings, the host and every arm."""
    import vllm

    from bidkv_ext._version import __version__ as bidkv_version

    return {
        "schema": SCHEMA,
        "seed": args.seed,
        "trace": trace_info,
        "settings": {
            "num_gpu_blocks": settings.num_gpu_blocks,
            "block_size": settings.block_size,
            "max_num_seqs": settings.max_num_seqs,
            "max_num_batched_tokens": settings.max_num_batched_tokens,
            "max_model_len": settings.max_model_len,
            "enable_prefix_caching": settings.enable_prefix_caching,
            "max_tokens": settings.max_tokens,
            "enable_chunked_prefill": settings.enable_chunked_prefill,
            "scheduling_policy": settings.scheduling_policy,
            "additional_config": dict(settings.additional_config),
            "capacity_schedule": _capacity_settings(args, settings),
        },
        "host": {"vllm_version": vllm.__version__,
                 "scheduler": "bidkv_ext.hosts.vllm.PolicyScheduler",
                 "bidkv_ext_version": bidkv_version},
        "step_model": step_model.as_dict(),
        "arms": results,
    }


def _write_all(writers: Sequence[tuple[Path, Callable[[], None]]]) -> None:
    """Write every file that can be written; then raise the first failure as one line."""
    from bidkv_ext.replay.report import NonFiniteError, output_error

    failed: list[OutputError] = []
    for target, write in writers:
        try:
            write()
        except OSError as exc:
            # filename2 is os.replace's destination; filename is often the temporary file.
            failed.append(output_error(Path(exc.filename2 or target), exc))
        except NonFiniteError as exc:
            # Checked inputs keep every figure finite; should one still not be, only the
            # file that holds it is lost, not the run.
            failed.append(OutputError(str(exc)))
    if failed:
        raise failed[0]


def _capacity_settings(
    args: argparse.Namespace, settings: ReplaySettings
) -> dict[str, Any] | None:
    schedule = settings.capacity_schedule
    if schedule is None:
        return None
    path: Path = args.capacity_schedule
    return {
        "file": path.name,
        "sha256": _sha256(path),
        "points": schedule.as_list(),
        "blocks_per_page": settings.blocks_per_page,
        "signals": settings.capacity_signals,
    }


def _conserved(metrics: dict[str, object]) -> bool:
    c = metrics["conservation"]
    assert isinstance(c, dict)
    ok = bool(c["all_completed_once"] and c["exact_output_lengths"]
              and c["free_blocks_end"] == c["usable_blocks"])
    capacity = metrics.get("capacity")
    if isinstance(capacity, dict):
        # No block leaked into or out of the reserve, and a completed shrink was honoured.
        end = capacity["free_blocks_end"], capacity["reserved_blocks_end"]
        ok = ok and bool(capacity["reserve_released"]) and sum(end) == c["usable_blocks"]
        ok = ok and capacity["max_overcommit_after_shrink_blocks"] == 0
    return ok


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
