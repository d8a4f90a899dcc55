"""kvcached's pass-through tuning variables are checked before a launch.

kvcached 0.1.6 reads ``KVCACHED_PAGE_SIZE_MB``, ``KVCACHED_GPU_UTILIZATION``, the reserved-page
bounds, ``KVCACHED_PAGE_PREALLOC_ENABLED``, ``KVCACHED_MAX_CACHED_TOKENS``,
``KVCACHED_MAX_CACHED_BLOCKS``, ``KVCACHED_CONTIGUOUS_LAYOUT``, ``KVCACHED_IPC_TIMEOUT``,
``KVCACHED_SANITY_CHECK``, ``KVCACHED_LOG_LEVEL`` and ``KVCACHED_LOG_COLOR`` from the engine's
environment, which ``vllm-hust-ext run`` inherits from its own. Guarded: a value
kvcached would fail on inside the engine (``int()``/``float()`` raising on import, a page size
that is not a positive multiple of 2 MB) or would misread without a word (its Python
``int()``/``float()`` and its C++ allocator's ``atoi``/``atof`` disagreeing, a negative
reserved-page bound compared as unsigned, a minimum above the maximum, a flag word other than
true/false read as off, a NaN timeout, a log level its Python logger and its C++ allocator
read differently) gives one failing line naming the variable, the value
and the accepted form; merely odd values pass; unset variables give no line; ``check()`` reads
them from this process's environment under the planned activation environment, so the real
``vllm-hust-ext extension status`` reports them and ``vllm-hust-ext run`` refuses (exit 2).

The accepted forms are checked against the C library's own ``atoi``/``atof`` (through
ctypes), which kvcached's compiled page allocator calls.
"""

from __future__ import annotations

import ctypes
import json
import logging
import math
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvcached_provider import checks
from tests.test_kvcached_activation import (  # the real manager on a faked GPU host
    KV,
    base_env,
    gpu_host,
    manager,
    needs_manager,
)
from tests.test_kvcached_checks import MANIFEST

__all__ = ["base_env", "gpu_host"]  # fixtures, used by name

PROPERTY = settings(derandomize=True, database=None, deadline=None, max_examples=400)
LIBC = ctypes.CDLL(None)
LIBC.atoi.argtypes = [ctypes.c_char_p]
LIBC.atoi.restype = ctypes.c_int
LIBC.atof.argtypes = [ctypes.c_char_p]
LIBC.atof.restype = ctypes.c_double
FIX = "in the environment `vllm-hust-ext run` is started from"


def tuning(variable: str, value: str) -> list[tuple[bool, str]]:
    return checks.check_tuning_environment({variable: value})


def refused(variable: str, value: str) -> bool:
    return any(not ok for ok, _ in tuning(variable, value))


# ------------------------------------------------------------------ accepted and refused


