"""README's configuration table and manifest sentence agree with the code.

Guarded behaviour: every ``BIDKV_UTILITY_*`` variable README.md's table lists with a default
is a setting of :class:`BidKVConfig` whose default is the one shown (booleans as ``0``/``1``);
the strategy names the table lists are exactly the accepted ones; the weights it names are
settings; and the four variables README says the bundle's manifest sets are the manifest's,
with the values shown. So the table a user configures from cannot drift from the code.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from bidkv_ext.config import ENV_PREFIX, BidKVConfig
from bidkv_ext.strategies import STRATEGY_NAMES

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
_ROW = re.compile(r"^\| (`BIDKV_UTILITY_[^|]*) \| ([^|]*) \| ([^|]*) \|$", re.MULTILINE)
_CODE = re.compile(r"`([^`]+)`")


def _rows() -> list[tuple[list[str], list[str], str]]:
    """(variables, defaults, meaning) per row of the configuration table."""
    rows = [(_CODE.findall(names), _CODE.findall(defaults), meaning)
            for names, defaults, meaning in _ROW.findall(README)]
    assert rows, "README.md lost its BIDKV_UTILITY_* table"
    return rows


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _field(variable: str) -> str:
    known = {BidKVConfig.env_name(name): name for name in BidKVConfig.model_fields}
    assert variable in known, f"README names {variable}, which is not a BidKV setting"
    return known[variable]


def test_table_defaults_are_the_code_defaults() -> None:
    checked = 0
    for variables, defaults, _ in _rows():
        if variables == [f"{ENV_PREFIX}*"]:  # the weights row points to docs/policy.md
            continue
        assert len(variables) == len(defaults), variables
        for variable, default in zip(variables, defaults, strict=True):
            field = BidKVConfig.model_fields[_field(variable)]
            assert _shown(field.default) == default, f"{variable}: README {default}"
            checked += 1
    assert checked >= 10


def test_table_strategies_are_the_accepted_ones() -> None:
    meaning = next(m for v, _, m in _rows() if v == [f"{ENV_PREFIX}STRATEGY"])
    assert set(_CODE.findall(meaning)) == set(STRATEGY_NAMES)


def test_table_weights_are_settings() -> None:
    meaning = next(m for v, _, m in _rows() if v == [f"{ENV_PREFIX}*"])
    names = [n for n in _CODE.findall(meaning) if n.isupper()]
    assert names
    for name in names:
        _field(ENV_PREFIX + name)


def test_manifest_sets_the_four_variables_readme_names() -> None:
    sentence = re.search(r"manifest sets four of the variables\s*\(([^)]*)\)", README)
    assert sentence is not None
    shown = {}
    for item in _CODE.findall(sentence.group(1)):
        name, value = item.split("=")
        shown[name if name.startswith(ENV_PREFIX) else ENV_PREFIX + name.lstrip("_")] = value
    manifest = json.loads(
        (REPO / "manifests" / "bidkv" / "vllm-hust-extension-v0.2.json").read_text("utf-8")
    )
    assert manifest["activation"]["environment"] == shown
