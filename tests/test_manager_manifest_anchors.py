"""Manifest 0.2 patterns match the whole value: a trailing line break is no match.

Guards (manager-protocol.md §1.2, §1.3): Python's ``$`` also matches before a final
``\\n``, and the structural JSON Schema layer uses such patterns, so only the rules'
whole-value matching refuses ``"value\\n"``. Each identifier, module, object and
implementation reference with a trailing newline gets the protocol's own error text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hust_ext_manager.manifest import ManifestError, parse_manifest

ROOT = Path(__file__).resolve().parents[1]
BASE: dict[str, Any] = json.loads(
    (ROOT / "manifests" / "bidkv" / "vllm-hust-extension-v0.2.json").read_text()
)


def _changed(path: tuple[str | int, ...], value: str) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(json.dumps(BASE))
    target: Any = document
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    return document


@pytest.mark.parametrize(
    ("path", "error"),
    [
        (("extension_id",), "extension_id is invalid"),
        (("host", "provider"), "host.provider is invalid"),
        (("implementation", 0, "module"), "implementation[0].module is invalid"),
        (("implementation", 0, "object"), "implementation[0].object is invalid"),
        (("components", 0, "component_id"), "components[0].component_id is invalid"),
        (("components", 0, "implementation_ref"), "components[0].implementation_ref is invalid"),
    ],
)
def test_a_trailing_newline_is_refused_with_the_protocol_text(
    path: tuple[str | int, ...], error: str
) -> None:
    """``"<valid value>\\n"`` is refused with the field's own text, as any other value
    outside the pattern is (the implementation_ref case was a mutation-test gap)."""
    original: Any = BASE
    for part in path:
        original = original[part]
    parse_manifest(_changed(path, original))  # the value itself is valid
    with pytest.raises(ManifestError) as raised:
        parse_manifest(_changed(path, original + "\n"))
    assert str(raised.value) == error
