"""The replay's step-time model: the documented formula, the cited preset, and model files
(JSON or TOML) validated with one-line errors naming the file and the bad key.

Also guarded: the preset's ``b`` and ``d`` follow from the hardware figures its docstring
cites; a ``.TOML`` suffix is TOML; every coefficient must be a finite number >= 0 (a JSON
number: not ``true`` or ``"0.5"``) and the name a non-empty string; a file's ``c``, ``d``
and ``source`` reach the model and ``as_dict``; ``check_step_bound`` accepts a longest step
exactly at the limit and refuses one above it or one that is not a number.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bidkv_ext.replay.steptime import (
    PRESETS,
    StepTimeModel,
    StepTimeModelError,
    check_step_bound,
    load_step_model,
)


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
     ('{"name": "x", "a": 0, "b": 0, "c": 0, "d": 0}', "a:"),  # a step takes time
     ('{"name": "x", "a": 0.001, "b": -1e-9, "c": 0, "d": 0}', "b:"),
     ('{"name": "x", "a": 0.001, "b": 0, "c": -1, "d": 0}', "c:"),
     ('{"name": "x", "a": 0.001, "b": 0, "c": 0, "d": -1}', "d:"),
     ('{"name": "x", "a": 0.001, "b": 0, "c": 0, "d": Infinity}', "d:"),
     ('{"name": "", "a": 0.001, "b": 0, "c": 0, "d": 0}', "name:"),
     ('{"name": "x", "a": 0.001, "b": 0, "c": 0, "d": 0, "e": 1}', "e:"),
     ('{"name": "x", "a": true, "b": 0, "c": 0, "d": 0}', "a:"),
     ('{"name": "x", "a": 0.001, "b": "0.5", "c": 0, "d": 0}', "b:"),
     ('{"name": 7, "a": 0.001, "b": 0, "c": 0, "d": 0}', "name:"),
     ("{broken", "not valid JSON")],
)
def test_bad_files(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "m.json"
    path.write_text(text)
    with pytest.raises(StepTimeModelError) as info:
        load_step_model(str(path))
    message = str(info.value)
    assert str(path) in message and needle in message and "\n" not in message


def test_preset_follows_its_cited_figures() -> None:
    """b: 2 x 8.03e9 FLOP per token at 50 % of 989 TFLOP/s; d: one token's K and V (32
    layers x 8 heads x 128 dims x 2 bytes x 2) read at 3.35 TB/s; a and c as measured."""
    model = PRESETS["llama-3.1-8b-h100"]
    assert model.b == pytest.approx(2 * 8.03e9 / (0.5 * 989e12), rel=0.01)
    assert model.d == pytest.approx(32 * 8 * 128 * 2 * 2 / 3.35e12, rel=0.01)
    assert model.a == pytest.approx(6.5e-3) and model.c == pytest.approx(0.28e-3)


def test_file_values_reach_the_model_and_its_record(tmp_path: Path) -> None:
    path = tmp_path / "m.TOML"
    path.write_text('name = "fit"\na = 0.004\nb = 2e-5\nc = 3e-4\nd = 5e-8\nsource = "lab"\n')
    model = load_step_model(str(path))
    assert (model.name, model.a, model.b, model.c, model.d, model.source) == (
        "fit", 0.004, 2e-5, 3e-4, 5e-8, "lab")
    assert model.as_dict() == {"name": "fit", "a": 0.004, "b": 2e-5, "c": 3e-4, "d": 5e-8,
                               "source": "lab"}
    assert model.step_seconds(10, 2, 100) == pytest.approx(0.004 + 2e-4 + 6e-4 + 5e-6)


def test_step_bound_accepts_the_limit_and_refuses_more_or_nan() -> None:
    counts = {"prefill_tokens": 100, "decode_requests": 10, "decode_context": 1000}
    at_limit = StepTimeModel("flat", 2.0, 0.0, 0.0, 0.0)
    check_step_bound(at_limit, "flat", 2.0, **counts)
    with pytest.raises(StepTimeModelError, match="step model flat: the longest step"):
        check_step_bound(at_limit, "flat", 1.999, **counts)
    broken = StepTimeModel("nan", math.nan, 0.0, 0.0, 0.0)
    with pytest.raises(StepTimeModelError, match="takes nan s"):
        check_step_bound(broken, "nan", 1e10, **counts)
