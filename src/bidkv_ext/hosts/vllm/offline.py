"""Build and drive stock vLLM 0.33.0's real scheduler offline, on CPU, with no model weights.

This is the shared construction kit of the real-scheduler tier (tests, trace replay,
benchmarks). It mirrors how vLLM's own core tests build a scheduler (cpu-host.md section 5):
a hand-written model ``config.json`` bundled in :data:`MODEL_DIR` (a tiny Llama-style
configuration, no weights, no tokenizer), a ``KVCacheConfig`` with one full-attention group
of ``num_gpu_blocks`` blocks, and fake model-runner outputs that emit one token per request
that completes a position.

Typical loop::

    vllm_config, kv_cache_config = build_vllm_config(num_gpu_blocks=64)
    scheduler = build_scheduler(vllm_config, kv_cache_config, preemption_policy=None)
    scheduler.add_request(make_request("0", [1] * 40, max_tokens=8, arrival_time=0.0))
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner_output_for(out, scheduler))

Importing this module imports vLLM; set ``VLLM_TARGET_DEVICE=cpu`` (done here when unset),
``HF_HUB_OFFLINE=1`` and ``TRANSFORMERS_OFFLINE=1`` first.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

# vLLM infers the device at config time; on a machine without the CPU build marker it
# fails unless told. Set before vLLM is imported, never override an explicit choice.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import BlockHash

__all__ = [
    "EOS_TOKEN_ID",
    "FAKE_TOKEN_ID",
    "MODEL_DIR",
    "build_scheduler",
    "build_vllm_config",
    "free_blocks",
    "make_request",
    "run_to_completion",
    "runner_output_for",
    "schedule_digest",
]

MODEL_DIR: pathlib.Path = pathlib.Path(__file__).resolve().parent / "model"
"""Directory holding the bundled tiny Llama-style ``config.json`` (no weights)."""

EOS_TOKEN_ID = 2
"""The bundled config's ``eos_token_id``; requests ignore it (``ignore_eos=True``)."""

FAKE_TOKEN_ID = 7
"""The token every fake model step emits; never EOS, so length alone ends a request."""

_DEFAULT_BLOCK_SIZE = 16

# init_none_hash must run once per process before any block hash is computed; one hasher
# per block size is enough because the hasher is stateless apart from its block size.
_hashers: dict[int, Callable[[Request], list[BlockHash]]] = {}


def build_vllm_config(
    *,
    num_gpu_blocks: int,
    block_size: int = _DEFAULT_BLOCK_SIZE,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    max_model_len: int = 32768,
    enable_prefix_caching: bool = True,
    policy: str = "fcfs",
    enable_chunked_prefill: bool = True,
    additional_config: dict[str, Any] | None = None,
    async_scheduling: bool = False,
) -> tuple[VllmConfig, KVCacheConfig]:
    """A ``VllmConfig`` and a ``KVCacheConfig`` of ``num_gpu_blocks`` blocks, built offline.

    ``num_gpu_blocks`` includes vLLM's reserved null block, so ``num_gpu_blocks - 1`` blocks
    are usable. ``policy`` is vLLM's scheduling policy (``"fcfs"`` or ``"priority"``).
    ``async_scheduling`` holds in the result even on CPU, so :func:`build_scheduler` builds
    the async variant (``PolicyAsyncScheduler``) when it is set.
    """
    if num_gpu_blocks < 2:
        raise ValueError(
            f"num_gpu_blocks must be >= 2 (one is the null block), got {num_gpu_blocks}"
        )
    model_config = ModelConfig(
        model=str(MODEL_DIR),
        trust_remote_code=False,
        dtype="float16",
        seed=42,
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=0,
        async_scheduling=async_scheduling,
        is_encoder_decoder=model_config.is_encoder_decoder,
        watermark=0.0,
        policy=policy,  # type: ignore[arg-type]  # validated by vLLM
    )
    cache_config = CacheConfig(
        block_size=block_size,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=enable_prefix_caching,
    )
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        additional_config=dict(additional_config or {}),
    )
    cache_config.num_gpu_blocks = num_gpu_blocks
    # vLLM's CPU platform switches async scheduling off while the config is built (no CPU
    # model runner overlaps steps). Offline there is no runner, and the flag only picks the
    # scheduler variant a GPU host would run, so the requested value is put back.
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    register_all_kvcache_specs(vllm_config)  # type: ignore[no-untyped-call]
    return vllm_config, _kv_cache_config(num_gpu_blocks, block_size)


def _kv_cache_config(num_gpu_blocks: int, block_size: int) -> KVCacheConfig:
    """One full-attention group of ``num_gpu_blocks`` blocks; no tensors (nothing runs)."""
    return KVCacheConfig(
        num_blocks=num_gpu_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            )
        ],
    )