@pytest.mark.parametrize(("variable", "value"), [
    ("KVCACHED_PAGE_SIZE_MB", "2"),
    ("KVCACHED_PAGE_SIZE_MB", "4096"),  # odd but valid: kvcached takes it
    ("KVCACHED_PAGE_SIZE_MB", " +8 "),  # int() trims and takes the sign
    ("KVCACHED_GPU_UTILIZATION", "0.9"),
    ("KVCACHED_GPU_UTILIZATION", "1"),
    ("KVCACHED_GPU_UTILIZATION", "0"),
    ("KVCACHED_GPU_UTILIZATION", "9e-1"),
    ("KVCACHED_MIN_RESERVED_PAGES", "0"),
    ("KVCACHED_MAX_RESERVED_PAGES", "64"),
    ("KVCACHED_PAGE_PREALLOC_ENABLED", "TRUE"),
    ("KVCACHED_PAGE_PREALLOC_ENABLED", "false"),
    ("KVCACHED_PAGE_PREALLOC_ENABLED", "0"),  # read as off, as meant
    ("KVCACHED_MAX_CACHED_TOKENS", "-1"),
    ("KVCACHED_MAX_CACHED_TOKENS", "0"),
    ("KVCACHED_MAX_CACHED_TOKENS", "1_000_000"),  # only Python's int() reads it
    ("KVCACHED_MAX_CACHED_BLOCKS", "-5"),
    ("KVCACHED_CONTIGUOUS_LAYOUT", "False"),
    ("KVCACHED_SANITY_CHECK", "true"),
    ("KVCACHED_LOG_COLOR", "false"),
    ("KVCACHED_LOG_LEVEL", "DEBUG"),
    ("KVCACHED_LOG_LEVEL", "Warning"),  # both readers take it: .upper() and the letter W
    ("KVCACHED_LOG_LEVEL", "VERBOSE"),  # the allocator's finest; Python logs at INFO
    ("KVCACHED_LOG_LEVEL", "critical"),  # Python CRITICAL; the allocator's 'c' is FATAL
    ("KVCACHED_IPC_TIMEOUT", "2.5"),
    ("KVCACHED_IPC_TIMEOUT", "0"),  # no timeout
    ("KVCACHED_IPC_TIMEOUT", "inf"),
])
def test_values_kvcached_reads_as_written_pass(variable: str, value: str) -> None:
    assert tuning(variable, value) == [
        (True, f"kvcached will read these tuning variables: {variable}={value!r}")]


@pytest.mark.parametrize(("variable", "value", "expected", "why"), [
    ("KVCACHED_PAGE_SIZE_MB", "3", "a positive even integer", "would raise ValueError"),
    ("KVCACHED_PAGE_SIZE_MB", "0", "a positive even integer", "would raise ValueError"),
    ("KVCACHED_PAGE_SIZE_MB", "2MB", "a positive even integer", "would raise ValueError"),
    ("KVCACHED_PAGE_SIZE_MB", "", "a positive even integer", "would raise ValueError"),
    ("KVCACHED_GPU_UTILIZATION", "95%", "a decimal fraction from 0 to 1",
     "would raise ValueError"),
    ("KVCACHED_GPU_UTILIZATION", "1.2", "a decimal fraction from 0 to 1",
     "outside 0..1 it is left no usable memory"),
    ("KVCACHED_GPU_UTILIZATION", "nan", "a decimal fraction from 0 to 1",
     "outside 0..1 it is left no usable memory"),
    ("KVCACHED_GPU_UTILIZATION", "0.9_5", "a decimal fraction from 0 to 1",
     "Python code would read 0.95 but its C++ page allocator (atof) 0.9"),
    ("KVCACHED_MIN_RESERVED_PAGES", "1_0", "a whole number of pages >= 0",
     "Python code would read 10 but its C++ page allocator (atoi) 1"),
    ("KVCACHED_MAX_RESERVED_PAGES", "4294967306", "a whole number of pages >= 0",
     "Python code would read 4294967306 but its C++ page allocator (atoi) 10"),
    ("KVCACHED_MAX_RESERVED_PAGES", "-1", "a whole number of pages >= 0",
     "compares the bound with unsigned page counts"),
    ("KVCACHED_MIN_RESERVED_PAGES", "5.0", "a whole number of pages >= 0",
     "would raise ValueError"),
    ("KVCACHED_PAGE_PREALLOC_ENABLED", "1", "'true' or 'false'", "would silently be off"),
    ("KVCACHED_PAGE_PREALLOC_ENABLED", "yes", "'true' or 'false'", "would silently be off"),
    ("KVCACHED_PAGE_PREALLOC_ENABLED", " true", "'true' or 'false'", "would silently be off"),
    ("KVCACHED_CONTIGUOUS_LAYOUT", "", "'true' or 'false'", "would silently be off"),
    ("KVCACHED_CONTIGUOUS_LAYOUT", "contiguous", "'true' or 'false'", "would silently be off"),
    ("KVCACHED_MAX_CACHED_TOKENS", "16k", "an integer (-1 for no bound, 0 to turn prefix",
     "would raise ValueError"),
    ("KVCACHED_MAX_CACHED_BLOCKS", "1e3", "an integer", "would raise ValueError"),
    ("KVCACHED_IPC_TIMEOUT", "60s", "a number of seconds", "would raise ValueError"),
    ("KVCACHED_IPC_TIMEOUT", "NaN", "a number of seconds", "times every exchange"),
    ("KVCACHED_SANITY_CHECK", "1", "'true' or 'false'", "would silently be off"),
    ("KVCACHED_LOG_COLOR", "on", "'true' or 'false'", "would silently be off"),
    ("KVCACHED_LOG_LEVEL", "debug", "DEBUG, INFO, WARNING, ERROR or CRITICAL",
     "Python code would log at DEBUG but its C++ page allocator, which reads only the first "
     "letter in upper case, at FATAL"),
    ("KVCACHED_LOG_LEVEL", "NOTSET", "DEBUG, INFO, WARNING, ERROR or CRITICAL",
     "Python code would log at NOTSET but its C++ page allocator"),
    ("KVCACHED_LOG_LEVEL", "TRACE", "DEBUG, INFO, WARNING, ERROR or CRITICAL",
     "knows only logging's level names"),
    ("KVCACHED_LOG_LEVEL", " INFO", "DEBUG, INFO, WARNING, ERROR or CRITICAL",
     "knows only logging's level names"),
    ("KVCACHED_LOG_LEVEL", "BASIC_FORMAT", "DEBUG, INFO, WARNING, ERROR or CRITICAL",
     "fail at start-up on a logging attribute that is no level"),
])
def test_values_kvcached_fails_on_or_misreads_are_one_line(
    variable: str, value: str, expected: str, why: str
) -> None:
    [(ok, line)] = tuning(variable, value)
    assert not ok
    assert line.startswith(f"{variable}={value!r} is invalid: expected {expected}")
    assert why in line
    assert line.endswith(FIX) and "\n" not in line


