"""BidKVConfig built by keywords (the reference BidKV's Python API) and its documented bounds."""

from __future__ import annotations

import pytest

from bidkv_ext.config import BidKVConfig, ConfigError


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"enabled": True, "liveness_preemptions": -1},
         "liveness_preemptions=-1 is invalid: Input should be greater than or equal to 0"),
        ({"enabled": "maybe"},
         "enabled='maybe' is invalid: expected one of 1/0, true/false, yes/no, on/off"),
        ({"epsilon": float("nan")}, "epsilon=nan is invalid: Input should be a finite number"),
    ],
)
def test_keyword_construction_fails_with_one_line_naming_the_field(
    values: dict[str, object], expected: str
) -> None:
    """``BidKVConfig(enabled=True, liveness_preemptions=-1)`` (README's API) fails with the
    one-line ConfigError the module promises, naming the field, not pydantic's several
    lines ending in a documentation URL."""
    with pytest.raises(ConfigError) as caught:
        BidKVConfig(**values)  # type: ignore[arg-type]
    assert str(caught.value) == expected


def test_keyword_construction_names_an_unknown_field() -> None:
    """A misspelt keyword is refused in one line listing the accepted settings."""
    with pytest.raises(ConfigError) as caught:
        BidKVConfig(enable=True)  # type: ignore[call-arg]
    message = str(caught.value)
    assert message.startswith("enable is not a BidKV setting; accepted: base_cost, ")
    assert "\n" not in message


def test_sources_still_name_the_variable_not_the_field() -> None:
    """from_sources() keeps naming where a value came from (the variable), although it
    builds the config by keywords too."""
    with pytest.raises(ConfigError) as caught:
        BidKVConfig.from_sources(environ={"BIDKV_UTILITY_LIVENESS_PREEMPTIONS": "-1"})
    assert str(caught.value) == (
        "BIDKV_UTILITY_LIVENESS_PREEMPTIONS='-1' is invalid: "
        "Input should be greater than or equal to 0"
    )


@pytest.mark.parametrize("name", ["BASE_COST", "RECOMPUTE_WEIGHT", "SHRINK_PAGE_WEIGHT"])
def test_weights_are_bounded_at_the_documented_1e6(name: str) -> None:
    """README: the weights of delta are finite numbers from 0 to 1e6; 1e6 is accepted and
    anything above it fails start-up naming the variable."""
    variable = f"BIDKV_UTILITY_{name}"
    assert getattr(BidKVConfig.from_sources(environ={variable: "1e6"}), name.lower()) == 1e6
    with pytest.raises(ConfigError, match=f"^{variable}='1000000.5' is invalid: "):
        BidKVConfig.from_sources(environ={variable: "1000000.5"})
