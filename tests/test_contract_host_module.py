"""On a vLLM-HUST install the contract's names are the host module's own: a policy, the
controller's helpers and ``isinstance`` checks all see the host's types (contract spec §1).
A host module of another API major version or another field order is refused with one
warning naming the difference, and bidkv_ext never imports vLLM just to look for it.

The real ``vllm.v1.core.sched.preemption`` is in no installable vLLM, so each case runs a
fresh interpreter whose path puts a stand-in ``vllm`` package first. The stand-in is the
narrowest boundary: only the host module, written from the spec's §1-§3 (names, field
order, frozen and slotted types, the runtime-checkable protocol, API version "1.0")."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bidkv_ext import contract

_HOST = '''
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

PREEMPTION_POLICY_API_VERSION = {version!r}


@dataclass(frozen=True, slots=True)
class PreemptionCandidate:
    {candidate_fields}


@dataclass(frozen=True, slots=True)
class PreemptionContext:
    candidates: tuple
    scheduling_policy: Literal["fcfs", "priority"]
    requesting_request_id: str
    kv_cache_usage: float
    now: float
    builtin_victim_id: str | None = None


@runtime_checkable
class PreemptionPolicy(Protocol):
    def select_victim(self, context: PreemptionContext) -> str | None: ...


@dataclass(slots=True)
class PreemptionPolicyStats:
    policy_name: str = "builtin"
    enabled: bool = False
    calls: int = 0
    selections: int = 0
    abstentions: int = 0
    failures: int = 0
    invalid_selections: int = 0


class PreemptionPolicyController:
    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
'''

_FIELDS = ["request_id: str", "priority: int", "arrival_time: float",
           "num_prompt_tokens: int", "num_output_tokens: int", "num_computed_tokens: int",
           "num_preemptions: int", "max_tokens: int"]


def _host_tree(root: Path, *, version: str = "1.0", fields: list[str] = _FIELDS) -> Path:
    sched = root / "vllm" / "v1" / "core" / "sched"
    sched.mkdir(parents=True)
    for package in (root / "vllm", root / "vllm" / "v1", root / "vllm" / "v1" / "core", sched):
        (package / "__init__.py").write_text("")
    body = _HOST.format(version=version, candidate_fields="\n    ".join(fields))
    (sched / "preemption.py").write_text(body)
    return root


def _run(root: Path, script: str) -> subprocess.CompletedProcess[str]:
    # The stand-in host first; an inherited PYTHONPATH after it (a mutation run points it
    # at a copy of the sources, which the child must import too).
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "BIDKV_UTILITY_ENABLE": "1"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_host_module_types_are_the_contract(tmp_path: Path) -> None:
    done = _run(_host_tree(tmp_path), """
        import vllm  # the engine process has vLLM loaded before it loads a policy
        import vllm.v1.core.sched.preemption as host
        from bidkv_ext import contract, controller
        from bidkv_ext.selector import BidkvPreemptionPolicy

        for name in ("PreemptionCandidate", "PreemptionContext", "PreemptionPolicy",
                     "PreemptionPolicyStats", "PreemptionPolicyController"):
            assert getattr(contract, name) is getattr(host, name), name
        assert controller.PreemptionContext is host.PreemptionContext
        small = host.PreemptionCandidate("small", 0, 1.0, 100, 5, 105, 0, 4096)
        large = host.PreemptionCandidate("large", 0, 2.0, 900, 5, 905, 0, 4096)
        context = host.PreemptionContext((small, large), "fcfs", "large", 0.97, 3.0, "large")
        policy = BidkvPreemptionPolicy()
        assert isinstance(policy, host.PreemptionPolicy)
        assert controller.builtin_victim_id(context) == "large"
        print("victim", policy.select_victim(context))
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["victim", "small"]
    assert "not used as the preemption contract" not in done.stderr


@pytest.mark.parametrize(
    ("version", "fields", "named"),
    [
        ("2.0", _FIELDS, "API version is '2.0', expected 1.x"),
        ("one", _FIELDS, "API version 'one' is not a version"),
        ("1.0", [_FIELDS[1], _FIELDS[0], *_FIELDS[2:]], "PreemptionCandidate fields are"),
    ],
)
def test_an_incompatible_host_module_is_refused_with_one_warning(
    tmp_path: Path, version: str, fields: list[str], named: str
) -> None:
    done = _run(_host_tree(tmp_path, version=version, fields=fields), """
        import vllm
        import vllm.v1.core.sched.preemption as host
        from bidkv_ext import contract
        assert contract.PreemptionCandidate is not host.PreemptionCandidate
        assert contract.PreemptionCandidate.__module__ == "bidkv_ext.contract"
        assert contract.PreemptionPolicyController.__module__ == "bidkv_ext.controller"
    """)
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if "preemption contract" in line]
    assert len(warnings) == 1, done.stderr
    assert named in warnings[0]


def test_vllm_is_not_imported_to_look_for_the_host_module(tmp_path: Path) -> None:
    """Importing vLLM costs seconds; tools that import bidkv_ext without it stay light."""
    done = _run(_host_tree(tmp_path), """
        import sys
        from bidkv_ext import contract
        import bidkv_ext.selector
        assert "vllm" not in sys.modules
        assert contract.PreemptionCandidate.__module__ == "bidkv_ext.contract"
    """)
    assert done.returncode == 0, done.stderr


def test_stock_vllm_keeps_the_local_definitions() -> None:
    """vLLM 0.33.0 (installed here) has no host module: the local types are the contract."""
    assert contract.PreemptionCandidate.__module__ == "bidkv_ext.contract"
    assert contract.PreemptionPolicyController.__module__ == "bidkv_ext.controller"
