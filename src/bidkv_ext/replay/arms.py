"""The policy arms of a replay: what each arm hands the host as its preemption policy.

Every arm runs on the identical trace, scheduler settings, KV budget and step-time model;
only the victim function differs (evaluation.md, ground rule).

Arm kinds
---------
``named``
    A strategy of our selector: the host loads ``BidkvPreemptionPolicy`` through
    ``from_vllm_config`` (as it would on a server) with ``additional_config["bidkv"]``
    carrying ``enabled=True, strategy=<name>, seed=<seed>`` over the user's own section, so
    the policy is ``BidkvPreemptionPolicy(BidKVConfig(enabled=True, strategy=<name>,
    seed=<seed>, ...))`` plus the engine's block size and prefix-caching facts. (An instance
    would not do: the host calls ``from_vllm_config`` on any object that has it.)
``host``
    ``--preemption-policy module.Object``: the spec string goes to the host, which loads it
    with the controller's ``from_spec(spec, vllm_config)`` (so ``from_vllm_config`` sees the
    ``--additional-config`` object and the ``BIDKV_UTILITY_*`` environment), exactly as
    ``vllm serve`` would.
``class``
    ``--policy-class module:Object``: any contract implementation, loaded by the same rules.
``peer``
    ``bidkv-0.2.1``: the published reference BidKV's decision rule, re-implemented here
    from its documented behaviour (reference-lessons.md sections 1 and 4; no code of it
    is used): U = computed / (1 + 0.5 c + 0.3 P + 1e-6), ties to the earliest arrival,
    with its liveness (2) and cascade (1.25) guards abstaining. For the installed package
    itself use ``--policy-class bidkv.adapters.vllm_hust.selector:BidkvPreemptionPolicy``.
``reference``
    The clairvoyant shortest-remaining oracle (O1 of evaluation.md section 3). It reads the
    trace's true output lengths, which no online policy has. It is a reference line, not a
    bound: a policy may beat it on some metric.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from bidkv_ext.contract import PreemptionCandidate, PreemptionContext

__all__ = [
    "CLAIRVOYANT",
    "Arm",
    "ArmError",
    "ClairvoyantShortestRemaining",
    "ReferenceBidkv021",
    "named_arm",
    "parse_arms",
]

CLAIRVOYANT = "clairvoyant"
"""Name of the reference arm in ``--policies``."""
REFERENCE_BIDKV = "bidkv-0.2.1"
"""Name of the reference BidKV rule's arm in ``--policies``."""

ArmKind = Literal["named", "host", "class", "peer", "reference"]
PolicyFactory = Callable[[Mapping[str, int]], object]
"""Builds the arm's policy spec; receives the true output length per request id."""


class ArmError(ValueError):
    """An arm that cannot be built (unknown name, unimportable class)."""


@dataclass(frozen=True, slots=True)
class Arm:
    """One policy arm. ``bidkv_overrides`` is merged into ``additional_config["bidkv"]``."""

    label: str
    kind: ArmKind
    factory: PolicyFactory
    bidkv_overrides: Mapping[str, object] | None = None

    @property
    def reference(self) -> bool:
        return self.kind == "reference"


class ClairvoyantShortestRemaining:
    """O1: evict the request with the most true remaining output (ties: least computed).

    ``true_output`` maps request id to the trace's output length. The Belady analogue:
    the victim is the request whose memory would stay occupied longest.
    """

    __slots__ = ("_true_output",)

    def __init__(self, true_output: Mapping[str, int]) -> None:
        self._true_output = true_output

    def select_victim(self, context: PreemptionContext) -> str | None:
        best_id: str | None = None
        best_key = (-1, 0)
        true_output = self._true_output
        for c in context.candidates:
            remaining = true_output.get(c.request_id, c.max_tokens) - c.num_output_tokens
            key = (remaining, -c.num_computed_tokens)
            if key > best_key:
                best_key = key
                best_id = c.request_id
        return best_id


class ReferenceBidkv021:
    """The reference BidKV 0.2.1 victim rule (see the module docstring), for comparison."""

    __slots__ = ("_offsets",)

    LIVENESS = 2
    CASCADE = 1.25

    def __init__(self) -> None:
        self._offsets: dict[str, int] = {}

    @staticmethod
    def _utility(c: PreemptionCandidate) -> float:
        cap = c.max_tokens if c.max_tokens > 0 else 1024
        progress = min(max(c.num_output_tokens / cap, 0.0), 1.0)
        delta = 1.0 + 0.5 * progress + 0.3 * max(c.num_preemptions, 0)
        return max(c.num_computed_tokens, 0) / max(delta + 1e-6, 1e-6)

    def select_victim(self, context: PreemptionContext) -> str | None:
        utility = self._utility
        top = min(context.candidates, key=lambda c: (-utility(c), c.arrival_time, c.request_id))
        relative = top.num_preemptions - self._offsets.get(top.request_id, 0)
        if relative >= self.LIVENESS:
            self._offsets[top.request_id] = top.num_preemptions
            return None
        for c in context.candidates:
            if c.request_id == context.requesting_request_id:
                if c is not top and (
                    max(c.num_computed_tokens, 0) * self.CASCADE
                    >= max(top.num_computed_tokens, 0)
                ):
                    return None
                break
        return top.request_id


