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
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from bidkv_ext.contract import PreemptionCandidate, PreemptionContext, PreemptionPolicy
from bidkv_ext.replay import jsontext

if TYPE_CHECKING:
    from bidkv_ext.config import BidKVConfig

__all__ = [
    "CLAIRVOYANT",
    "Arm",
    "ArmError",
    "ClairvoyantShortestRemaining",
    "ReferenceBidkv021",
    "arm_additional_config",
    "arm_config",
    "check_arms",
    "error_line",
    "first_validation_error",
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
        best_key = (0, 0)
        true_output = self._true_output
        for c in context.candidates:
            remaining = true_output.get(c.request_id, c.max_tokens) - c.num_output_tokens
            key = (remaining, -c.num_computed_tokens)
            # The argmax whatever its value: a request past its length is still a victim.
            if best_id is None or key > best_key:
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
            values[key.strip()] = jsontext.loads(raw.strip())
        except jsontext.JsonTextError as exc:
            if exc.syntax:  # not JSON: the value is a plain string, e.g. strategy=lcf
                values[key.strip()] = raw.strip()
            else:  # the entry itself is not shown: it may be thousands of characters
                raise ArmError(f"--policies: {base.strip()!r}: {key.strip()}: {exc}") from None
    return base.strip(), values


# BidKV settings an engine supplies itself, with the replay option that sets them.
_ENGINE_SETTINGS = {"block_size": "--block-size", "prefix_caching": "--[no-]prefix-caching",
                    "prefill_chunk_tokens": "--max-num-batched-tokens"}


def named_arm(name: str, seed: int) -> Arm:
    """An arm for a ``--policies`` entry: a selector strategy or ``clairvoyant``.

    A strategy name may carry BidKV setting overrides for this arm alone, e.g.
    ``bidkv{use_host_facts=false;preempt_weight=2}`` (the label keeps the braces).
    """
    label = name
    name, extra = _overrides(name)
    if extra and name in (CLAIRVOYANT, REFERENCE_BIDKV):
        # Not silently dropped: the user would believe the arm ran with them.
        raise ArmError(f"--policies {label!r}: {name} takes no settings; only the selector's "
                       "strategies do (e.g. bidkv{preempt_weight=2})")
    engine = sorted(extra.keys() & _ENGINE_SETTINGS.keys())
    if engine:
        # The engine's facts replace these in every arm (as on a real engine), so the arm
        # would run without them while its label says otherwise.
        flags = ", ".join(_ENGINE_SETTINGS[key] for key in engine)
        raise ArmError(f"--policies {label!r}: {', '.join(engine)} describes the engine, not "
                       f"one arm; set it for every arm with {flags}")
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
        # Peers are the plain rules of evaluation.md: none of our guards. (The selector
        # guards only bidkv; the 0 makes the report's recorded settings say so.)
        overrides["liveness_preemptions"] = 0
    overrides.update(extra)
    return Arm(label, "named", factory, overrides)


def _host_arm(spec: str) -> Arm:
    module, _, attr = spec.rpartition(".")
    if not module or not attr or ":" in spec:
        raise ArmError(f"--preemption-policy must be a dotted path 'module.Object', got {spec!r}")
    # Resolved here, as the host will (module, then one attribute), so a typo fails before
    # any arm runs; the host still loads the spec string itself.
    _policy_object("--preemption-policy", spec, module, [attr])
    return Arm(spec, "host", lambda _lengths: spec)


def _class_arm(spec: str) -> Arm:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ArmError(f"--policy-class must look like 'module:Object', got {spec!r}")
    obj = _policy_object("--policy-class", spec, module_name, attr.split("."))
    return Arm(spec, "class", lambda _lengths: obj)


def _policy_object(flag: str, spec: str, module_name: str, attrs: list[str]) -> object:
    """Import ``module_name``, walk ``attrs`` and check the result can become a policy."""
    try:
        obj: object = importlib.import_module(module_name)
        for part in attrs:
            obj = getattr(obj, part)
    except Exception as exc:
        # Any exception: importing the user's module runs its code, which may raise anything.
        raise ArmError(f"{flag} {spec!r} cannot be imported: {error_line(exc)}") from None
    problem = _not_a_policy(obj)
    if problem:
        raise ArmError(f"{flag} {spec!r}: {problem}")
    return obj


def _not_a_policy(obj: object) -> str:
    """Why the host's loader (``controller.load_policy``) would refuse ``obj``; "" if not.

    Mirrors its rules without calling anything: an instance with ``select_victim``, an
    object with ``from_vllm_config``, or a class with ``select_victim`` whose constructor
    takes no required argument.
    """
    if callable(getattr(obj, "from_vllm_config", None)):
        return ""
    if not isinstance(obj, type):
        if isinstance(obj, PreemptionPolicy):
            return ""
        name = getattr(obj, "__name__", None)
        what = f"{type(obj).__name__} {name}" if isinstance(name, str) else type(obj).__name__
        return (f"{what} is not a preemption policy (expected a class or instance with "
                "select_victim(context), or an object with from_vllm_config(vllm_config))")
    if not callable(getattr(obj, "select_victim", None)):
        return f"class {obj.__qualname__} has no select_victim(context) method"
    try:
        inspect.signature(obj).bind()
    except TypeError as exc:
        return f"class {obj.__qualname__} cannot be built without arguments ({exc})"
    except ValueError:
        pass  # no signature to read (a builtin): the host will find out
    return ""


def first_validation_error(exc: BaseException) -> tuple[str, str] | None:
    """``(where, message)`` of a pydantic ValidationError's first error (its own text spans
    several lines and ends in a documentation URL); None for any other exception."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return None
    try:
        first = errors(include_url=False)[0]
        return ".".join(str(part) for part in first.get("loc", ())), str(first["msg"])
    except (TypeError, IndexError, KeyError):
        return None


def error_line(exc: BaseException) -> str:
    """``Type: message`` on one line; of a pydantic ValidationError, its first error only."""
    first = first_validation_error(exc)
    if first is not None:
        where, message = first
        return f"{type(exc).__name__}: {where + ': ' if where else ''}{message}"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def arm_additional_config(arm: Arm, additional_config: Mapping[str, object]) -> dict[str, object]:
    """The ``additional_config`` the engine gives ``arm``: the arm's BidKV overrides merged
    over the user's ``"bidkv"`` section (``null`` counts as none, as BidKVConfig reads it;
    anything else but an object is refused, as it is for a ``--preemption-policy`` arm,
    rather than replaced and still recorded in the report as if it were used)."""
    from bidkv_ext.config import ADDITIONAL_CONFIG_KEY, ConfigError

    additional = dict(additional_config)
    section = additional.get(ADDITIONAL_CONFIG_KEY)
    if section is not None and not isinstance(section, Mapping):
        raise ConfigError(f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] must be a JSON object")
    if arm.bidkv_overrides is not None:
        merged = dict(section) if section is not None else {}
        merged.update(arm.bidkv_overrides)
        additional["bidkv"] = merged
    return additional


def arm_config(
    arm: Arm,
    additional_config: Mapping[str, object],
    *,
    environ: Mapping[str, str],
    block_size: int,
    prefix_caching: bool,
    prefill_chunk_tokens: int | None = None,
) -> BidKVConfig:
    """The BidKVConfig the selector builds for ``arm`` in the engine: the environment, the
    arm's ``additional_config`` (:func:`arm_additional_config`), then the engine's facts
    (block size, prefix caching and, given the engine's token budget, the prefill chunk),
    which win as in ``from_vllm_config``."""
    from bidkv_ext.config import BidKVConfig

    facts: dict[str, object] = {"block_size": block_size, "prefix_caching": prefix_caching}
    if prefill_chunk_tokens is not None:
        facts["prefill_chunk_tokens"] = prefill_chunk_tokens
    return BidKVConfig.from_sources(arm_additional_config(arm, additional_config), environ,
                                    **facts)


def check_arms(
    arms: Sequence[Arm],
    additional_config: Mapping[str, object],
    *,
    environ: Mapping[str, str],
    block_size: int,
    prefix_caching: bool,
) -> None:
    """Validate every arm's BidKV configuration as the engine will build it, before any arm
    runs: a bad third arm must not cost the first two their results.

    A ``--policies`` entry's own settings are checked alone first, so the message names the
    entry (``--policies 'bidkv{nope=1}': nope is not a BidKV setting; ...``); then the
    whole configuration (``BIDKV_UTILITY_*`` environment, ``--additional-config``), whose
    messages name the variable or key. Raises :class:`ArmError`.
    """
    from bidkv_ext.config import BidKVConfig, ConfigError
    from bidkv_ext.selector import BidkvPreemptionPolicy

    # What the selector's from_vllm_config adds from the engine; it wins over any setting.
    facts: dict[str, object] = {"block_size": block_size, "prefix_caching": prefix_caching}
    user_checked = False
    for arm in arms:
        if arm.bidkv_overrides is not None:
            try:
                BidKVConfig.from_sources(None, None, **{**arm.bidkv_overrides, **facts})
            except ConfigError as exc:
                raise ArmError(f"--policies {arm.label!r}: {exc}") from None
        elif not _builds_selector(arm, BidkvPreemptionPolicy):
            continue
        try:
            if not user_checked:
                # An arm's own settings replace the user's "bidkv" values for the same keys
                # before the engine reads them (arm_additional_config), so those values
                # are checked here, alone, or a malformed one would pass unseen.
                BidKVConfig.from_sources(additional_config, environ, **facts)
                user_checked = True
            arm_config(arm, additional_config, environ=environ, block_size=block_size,
                       prefix_caching=prefix_caching)
        except ConfigError as exc:
            raise ArmError(str(exc)) from None


def _builds_selector(arm: Arm, selector: type) -> bool:
    """Whether the host will build ``arm``'s policy with our selector's from_vllm_config."""
    if arm.kind == "host":
        module, _, attr = arm.label.rpartition(".")
        obj = getattr(importlib.import_module(module), attr)
    elif arm.kind == "class":
        obj = arm.factory({})
    else:
        return False
    return isinstance(obj, type) and issubclass(obj, selector)


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
