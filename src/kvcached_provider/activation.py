"""The bundle's in-engine activation: a vLLM general plugin.

kvcached itself is activated by its ``kvcached_autopatch.pth`` plus the bundle's
environment (``ENABLE_KVCACHED=true``, ``KVCACHED_AUTOPATCH=1``); this plugin adds only what
kvcached lacks: a responder that applies ``kvcached-provider limit`` requests inside the
engine process, where kvcached's revisioned control API must be called.

vLLM loads general plugins in each of its processes -- every installed one when
``VLLM_PLUGINS`` is unset, so also in engines that never enabled this bundle. While kvcached
is off (``ENABLE_KVCACHED`` not true/1, or ``KVCACHED_AUTOPATCH`` set to anything but
true/1, read as kvcached reads them) :func:`register` returns at once, having imported
nothing beyond this module. Otherwise, when the instance has an explicit, valid
``KVCACHED_IPC_NAME``, it claims that name for the process (:mod:`kvcached_provider.claim`:
a second launch under it is refused while this engine lives, even before kvcached has
created its control record) and starts one daemon thread per process. Only the process
holding registered kvcached pools (the EngineCore) ever claims a request. The plugin never
raises: a failure here must not stop the engine.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported lazily: the plugin must cost nothing while kvcached is off
    from kvcached_provider.limit import LimitResponder

__all__ = ["register"]

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_responder: LimitResponder | None = None


def _enabled(environ: Mapping[str, str]) -> bool:
    # Exactly kvcached's reading (no trimming): " true" switches kvcached off, so it must
    # not switch the responder on. Its import hook sets an unset KVCACHED_AUTOPATCH to 1
    # when ENABLE_KVCACHED is on; any other value leaves vLLM unpatched.
    on = {"true", "1"}
    return (environ.get("ENABLE_KVCACHED", "false").lower() in on
            and environ.get("KVCACHED_AUTOPATCH", "1").lower() in on)


def _claim(ipc: str) -> None:
    from kvcached_provider.claim import ClaimError, hold

    try:
        hold(ipc)
    except ClaimError as exc:  # the engine runs; only the launch check loses its evidence
        _log.warning("kvcached_provider: KVCACHED_IPC_NAME %r not claimed (%s); a second "
                     "launch under it is refused only once kvcached's control record "
                     "exists", ipc, exc)


def register() -> LimitResponder | None:
    """Entry point of the ``vllm.general_plugins`` plugin ``kvcached_provider``."""
    global _responder
    try:
        if not _enabled(os.environ):
            return None
        from kvcached_provider.checks import IPC_NAME_PATTERN
        from kvcached_provider.limit import LimitResponder

        ipc = os.environ.get("KVCACHED_IPC_NAME", "")
        if not IPC_NAME_PATTERN.fullmatch(ipc):
            _log.warning(
                "kvcached_provider: KVCACHED_IPC_NAME %r is missing or invalid; "
                "`kvcached-provider limit` cannot reach this instance", ipc)
            return None
        _claim(ipc)
        with _lock:
            if _responder is None:
                responder = LimitResponder(ipc)
                responder.start()
                _responder = responder  # kept once serving, so a failed start is retried
            return _responder
    except Exception as exc:  # a plugin failure must not prevent the engine from starting
        _log.warning("kvcached_provider: limit responder not started: %s", exc)
        return None
