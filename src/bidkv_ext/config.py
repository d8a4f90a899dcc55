"""BidKV configuration: one validated, frozen model read from env and ``additional_config``.

Precedence: defaults < ``BIDKV_UTILITY_*`` environment variables < the reference BidKV's
top-level keys (``enable_utility_victim_selection``, ``utility_*``; see ``REFERENCE_KEYS``)
< keys of the object ``additional_config["bidkv"]`` (the plain dict vLLM gets from
``--additional-config``). Other ``additional_config`` keys belong to other components
(``preemption_policy``, ``_manager_runtime_qualification``, ...) and are ignored.

Every invalid value fails at construction with one line that names the variable (or the
``additional_config`` key) and what is accepted: :class:`ConfigError`, a ``ValueError``, so
the host's loader lets it propagate and engine start-up fails with that message.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

__all__ = ["ENV_PREFIX", "MAX_WEIGHT", "RESEARCH_STRATEGY_ENV", "BidKVConfig", "ConfigError"]

ENV_PREFIX = "BIDKV_UTILITY_"
# The reference's research hooks chose their rule from this variable; with the utility
# policy enabled the reference refused it, and so does this package.
RESEARCH_STRATEGY_ENV = "BIDKV_STRATEGY"
ADDITIONAL_CONFIG_KEY = "bidkv"

# The reference BidKV read its settings from top-level additional_config keys; a user
# carrying them over must not get an inert policy without a word. Keys with a counterpart
# here are read as that field (under the section above, which wins); the reference's
# gating and snapshot knobs have none and are refused, as their BIDKV_UTILITY_* twins are.
REFERENCE_KEYS = {
    "enable_utility_victim_selection": "enabled",
    "utility_kill_switch": "kill_switch",
    "utility_strategy": "strategy",
    "utility_completion_weight": "completion_weight",
    "utility_preempt_weight": "preempt_weight",
    "utility_liveness_preemptions": "liveness_preemptions",
    "utility_cascade_gain_ratio": "cascade_gain_ratio",
    "utility_epsilon": "epsilon",
    "utility_default_max_tokens": "default_max_tokens",
}
_REFERENCE_PREFIX = "utility_"

# Strict booleans: what an operator plausibly writes, nothing else ("2" or "maybe" fail).
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


class ConfigError(ValueError):
    """A configuration value is invalid; the message is one line naming its source."""

    # Set when BidKVConfig(...) itself refused a keyword: pydantic's error, kept so that
    # BidKVConfig.validated can name the value's source instead of the field.
    validation: ValidationError | None = None


NonNegInt = Annotated[int, Field(ge=0)]
# Finite and bounded: the terms of delta multiply, and an infinite or huge weight would
# turn every utility into 0 (or NaN) at the first decision instead of failing start-up.
MAX_WEIGHT = 1e6
Weight = Annotated[float, Field(ge=0.0, le=MAX_WEIGHT, allow_inf_nan=False)]
Positive = Annotated[float, Field(gt=0.0, le=MAX_WEIGHT, allow_inf_nan=False)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]


class BidKVConfig(BaseModel):
    """The policy's settings. ``BidKVConfig(enabled=True).is_active`` is what a host checks."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)

    enabled: bool = False
    kill_switch: bool = False
    strategy: str = "bidkv"
    seed: int = 0
    liveness_preemptions: NonNegInt = 8
    cascade_gain_ratio: Annotated[Weight, Field(ge=1.0)] = 1.25
    epsilon: Positive = 1e-3
    default_max_tokens: Annotated[int, Field(gt=0)] = 1024
    # Terms of the disruption estimate delta (see docs/policy.md).
    base_cost: Weight = 64.0
    recompute_weight: Weight = 1.0
    completion_weight: Weight = 1.0
    completion_horizon: Positive = 32.0
    preempt_weight: Weight = 0.0
    first_token_weight: Weight = 0.0
    cache_survival: Fraction = 0.0
    use_host_facts: bool = True
    # While elastic KV (kvcached) shrinks: U x (1 + shrink_page_weight x pages released).
    shrink_page_weight: Weight = 1.0
    block_size: Annotated[int, Field(gt=0)] = 16
    prefix_caching: bool = True
    # The most prompt tokens one step prefills for a request (a prefilling requester's
    # need without host facts); on a vLLM engine its scheduler's token budget.
    prefill_chunk_tokens: Annotated[int, Field(gt=0)] = 2048

    if not TYPE_CHECKING:  # type checkers keep pydantic's signature (one typed keyword per field)

        def __init__(self, **values: Any) -> None:
            # Keyword construction (the reference BidKV's API, BidKVConfig(enabled=True))
            # fails like every other source: one line naming the setting, not pydantic's
            # several lines and documentation URL. from_sources() goes through validated(),
            # which names the variable or key each value came from instead.
            try:
                super().__init__(**values)
            except ValidationError as exc:
                error = ConfigError(_one_line(exc, values, {}))
                error.validation = exc
                raise error from None

    @field_validator("enabled", "kill_switch", "use_host_facts", "prefix_caching", mode="before")
    @classmethod
    def _strict_bool(cls, value: object) -> object:
        if isinstance(value, str):
            lowered = value.strip().lower()
            if lowered in _TRUE:
                return True
            if lowered in _FALSE:
                return False
            raise ValueError("expected one of 1/0, true/false, yes/no, on/off")
        if isinstance(value, bool):
            return value
        raise ValueError("expected a boolean")

    @field_validator("*", mode="before")
    @classmethod
    def _not_a_bool(cls, value: object, info: ValidationInfo) -> object:
        # pydantic's lax mode reads JSON true/false as 1/0; a boolean given for a number is
        # a mistake (a flag written in the wrong key), so it fails instead of running.
        # Keyed on the annotation, so a numeric field added later is covered without a list.
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, bool) and field is not None and _is_numeric(field.annotation):
            raise ValueError("expected a number, not a boolean")
        return value

    @field_validator("strategy", mode="after")
    @classmethod
    def _known_strategy(cls, value: str) -> str:
        from bidkv_ext.strategies import STRATEGY_NAMES

        if value not in STRATEGY_NAMES:
            raise ValueError(f"unknown strategy; accepted: {', '.join(sorted(STRATEGY_NAMES))}")
        return value

    @property
    def is_active(self) -> bool:
        """True when the policy may choose victims: enabled and the kill switch is off."""
        return self.enabled and not self.kill_switch

    @classmethod
    def env_name(cls, field: str) -> str:
        # BIDKV_UTILITY_ENABLE is the reference's spelling; keep it.
        return ENV_PREFIX + ("ENABLE" if field == "enabled" else field.upper())

    @classmethod
    def from_sources(
        cls,
        additional_config: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> BidKVConfig:
        """Build from the environment, then the reference BidKV's top-level
        ``additional_config`` keys, then ``additional_config["bidkv"]``, then overrides.

        A later source replaces an earlier one's value, but every value given must be
        well-formed: a malformed one fails with :class:`ConfigError` naming its source even
        where a later source replaces it."""
        values: dict[str, Any] = {}
        origin: dict[str, str] = {}
        # Values a later source replaced. Precedence picks among well-formed values; a
        # malformed one is still the operator's mistake and must not pass unseen.
        shadowed: list[tuple[str, Any, str]] = []

        def put(name: str, value: Any, where: str) -> None:
            if name in values:
                shadowed.append((name, values[name], origin[name]))
            values[name], origin[name] = value, where

        if environ is not None:
            known = {cls.env_name(name): name for name in cls.model_fields}
            for env, raw in environ.items():
                if not env.startswith(ENV_PREFIX):
                    continue
                if env not in known:
                    # A typo must not silently leave a default in force.
                    accepted = ", ".join(sorted(known))
                    # repr() only for a name with a line break or other unprintable text.
                    shown = env if env.isprintable() else repr(env)
                    raise ConfigError(f"{shown} is not a BidKV setting; accepted: {accepted}")
                put(known[env], raw, env)
        _reference_keys(additional_config or {}, put)
        section = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
        if section is not None:
            if not isinstance(section, Mapping):
                raise ConfigError(
                    f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] must be a JSON object"
                )
            for key, value in section.items():
                if not isinstance(key, str):
                    accepted = ", ".join(sorted(cls.model_fields))
                    raise ConfigError(
                        f"additional_config[{ADDITIONAL_CONFIG_KEY!r}][{key!r}] is not a BidKV "
                        f"setting (keys are setting names); accepted: {accepted}"
                    )
                put(key, value, f"additional_config[{ADDITIONAL_CONFIG_KEY!r}][{key!r}]")
        for key, value in overrides.items():  # engine facts and callers' arguments
            put(key, value, key)
        for name, value, where in shadowed:
            cls.validated({name: value}, {name: where})
        config = cls.validated(values, origin)
        if config.enabled and environ is not None and RESEARCH_STRATEGY_ENV in environ:
            # The reference refused this pair too: its research hook's strategy variable
            # would otherwise be ignored and the policy run another rule without a word.
            raise ConfigError(
                f"{RESEARCH_STRATEGY_ENV} is the reference BidKV's research-hook variable and "
                f"is not read with the policy enabled; set {cls.env_name('strategy')} instead"
            )
        return config

    @classmethod
    def validated(cls, values: Mapping[str, Any], origin: Mapping[str, str]) -> BidKVConfig:
        try:
            return cls(**values)
        except ConfigError as exc:
            if exc.validation is None:
                raise
            # Named again by the source (variable or additional_config key) of the value.
            raise ConfigError(_one_line(exc.validation, values, origin)) from None


