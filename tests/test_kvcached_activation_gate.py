"""The vLLM general plugin ``kvcached_provider`` is inert wherever kvcached is off.

vLLM loads every installed ``vllm.general_plugins`` entry point in each of its processes
when ``VLLM_PLUGINS`` is unset, so the plugin is imported and called in engines that never
enabled this bundle. Guarded: importing ``kvcached_provider.activation`` and calling
``register()`` with kvcached off imports neither the limit machinery nor the checks (no
pydantic models, YAML or packaging loaded on the engine's start-up path) and starts no
thread; ``register()`` follows kvcached's own switch (kvcached-notes §4): ``ENABLE_KVCACHED``
true/1, and ``KVCACHED_AUTOPATCH`` true/1 or unset (the import hook then sets it to 1) --
an explicit ``KVCACHED_AUTOPATCH=0`` leaves kvcached unpatched, so no responder is started.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcached_provider import activation
from kvcached_provider.limit import LimitResponder

_PROBE = (
    "import json, sys, threading\n"
    "import kvcached_provider.activation as a\n"
    "result = a.register()\n"
    "print(json.dumps({'result': result is None, 'threads': threading.active_count(),\n"
    "                  'loaded': sorted(m for m in ('kvcached_provider.limit',\n"
    "                      'kvcached_provider.checks', 'yaml', 'pydantic', 'platformdirs')\n"
    "                      if m in sys.modules)}))\n"
)


@pytest.mark.parametrize("setting", [None, "false", "0", " true", "yes"])
def test_disabled_plugin_costs_nothing(tmp_path: Path, setting: str | None) -> None:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KVCACHED_", "ENABLE_KVCACHED"))}
    env["KVCACHED_PROVIDER_STATE_DIR"] = str(tmp_path / "state")
    env["KVCACHED_IPC_NAME"] = "inst1"
    if setting is not None:
        env["ENABLE_KVCACHED"] = setting
    done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"result": True, "threads": 1, "loaded": []}
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize(("autopatch", "starts"), [
    (None, True),  # unset: kvcached's hook sets KVCACHED_AUTOPATCH=1 itself
    ("1", True), ("TRUE", True),
    ("0", False), ("false", False), (" 1", False),  # kvcached applies no patch
])
def test_responder_follows_kvcached_autopatch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autopatch: str | None, starts: bool
) -> None:
    monkeypatch.setattr(activation, "_responder", None)
    monkeypatch.setenv("KVCACHED_PROVIDER_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("KVCACHED_PROVIDER_SHM_DIR", str(tmp_path))
    monkeypatch.setenv("ENABLE_KVCACHED", "true")
    monkeypatch.setenv("KVCACHED_IPC_NAME", "inst1")
    if autopatch is None:
        monkeypatch.delenv("KVCACHED_AUTOPATCH", raising=False)
    else:
        monkeypatch.setenv("KVCACHED_AUTOPATCH", autopatch)
    responder = activation.register()
    try:
        assert (responder is not None) is starts
        if responder is not None:
            assert isinstance(responder, LimitResponder) and responder.ipc == "inst1"
    finally:
        if responder is not None:
            responder.stop()
