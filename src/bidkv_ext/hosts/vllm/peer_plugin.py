"""pytest plugin for ``scripts/peer_suite.sh``: run vLLM's own tests on our adapter.

Loaded with ``-p bidkv_ext.hosts.vllm.peer_plugin`` from the root of the vLLM 0.33.0 sdist.
After collection it replaces, in every imported ``tests.*`` module, the names
``Scheduler`` and ``AsyncScheduler`` that still point at vLLM's classes with adapter
subclasses that default to an always-abstaining policy. The tests' own helpers (such as
``create_scheduler``) look those names up at call time, so every scheduler they build is
ours, and every victim decision goes through the rewritten ``schedule`` and the controller.
At the end it prints how many schedulers were built and how often the policy was asked.
"""

from __future__ import annotations

import sys
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from bidkv_ext.contract import PreemptionContext
from bidkv_ext.hosts.vllm.scheduler import PolicyAsyncScheduler, PolicyScheduler

__all__ = ["AbstainingPolicy", "PeerAsyncScheduler", "PeerScheduler"]

_built: list[Any] = []


class AbstainingPolicy:
    """Always hands the decision back to the host's built-in victim."""

    def select_victim(self, context: PreemptionContext) -> str | None:
        return None


class PeerScheduler(PolicyScheduler):
    """``PolicyScheduler`` with an abstaining policy unless the caller passes one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("preemption_policy", AbstainingPolicy())
        super().__init__(*args, **kwargs)
        _built.append(self.controller)


class PeerAsyncScheduler(PolicyAsyncScheduler):
    """``PolicyAsyncScheduler`` with an abstaining policy unless the caller passes one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("preemption_policy", AbstainingPolicy())
        super().__init__(*args, **kwargs)
        _built.append(self.controller)


_SUBSTITUTES: dict[str, tuple[type, type]] = {
    "Scheduler": (Scheduler, PeerScheduler),
    "AsyncScheduler": (AsyncScheduler, PeerAsyncScheduler),
}


def _substitute() -> int:
    patched = 0
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "tests" or name.startswith("tests.")):
            continue
        namespace = vars(module)
        for attr, (stock, ours) in _SUBSTITUTES.items():
            if namespace.get(attr) is stock:
                namespace[attr] = ours
                patched += 1
    return patched


def pytest_collection_modifyitems(session: Any, config: Any, items: list[Any]) -> None:
    patched = _substitute()
    config._bidkv_patched = patched


def pytest_runtest_setup(item: Any) -> None:
    # Modules imported lazily by a test (or its fixtures) are patched before it runs.
    _substitute()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    calls = sum(c.stats.calls for c in _built)
    abstentions = sum(c.stats.abstentions for c in _built)
    terminalreporter.write_line(
        f"bidkv peer plugin: {getattr(config, '_bidkv_patched', 0)} names substituted, "
        f"{len(_built)} adapter schedulers built, policy asked {calls} times "
        f"({abstentions} abstentions)"
    )
