"""Shared fixtures for the real-scheduler tier (stock vLLM 0.33.0 driven on CPU).

The tier *skips* only when vLLM is not installed. When vLLM is installed, importing the
adapter must succeed: an unsupported version or an unmatched ``Scheduler.schedule`` shape
makes these fixtures (and the tests using them) fail, never skip.
"""

from __future__ import annotations

import atexit
import importlib.util
import inspect
import os
import shutil
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest

# vLLM reads these at import/config time; nothing may be fetched from the network.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _private_kvcached_state_dir() -> None:
    """Keep the suite's kvcached name claims out of the user's state directory.

    A passing kvcached launch check claims its ``KVCACHED_IPC_NAME`` for the process that
    ran it until that process exits, and several tests run the check in this process: in
    the user's directory those claims would refuse the user's own launches (and another
    run of the suite) under the default name while the suite runs. Tests that need a
    directory of their own still set one.
    """
    if "KVCACHED_PROVIDER_STATE_DIR" not in os.environ:
        private = tempfile.mkdtemp(prefix="bidkv-tests-kvcached-state-")
        os.environ["KVCACHED_PROVIDER_STATE_DIR"] = private
        atexit.register(shutil.rmtree, private, ignore_errors=True)


_private_kvcached_state_dir()

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def _hypothesis_draws_independent_of_test_order() -> None:
    """Keep Hypothesis from mixing literals of the project's own loaded modules into draws.

    Hypothesis (6.13x and later) draws some values from the constants of every local
    module in ``sys.modules``. Which of our modules are loaded depends on the tests that
    ran before (many import lazily), so the derandomized examples of a property test, and
    the non-vacuity tallies it asserts, changed with test order and selection: a test
    passed alone and failed in the whole suite. With the pool empty, a property test
    draws the same examples however the suite is run. Hypothesis's own built-in constants
    are kept. The hook is private; if a later Hypothesis drops it, nothing is changed.
    """
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:  # pragma: no cover - hypothesis is a test dependency
        return
    constants = getattr(providers, "Constants", None)
    if constants is not None and hasattr(providers, "_get_local_constants"):
        empty = constants()
        providers._get_local_constants = lambda: empty


_hypothesis_draws_independent_of_test_order()


@pytest.fixture
def umask_022() -> Iterator[None]:
    """Run the test under umask 022 (what new files' modes are checked against)."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture(scope="session")
def vllm_offline() -> ModuleType:
    """The :mod:`bidkv_ext.hosts.vllm.offline` kit, with the adapter already imported."""
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed (real-scheduler tier)")
    from bidkv_ext.hosts.vllm import offline, scheduler  # noqa: F401  # rewrite must apply

    return offline


@pytest.fixture(scope="module")
def rewrite(vllm_offline: ModuleType) -> ModuleType:
    """The adapter's :mod:`bidkv_ext.hosts.vllm.rewrite` (cpu-host.md section 7.2)."""
    from bidkv_ext.hosts.vllm import rewrite

    return rewrite


@pytest.fixture(scope="module")
def schedule_source(vllm_offline: ModuleType) -> str:
    """The installed, unrewritten ``Scheduler.schedule`` source, dedented."""
    from vllm.v1.core.sched.scheduler import Scheduler

    return textwrap.dedent(inspect.getsource(Scheduler.schedule))


@pytest.fixture
def make_scheduler(vllm_offline: ModuleType) -> Callable[..., Any]:
    """Factory: ``make_scheduler(num_gpu_blocks=..., scheduler_cls=None, preemption_policy=None,
    **config_kwargs)`` -> a real scheduler (our ``PolicyScheduler`` unless told otherwise)."""

    def factory(
        *,
        num_gpu_blocks: int,
        scheduler_cls: type | None = None,
        preemption_policy: object = None,
        **config_kwargs: Any,
    ) -> Any:
        vllm_config, kv_cache_config = vllm_offline.build_vllm_config(
            num_gpu_blocks=num_gpu_blocks, **config_kwargs
        )
        return vllm_offline.build_scheduler(
            vllm_config,
            kv_cache_config,
            scheduler_cls=scheduler_cls,
            preemption_policy=preemption_policy,
        )

    return factory


def seeded_workload(seed: int, num_requests: int) -> list[tuple[str, list[int], int, float, int]]:
    """(id, prompt, max_tokens, arrival_time, priority) tuples; 40 % share one of four
    48-token prefixes, so prefix caching finds shared blocks."""
    import random

    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, 30000) for _ in range(48)] for _ in range(4)]
    items = []
    for i in range(num_requests):
        tail = [rng.randrange(10, 30000) for _ in range(rng.randrange(8, 140))]
        prompt = (rng.choice(prefixes) + tail) if rng.random() < 0.4 else tail
        items.append((f"r{i}", prompt, rng.randrange(4, 80), 1000.0 + i, rng.randrange(4)))
    return items


def drive_workload(
    offline: ModuleType,
    scheduler: Any,
    workload: list[tuple[str, list[int], int, float, int]],
    *,
    arrivals_per_step: int = 2,
    max_steps: int = 20_000,
) -> tuple[list[object], int]:
    """Add ``arrivals_per_step`` requests before each step and run to completion.

    Returns one ``(schedule_digest, free_blocks)`` entry per step and the total number of
    preemptions, so two runs can be compared step by step.
    """
    pending = list(workload)
    requests = []
    digests: list[object] = []
    while pending or scheduler.has_unfinished_requests():
        for _ in range(min(arrivals_per_step, len(pending))):
            rid, prompt, max_tokens, arrival, priority = pending.pop(0)
            request = offline.make_request(rid, prompt, max_tokens, arrival, priority)
            requests.append(request)
            scheduler.add_request(request)
        out = scheduler.schedule()
        digests.append((offline.schedule_digest(out), offline.free_blocks(scheduler)))
        scheduler.update_from_output(out, offline.runner_output_for(out, scheduler))
        if len(digests) >= max_steps:
            raise AssertionError(f"workload did not finish within {max_steps} steps")
    return digests, sum(r.num_preemptions for r in requests)
