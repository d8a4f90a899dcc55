"""``python -m qualification rollback``: qualification.md §10 (README "Rollback").

There is no runtime toggle (the policy and its kill switch are read when the engine
starts), and qualification does not own the production engine, so restarting it and
uninstalling the distribution stay the operator's steps. The verb prints the whole plan;
when asked it runs the manager steps on the operator's own state (``--disable``;
``--forget`` disables first, as the manager refuses to forget an enabled bundle) and checks
the restarted engine's log for the fallback (``--verify-log``).
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from qualification.evidence import policy_init_lines
from qualification.manager import require_tool

__all__ = ["DISTRIBUTION", "Fallback", "manager_step", "plan", "verify_fallback"]

DISTRIBUTION = "vllm-hust-bidkv"


def plan(extension_id: str) -> list[str]:
    """The steps, in the order README "Rollback" gives them."""
    return [
        f"1. disable the bundle: vllm-hust-ext extension disable {extension_id}",
        "2. restart the engine without --preemption-policy and without the BIDKV_UTILITY_* "
        "variables (with the bundle disabled, `vllm-hust-ext run -- vllm serve ...` renders "
        "neither; on stock vLLM with the adapter also drop preemption_policy from "
        "--additional-config)",
        f"3. optional, drop its stored configuration: vllm-hust-ext extension forget "
        f"{extension_id}",
        f"4. uninstall: pip uninstall {DISTRIBUTION}",
        "5. verify the fallback: python -m qualification rollback --verify-log ENGINE_LOG "
        "(the restarted engine logs `Preemption policy initialized: policy=builtin "
        "enabled=False`, or no policy line at all)",
    ]


@dataclass(frozen=True, slots=True)
class Fallback:
    verified: bool
    detail: str


def verify_fallback(log_text: str) -> Fallback:
    """§10 step 4: every policy line says ``policy=builtin enabled=False``, or none is there."""
    lines = policy_init_lines(log_text)
    if not lines:
        return Fallback(True, "no 'Preemption policy initialized' line: the policy is absent")
    active = [f"policy={p} enabled={e}" for p, e in lines if e or p != "builtin"]
    if active:
        return Fallback(
            False, f"{len(active)} of {len(lines)} policy line(s) name a policy: {active[-1]}"
        )
    return Fallback(True, f"{len(lines)} policy line(s), all policy=builtin enabled=False")


def manager_step(manager: Sequence[str], verb: str, extension_id: str) -> tuple[bool, str]:
    """``vllm-hust-ext extension <verb> <id>`` on the caller's own manager state."""
    program = require_tool(manager, "the vLLM-HUST extension manager")
    proc = subprocess.run(
        [*program, "extension", verb, extension_id], capture_output=True, text=True, check=False
    )
    if proc.returncode == 0:
        return True, proc.stdout.strip() or f"{verb} {extension_id}"
    last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    return False, f"extension {verb} {extension_id} failed (exit {proc.returncode}): {last}"
