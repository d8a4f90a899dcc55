"""The replay's step-time model: the documented formula, the cited preset, and model files
(JSON or TOML) validated with one-line errors naming the file and the bad key.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bidkv_ext.replay.steptime import PRESETS, StepTimeModelError, load_step_model


def test_formula_and_preset() -> None:
    model = load_step_model("llama-3.1-8b-h100")
    assert model is PRESETS["llama-3.1-8b-h100"]
    assert model.source
    expected = model.a + model.b * 100 + model.c * 3 + model.d * 900
    assert model.step_seconds(100, 3, 900) == pytest.approx(expected)


def test_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "m.toml"
    path.write_text('name = "mine"\na = 0.01\nb = 1e-5\nc = 0.0\nd = 0.0\n')
    model = load_step_model(str(path))
    assert (model.name, model.a, model.b) == ("mine", 0.01, 1e-5)


@pytest.mark.parametrize(
    ("text", "needle"),
    [('{"name": "x", "a": -1, "b": 0, "c": 0, "d": 0}', "a:"),
     ('{"name": "x", "a": 0, "b": 0, "c": 0, "d": 0, "e": 1}', "e:"),
     ("{broken", "not valid JSON")],
)
def test_bad_files(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "m.json"
    path.write_text(text)
    with pytest.raises(StepTimeModelError) as info:
        load_step_model(str(path))
    message = str(info.value)
    assert str(path) in message and needle in message and "\n" not in message