def test_unset_variables_give_no_line() -> None:
    assert checks.check_tuning_environment({}) == []
    assert checks.check_tuning_environment({"KVCACHED_IPC_NAME": "x", "PATH": "/bin"}) == []


def test_one_ok_line_lists_every_accepted_variable_beside_the_refused() -> None:
    lines = checks.check_tuning_environment({
        "KVCACHED_IPC_TIMEOUT": "30", "KVCACHED_PAGE_SIZE_MB": "7",
        "KVCACHED_CONTIGUOUS_LAYOUT": "true"})
    assert [ok for ok, _ in lines] == [False, True]
    assert lines[0][1].startswith("KVCACHED_PAGE_SIZE_MB='7' is invalid")
    assert lines[1][1] == ("kvcached will read these tuning variables: "
                           "KVCACHED_CONTIGUOUS_LAYOUT='true', KVCACHED_IPC_TIMEOUT='30'")


@pytest.mark.parametrize(("environment", "shown"), [
    ({"KVCACHED_MIN_RESERVED_PAGES": "8", "KVCACHED_MAX_RESERVED_PAGES": "4"},
     "KVCACHED_MIN_RESERVED_PAGES='8' exceeds KVCACHED_MAX_RESERVED_PAGES='4'"),
    ({"KVCACHED_MIN_RESERVED_PAGES": "11"},
     "KVCACHED_MIN_RESERVED_PAGES='11' exceeds KVCACHED_MAX_RESERVED_PAGES (default 10)"),
    ({"KVCACHED_MAX_RESERVED_PAGES": "3"},
     "KVCACHED_MIN_RESERVED_PAGES (default 5) exceeds KVCACHED_MAX_RESERVED_PAGES='3'"),
])
def test_a_minimum_above_the_maximum_is_refused(environment: dict[str, str], shown: str
                                                ) -> None:
    """kvcached's prealloc thread maps pages up to the minimum: with a larger minimum the
    maximum silently does not hold. An unset bound counts with kvcached's default."""
    [(ok, line)] = checks.check_tuning_environment(environment)
    assert not ok and line.startswith(shown + ": expected the minimum at most the maximum")
    assert line.endswith(FIX)