def build_scheduler(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    *,
    scheduler_cls: type | None = None,
    preemption_policy: object = None,
    **kwargs: Any,
) -> Scheduler:
    """Construct the real scheduler: our ``PolicyScheduler`` by default, or ``scheduler_cls``.

    ``preemption_policy`` (``None``, dotted path, class or instance) goes to our adapter
    classes only; stock ``Scheduler`` takes no policy. Extra ``kwargs`` reach the
    constructor (e.g. ``include_finished_set=True``).
    """
    from bidkv_ext.hosts.vllm.scheduler import PolicySchedulerMixin, select_scheduler_cls

    cls: type = scheduler_cls if scheduler_cls is not None else select_scheduler_cls(vllm_config)
    kwargs.setdefault("log_stats", True)
    if issubclass(cls, PolicySchedulerMixin):
        kwargs["preemption_policy"] = preemption_policy
    elif preemption_policy is not None:
        raise TypeError(f"{cls.__qualname__} takes no preemption_policy; use PolicyScheduler")
    scheduler: Scheduler = cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=vllm_config.cache_config.block_size,
        **kwargs,
    )
    return scheduler


def _hasher(block_size: int) -> Callable[[Request], list[BlockHash]]:
    hasher = _hashers.get(block_size)
    if hasher is None:
        if not _hashers:
            kv_cache_utils.init_none_hash(sha256)
        hasher = kv_cache_utils.get_request_block_hasher(block_size, sha256)
        _hashers[block_size] = hasher
    return hasher


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    max_tokens: int,
    arrival_time: float,
    priority: int = 0,
    *,
    block_size: int = _DEFAULT_BLOCK_SIZE,
    ignore_eos: bool = True,
) -> Request:
    """A text request that generates exactly ``max_tokens`` tokens (``ignore_eos``).

    ``block_size`` must match the scheduler's block size for prefix caching to hash
    the prompt at the right granularity. With ``ignore_eos=False`` the request also stops
    at the first :data:`EOS_TOKEN_ID` it samples, as a real one does; ``max_tokens`` is then
    only its cap.
    """
    params = SamplingParams(ignore_eos=ignore_eos, max_tokens=max_tokens)
    params.update_from_generation_config({}, EOS_TOKEN_ID)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=params,
        pooling_params=None,
        mm_features=None,
        block_hasher=_hasher(block_size),
        arrival_time=arrival_time,
        priority=priority,
    )


def runner_output_for(scheduler_output: SchedulerOutput, scheduler: Scheduler) -> ModelRunnerOutput:
    """A fake ``ModelRunnerOutput``: one token for each request that completes a position.

    A request completes a position when, after this step, its computed tokens reach its
    current length (a decode step or the last prefill chunk); a non-final prefill chunk
    samples nothing, as on a real model runner.
    """
    num_scheduled = scheduler_output.num_scheduled_tokens
    requests = scheduler.requests
    req_ids = list(num_scheduled)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        request = requests[req_id]
        # update_from_output runs after schedule() already advanced num_computed_tokens.
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append([FAKE_TOKEN_ID] if done else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


def run_to_completion(scheduler: Scheduler, *, max_steps: int = 1_000_000) -> int:
    """Drive ``scheduler`` until no request is unfinished; return the number of steps."""
    steps = 0
    while scheduler.has_unfinished_requests():
        if steps >= max_steps:
            raise RuntimeError(f"scheduler did not finish within {max_steps} steps")
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner_output_for(out, scheduler))
        steps += 1
    return steps


def free_blocks(scheduler: Scheduler) -> int:
    """Free blocks in the scheduler's pool (cached-but-unused blocks count as free)."""
    count: int = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    return count


def schedule_digest(out: SchedulerOutput) -> tuple[object, ...]:
    """A canonical, hashable summary of one step, for step-by-step equivalence checks.

    Covers scheduled ids in order with token counts, computed tokens and block ids (new and
    resumed/running requests), preempted and finished ids, and the total token count.
    """
    new = tuple(
        (r.req_id, r.num_computed_tokens, tuple(tuple(g) for g in r.block_ids))
        for r in out.scheduled_new_reqs
    )
    cached = out.scheduled_cached_reqs
    running = tuple(
        (
            req_id,
            computed,
            None if blocks is None else tuple(tuple(g) for g in blocks),
            req_id in cached.resumed_req_ids,
        )
        for req_id, computed, blocks in zip(
            cached.req_ids, cached.num_computed_tokens, cached.new_block_ids, strict=True
        )
    )
    return (
        new,
        running,
        tuple(out.num_scheduled_tokens.items()),
        out.total_num_scheduled_tokens,
        tuple(sorted(out.preempted_req_ids or ())),
        tuple(sorted(out.finished_req_ids)),
    )
