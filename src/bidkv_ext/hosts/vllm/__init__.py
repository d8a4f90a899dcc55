"""Stock vLLM host adapter: ``--scheduler-cls bidkv_ext.hosts.vllm.policy_scheduler``.

The scheduler classes are imported on first access, so importing this package does not
import vLLM (the bundled model config lives in ``model/``; the offline construction kit in
:mod:`bidkv_ext.hosts.vllm.offline`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bidkv_ext.hosts.vllm.rewrite import UnsupportedHostError
    from bidkv_ext.hosts.vllm.scheduler import (
        PolicyAsyncScheduler,
        PolicyScheduler,
        policy_scheduler,
        select_scheduler_cls,
    )

__all__ = [
    "PolicyAsyncScheduler",
    "PolicyScheduler",
    "UnsupportedHostError",
    "policy_scheduler",
    "select_scheduler_cls",
]


def __getattr__(name: str) -> Any:
    # Lazy: resolving "bidkv_ext.hosts.vllm.PolicyScheduler" imports vLLM only here.
    if name == "UnsupportedHostError":
        from bidkv_ext.hosts.vllm import rewrite

        return rewrite.UnsupportedHostError
    if name in __all__:
        from bidkv_ext.hosts.vllm import scheduler

        return getattr(scheduler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