def test_bound_order_is_not_judged_on_a_refused_bound() -> None:
    lines = checks.check_tuning_environment(
        {"KVCACHED_MIN_RESERVED_PAGES": "9", "KVCACHED_MAX_RESERVED_PAGES": "x"})
    assert [line.split(" ")[0] for ok, line in lines if not ok] == [
        "KVCACHED_MAX_RESERVED_PAGES='x'"]
    assert checks.check_tuning_environment(
        {"KVCACHED_MIN_RESERVED_PAGES": "7", "KVCACHED_MAX_RESERVED_PAGES": "7"})[0][0]


# ------------------------------------------------------------ properties against libc


_SPACE = st.sampled_from(["", "", " ", "\t", "\v", "\x1c", "\xa0"])
# ASCII digits, and two that Python's int()/float() read but C's atoi/atof do not.
_DIGITS = st.text(st.sampled_from([*"0123456789", "\u0663", "\uff15"]), max_size=3)


def _number_text() -> st.SearchStrategy[str]:
    """Number-like texts with the forms only one of Python and C reads as a number
    (underscores, non-ASCII digits and spaces, exponents, words), plus arbitrary noise."""
    shaped = st.builds(
        lambda *parts: "".join(parts), _SPACE, st.sampled_from(["", "", "+", "-"]), _DIGITS,
        st.sampled_from(["", "", ".", ".5", ".05", "_5", "e-1", "e", "E+2", "x1"]), _SPACE)
    words = st.sampled_from(["nan", "-inf", "Infinity", "0x1p-1", "0x10", "1e999"])
    noise = st.text(st.sampled_from(list("0123456789+-._eExX aAnNiIfF\t\x1c\xa0")),
                    max_size=12)
    return st.one_of(shaped, words, noise)


def _libc(value: str) -> bytes:
    return value.encode("utf-8", "surrogateescape")


@PROPERTY
@given(st.sampled_from(["KVCACHED_MIN_RESERVED_PAGES", "KVCACHED_MAX_RESERVED_PAGES"]),
       _number_text())
@example("KVCACHED_MIN_RESERVED_PAGES", " 7")
@example("KVCACHED_MIN_RESERVED_PAGES", "\u0667")
@example("KVCACHED_MAX_RESERVED_PAGES", "-0")
def test_reserved_pages_pass_exactly_when_python_and_atoi_agree_on_a_count(
    variable: str, value: str
) -> None:
    """kvcached parses the bounds with int() on import and its allocator with atoi: a value
    passes iff int() takes it, atoi reads the same number, and it is not negative."""
    try:
        python: int | None = int(value)
    except ValueError:
        python = None
    agreed = python is not None and LIBC.atoi(_libc(value)) == python and python >= 0
    # The other bound at its extreme, so that the order of the two never decides.
    other = {"KVCACHED_MIN_RESERVED_PAGES": ("KVCACHED_MAX_RESERVED_PAGES", "2147483647"),
             "KVCACHED_MAX_RESERVED_PAGES": ("KVCACHED_MIN_RESERVED_PAGES", "0")}[variable]
    lines = checks.check_tuning_environment(dict([(variable, value), other]))
    assert any(not ok for ok, _ in lines) is not agreed


@PROPERTY
@given(_number_text())
@example("0.95")
@example(" .5")
@example("0.9_5")
@example("\u0660.5")
@example("\xa00.5")
def test_utilization_passes_exactly_when_python_and_atof_agree_on_a_fraction(
    value: str,
) -> None:
    try:
        python: float | None = float(value)
    except ValueError:
        python = None
    agreed = (python is not None and LIBC.atof(_libc(value)) == python
              and 0.0 <= python <= 1.0)
    assert refused("KVCACHED_GPU_UTILIZATION", value) is not agreed


