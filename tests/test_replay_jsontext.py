"""``bidkv_ext.replay.jsontext.loads`` tells json.loads' three refusals apart.

Guarded behaviours: malformed text is a ``JsonTextError`` with ``syntax`` true and its
line and column; over-deep nesting and an over-long integer are ``JsonTextError`` with
``syntax`` false and say which limit, without echoing the text; a hook's own error (not a
bare ValueError) passes through unchanged; valid text parses as json.loads does. And
``error_location`` joins a pydantic location with dots, shows a key that is not printable
with ``repr()`` and names the document itself when the location is empty.
"""

from __future__ import annotations

import sys

import pytest

from bidkv_ext.replay import jsontext


class HookRefused(Exception):
    pass


def test_valid_text_parses_as_json_loads_does() -> None:
    assert jsontext.loads('{"a": [1, 2.5, "x", null]}') == {"a": [1, 2.5, "x", None]}


def test_malformed_text_is_a_syntax_error_with_its_position() -> None:
    with pytest.raises(jsontext.JsonTextError) as caught:
        jsontext.loads('{"a":\n  [1,}')
    assert caught.value.syntax
    assert str(caught.value).startswith("not valid JSON (line 2, column 6: ")


def test_over_deep_nesting_is_a_limit_not_a_syntax_error() -> None:
    with pytest.raises(jsontext.JsonTextError) as caught:
        jsontext.loads("[" * 100_000 + "]" * 100_000)
    assert not caught.value.syntax
    assert str(caught.value) == "JSON nested too deeply"


def test_over_long_integer_names_the_limit_without_the_digits() -> None:
    with pytest.raises(jsontext.JsonTextError) as caught:
        jsontext.loads("[" + "7" * 5000 + "]")
    assert not caught.value.syntax
    assert str(caught.value) == (f"an integer has more than {sys.get_int_max_str_digits()} "
                                 "digits")


def test_hook_errors_pass_through() -> None:
    def refuse(_text: str) -> float:
        raise HookRefused("no floats")

    with pytest.raises(HookRefused):
        jsontext.loads("[1.5]", parse_float=refuse)

    def refuse_specific(_text: str) -> float:
        raise ZeroDivisionError("specific")  # an ArithmeticError, not a ValueError

    with pytest.raises(ZeroDivisionError):
        jsontext.loads("[1.5]", parse_float=refuse_specific)

    class Specific(ValueError):
        pass

    def refuse_value(_text: str) -> float:
        raise Specific("a ValueError subclass is the hook's own")

    with pytest.raises(Specific):
        jsontext.loads("[1.5]", parse_float=refuse_value)


def test_an_error_location_is_dotted_and_names_the_document_when_empty() -> None:
    """Mutants: another separator, and no name for an empty location (the error would
    then begin with nothing before its colon)."""
    assert jsontext.error_location(("arms", 0, "policy"), "the file") == "arms.0.policy"
    assert jsontext.error_location(("a\nb",), "the file") == "'a\\nb'"
    assert jsontext.error_location((), "the file") == "the file"