def _strategy_names() -> frozenset[str]:
    from bidkv_ext.strategies import STRATEGY_NAMES

    return frozenset(STRATEGY_NAMES)


def _split_policies(text: str) -> list[str]:
    """Split ``--policies`` on commas outside ``{...}`` override blocks."""
    names: list[str] = []
    depth = 0
    current: list[str] = []
    for ch in text:
        if ch == "," and depth == 0:
            names.append("".join(current).strip())
            current = []
            continue
        depth += {"{": 1, "}": -1}.get(ch, 0)
        current.append(ch)
    names.append("".join(current).strip())
    return [n for n in names if n]


def _overrides(name: str) -> tuple[str, dict[str, object]]:
    """``bidkv{preempt_weight=2;use_host_facts=false}`` -> ("bidkv", {...})."""
    base, brace, rest = name.partition("{")
    if not brace:
        return name, {}
    if not rest.endswith("}"):
        raise ArmError(f"--policies: {name!r} must end with '}}'")
    values: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in rest[:-1].split(";"))):
        key, eq, raw = item.partition("=")
        if not eq or not key.strip():
            raise ArmError(f"--policies: {name!r}: expected key=value, got {item!r}")
        try:
            values[key.strip()] = json.loads(raw.strip())
        except json.JSONDecodeError:
            values[key.strip()] = raw.strip()
    return base.strip(), values


def named_arm(name: str, seed: int) -> Arm:
    """An arm for a ``--policies`` entry: a selector strategy or ``clairvoyant``.

    A strategy name may carry BidKV setting overrides for this arm alone, e.g.
    ``bidkv{use_host_facts=false;preempt_weight=2}`` (the label keeps the braces).
    """
    label = name
    name, extra = _overrides(name)
    if name == CLAIRVOYANT:
        return Arm(
            "clairvoyant (reference)",
            "reference",
            lambda lengths: ClairvoyantShortestRemaining(lengths),
        )
    if name == REFERENCE_BIDKV:
        return Arm(REFERENCE_BIDKV, "peer", lambda _lengths: ReferenceBidkv021())
    known = _strategy_names()
    if name not in known:
        accepted = ", ".join(sorted(known | {CLAIRVOYANT, REFERENCE_BIDKV}))
        raise ArmError(f"--policies: unknown policy {name!r}; accepted: {accepted}")

    def factory(_lengths: Mapping[str, int]) -> object:
        from bidkv_ext.selector import BidkvPreemptionPolicy

        return BidkvPreemptionPolicy

    overrides: dict[str, object] = {
        "enabled": True, "kill_switch": False, "strategy": name, "seed": seed,
    }
    if name != "bidkv":
        # Peers are the plain rules of evaluation.md: none of our guards.
        overrides["liveness_preemptions"] = 0
    overrides.update(extra)
    return Arm(label, "named", factory, overrides)


def _host_arm(spec: str) -> Arm:
    module, _, attr = spec.rpartition(".")
    if not module or not attr or ":" in spec:
        raise ArmError(f"--preemption-policy must be a dotted path 'module.Object', got {spec!r}")
    return Arm(spec, "host", lambda _lengths: spec)


def _class_arm(spec: str) -> Arm:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ArmError(f"--policy-class must look like 'module:Object', got {spec!r}")
    try:
        obj: object = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ArmError(f"--policy-class {spec!r} cannot be imported: {exc}") from None
    return Arm(spec, "class", lambda _lengths: obj)


def parse_arms(
    policies: str | None,
    *,
    preemption_policy: str | None,
    policy_classes: list[str],
    seed: int,
) -> tuple[Arm, ...]:
    """Arms in command-line order: ``--policies`` names, then host spec, then classes."""
    arms: list[Arm] = []
    if policies:
        arms.extend(named_arm(name, seed) for name in _split_policies(policies))
    if preemption_policy is not None:
        arms.append(_host_arm(preemption_policy))
    arms.extend(_class_arm(spec) for spec in policy_classes)
    labels = [a.label for a in arms]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise ArmError(f"policy arms given twice: {', '.join(duplicates)}")
    return tuple(arms)