_WORDS = ["true", "false", "1", "0", "yes", "no", "on", "off", "t", "f", "y", "n", "enabled"]
_TRUE = {"true", "1", "yes", "on", "t", "y"}


@PROPERTY
@given(st.sampled_from(["KVCACHED_PAGE_PREALLOC_ENABLED", "KVCACHED_CONTIGUOUS_LAYOUT",
                        "KVCACHED_SANITY_CHECK", "KVCACHED_LOG_COLOR"]),
       st.sampled_from(_WORDS), st.sampled_from(["lower", "upper", "title"]),
       st.sampled_from(["", " ", "\t"]), st.sampled_from(["", " "]))
def test_a_flag_passes_only_when_kvcached_reads_it_as_meant(
    variable: str, word: str, case: str, before: str, after: str
) -> None:
    """kvcached takes ``value.lower() == "true"`` as on and anything else as off: a value
    passes only when that reading is what the word means (``0``/``no`` are off as meant)."""
    value = before + getattr(word, case)() + after
    kvcached_on = value.lower() == "true"
    if refused(variable, value):
        assert word == "enabled" or (word in _TRUE) is not kvcached_on
    else:
        assert (word in _TRUE) is kvcached_on


# gpu_utils.hpp's levels, in its enum's order; the macro takes the first character of the
# value and anything it does not list as FATAL, its lowest setting (print fatal errors only).
_ALLOCATOR_LEVELS = {"F": "FATAL", "E": "ERROR", "W": "WARNING", "I": "INFO", "D": "DEBUG",
                     "V": "VERBOSE"}
_LEVEL_WORDS = ["debug", "info", "warning", "warn", "error", "critical", "fatal", "notset",
                "verbose", "trace", "basic_format", "_styles", "dbg", ""]


@PROPERTY
@given(st.sampled_from(_LEVEL_WORDS), st.sampled_from(["lower", "upper", "title", "swapcase"]),
       st.sampled_from(["", " "]), st.sampled_from(["", " ", "\n"]))
def test_a_log_level_passes_only_when_both_of_kvcacheds_readers_take_it_alike(
    word: str, case: str, before: str, after: str
) -> None:
    """kvcached's Python logger takes ``getattr(logging, value.upper(), logging.INFO)`` and
    its C++ page allocator the value's first character: a value passes iff the name is one
    of logging's levels and the allocator's letter means that level (CRITICAL and FATAL are
    the allocator's FATAL), or it is VERBOSE, the allocator's finest, read by its letter V."""
    value = before + getattr(word, case)() + after
    allocator = _ALLOCATOR_LEVELS.get(value[:1], "FATAL")
    python_levels = logging.getLevelNamesMapping()  # the real logging module's names
    python = getattr(logging, value.upper(), logging.INFO)
    if value.upper() == "VERBOSE":
        agreed = allocator == "VERBOSE"
    else:
        agreed = (value.upper() in python_levels and isinstance(python, int)
                  and python_levels.get(allocator) == python)
    assert refused("KVCACHED_LOG_LEVEL", value) is not agreed


@PROPERTY
@given(st.sampled_from(["KVCACHED_MAX_CACHED_TOKENS", "KVCACHED_MAX_CACHED_BLOCKS",
                        "KVCACHED_PAGE_SIZE_MB", "KVCACHED_IPC_TIMEOUT"]), _number_text())
def test_python_only_variables_pass_exactly_what_kvcached_accepts(variable: str, value: str
                                                                  ) -> None:
    """Only kvcached's Python code reads these: whatever its int()/float() takes passes,
    bar a page size that is not a positive multiple of 2 MB and a NaN timeout."""
    parse = float if variable == "KVCACHED_IPC_TIMEOUT" else int
    try:
        number = parse(value)
    except ValueError:
        assert refused(variable, value)
        return
    if variable == "KVCACHED_PAGE_SIZE_MB":
        assert refused(variable, value) is not (number > 0 and number % 2 == 0)
    else:
        assert refused(variable, value) is math.isnan(number)