def _is_numeric(annotation: object) -> bool:
    # model_fields keeps an Annotated field's base type (constraints go to its metadata).
    return annotation in (int, float)


def _reference_keys(
    additional_config: Mapping[str, Any], put: Callable[[str, Any, str], None]
) -> None:
    for key, value in additional_config.items():
        field = REFERENCE_KEYS.get(key)
        if field is None:
            if isinstance(key, str) and key.startswith(_REFERENCE_PREFIX):
                accepted = ", ".join(sorted(REFERENCE_KEYS))
                raise ConfigError(
                    f"additional_config[{key!r}] is a reference BidKV setting this policy does "
                    f"not have; accepted reference keys: {accepted}"
                )
            continue
        put(field, value, f"additional_config[{key!r}]")


def _one_line(exc: ValidationError, values: Mapping[str, Any], origin: Mapping[str, str]) -> str:
    error = exc.errors(include_url=False)[0]
    field = str(error["loc"][0]) if error["loc"] else "config"
    source = origin.get(field, field)
    if error["type"] == "extra_forbidden":
        accepted = ", ".join(sorted(BidKVConfig.model_fields))
        return f"{source} is not a BidKV setting; accepted: {accepted}"
    message = str(error["msg"]).removeprefix("Value error, ")
    return f"{source}={_shown(values.get(field))} is invalid: {message}"


def _shown(value: object) -> str:
    """``repr(value)``; an integer too long for repr() (Python's int-digits limit, a
    ValueError of its own that would replace this message) is described instead."""
    try:
        return repr(value)
    except ValueError:
        limit = sys.get_int_max_str_digits()
        if isinstance(value, int):
            return f"<an integer of more than {limit} digits>"
        return f"<a value holding an integer of more than {limit} digits>"