# ----------------------------------------------------------- the launch environment


def test_planned_environment_wins_over_the_inherited_one() -> None:
    launch = checks.launch_environment({"KVCACHED_PAGE_SIZE_MB": "4"},
                                       {"KVCACHED_PAGE_SIZE_MB": "3", "KVCACHED_IPC_TIMEOUT": "9"})
    assert launch == {"KVCACHED_PAGE_SIZE_MB": "4", "KVCACHED_IPC_TIMEOUT": "9"}


def test_check_reads_this_processs_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``run`` hands the engine the manager's own environment: check() must see it."""
    for name in checks.TUNING_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    quiet = checks.check(MANIFEST, {})
    assert not any("KVCACHED_" in line and "tuning" in line for _, line in quiet)
    monkeypatch.setenv("KVCACHED_PAGE_SIZE_MB", "3")
    monkeypatch.setenv("KVCACHED_IPC_TIMEOUT", "30")
    lines = checks.check(MANIFEST, {})
    assert len(lines) == len(quiet) + 2
    assert (False, checks.check_tuning_environment({"KVCACHED_PAGE_SIZE_MB": "3"})[0][1]) \
        in lines
    assert (True, "kvcached will read these tuning variables: KVCACHED_IPC_TIMEOUT='30'") \
        in lines


def test_kvcached_provider_check_prints_a_refused_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvcached_provider.cli import main

    monkeypatch.setenv("KVCACHED_CONTIGUOUS_LAYOUT", "yes")
    assert main(["check"]) == 1
    assert "FAIL KVCACHED_CONTIGUOUS_LAYOUT='yes' is invalid: expected 'true' or 'false';" \
        in capsys.readouterr().out


# ----------------------------------------------------------- through vllm-hust-ext


@needs_manager
def test_the_manager_reports_and_refuses_a_bad_tuning_variable(
    gpu_host: tuple[str, Path], base_env: dict[str, str]
) -> None:
    """On a host where every other check passes, status is degraded by the variable alone
    and run refuses (exit 2) naming it; a good value leaves the bundle ready and launches."""
    python, _ = gpu_host
    assert manager(base_env, "extension", "enable", KV, python=python).returncode == 0
    bad = {**base_env, "KVCACHED_PAGE_SIZE_MB": "3", "KVCACHED_MAX_CACHED_TOKENS": "-1"}
    status = json.loads(manager(bad, "extension", "status", KV, python=python).stdout)
    assert "degraded" in status["states"]
    ours = [line for line in status["evidence"] if line.startswith(
        (*checks.TUNING_VARIABLES, "kvcached will read these tuning variables"))]
    assert ours == [
        "KVCACHED_PAGE_SIZE_MB='3' is invalid: expected a positive even integer (the page "
        "size in MB); kvcached 0.1.6 would raise ValueError when the engine imports it; fix "
        "it, or unset it for kvcached's default (2), " + FIX,
        "kvcached will read these tuning variables: KVCACHED_MAX_CACHED_TOKENS='-1'",
    ]
    run = manager(bad, "run", "--dry-run", "--", "vllm", "serve", "m", python=python)
    assert run.returncode == 2
    assert f"refusing to launch '{KV}': KVCACHED_PAGE_SIZE_MB='3' is invalid" in run.stderr

    good = {**base_env, "KVCACHED_PAGE_SIZE_MB": "4"}
    status = json.loads(manager(good, "extension", "status", KV, python=python).stdout)
    assert status["states"] == ["installed", "discovered", "compatible", "configured",
                                "enabled"], status
    assert "kvcached will read these tuning variables: KVCACHED_PAGE_SIZE_MB='4'" \
        in status["evidence"]
    run = manager(good, "run", "--dry-run", "--", "vllm", "serve", "m", python=python)
    assert run.returncode == 0, run.stderr
