"""Gaps the twenty-second mutation audit (``hust_ext_manager.runtime_evidence``) found in
the status and launch tests; each test below failed under a mutant that those tests let
pass.

Guarded: an empty ``VLLM_HUST_EXT_EVIDENCE_PATH`` means the default log (as the bundle's
writer reads it: no path); the manager's sink writes compact lines with sorted keys, the
bundle writer's format; a host event with an empty launch id, or a host or start identity
that is not a string, is refused; a trailing comma in ``VLLMHUST_EXT_ENABLED_BUNDLES``
names no second bundle; a launch's plan id does not depend on the order its bundles are
listed in; ``status`` reads only the last MiB of the log; an entry point named by a list
is skipped, not a crash; and a line observed as ``runtime_effective`` counts whatever its
event name.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hust_ext_manager import runtime_evidence
from hust_ext_manager.state import config_path

from tests.test_manager_status import _live_line

BUNDLE = "org.test.p"
BINDING = {"VLLM_ECPA_PLAN_ID": "p", "VLLM_ECPA_LAUNCH_ID": "l"}


@pytest.fixture
def log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "evidence.jsonl"
    monkeypatch.setenv(runtime_evidence.PATH_ENV, str(path))
    for key, value in BINDING.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("VLLMHUST_EXT_ENABLED_BUNDLES", raising=False)
    return path


def _write(path: Path, *lines: dict[str, Any]) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")


def test_an_empty_evidence_path_means_the_default_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutant: only an unset variable meaning the default. An empty one made the log
    ``Path("")``, the working directory, where the bundle's writer (which takes an empty
    value for no sink) never writes."""
    monkeypatch.setenv("VLLM_HUST_EXT_CONFIG", str(tmp_path / "state" / "config.json"))
    monkeypatch.setenv(runtime_evidence.PATH_ENV, "")
    assert runtime_evidence.evidence_path() == tmp_path / "state" / "runtime-evidence.jsonl"
    assert runtime_evidence.evidence_path() == config_path().with_name("runtime-evidence.jsonl")


def test_the_manager_sink_writes_the_bundle_writers_compact_format(log: Path) -> None:
    """Mutant: the sink's line written with JSON's default separators. Both writers append
    compact lines with sorted keys, so one log never mixes two spellings of a line."""
    runtime_evidence.record_event("effective", {"b": 1, "a": [1, 2]}, extension_id=BUNDLE)
    [raw] = log.read_text(encoding="utf-8").splitlines()
    assert raw == json.dumps(json.loads(raw), separators=(",", ":"), sort_keys=True)


@pytest.mark.parametrize(("where", "key", "value"), [
    (None, "launch_id", ""),
    ("process", "start_identity", None),
    ("process", "host", 5),
], ids=["empty-launch-id", "start-identity-not-a-string", "host-not-a-string"])
def test_a_host_event_missing_a_part_of_its_binding_is_refused(
    log: Path, where: str | None, key: str, value: object
) -> None:
    """Mutants: the binding check without the non-empty launch id, the string start
    identity or the string host. Such a line cannot be matched to a live launch."""
    line = _live_line()
    (line[where] if where else line)[key] = value
    with pytest.raises(ValueError, match="must be a bound"):
        runtime_evidence.record_event(line)
    assert not log.exists()


def test_a_trailing_comma_in_the_enabled_bundles_names_no_second_bundle(
    log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutant: empty names kept when the sink reads ``VLLMHUST_EXT_ENABLED_BUNDLES``.
    ``org.test.p,`` would then be two bundles and the line would name none."""
    monkeypatch.setenv("VLLMHUST_EXT_ENABLED_BUNDLES", f"{BUNDLE},")
    runtime_evidence.record_event("effective", {})
    [raw] = log.read_text(encoding="utf-8").splitlines()
    assert json.loads(raw)["extension_id"] == BUNDLE


def test_a_launchs_plan_id_does_not_depend_on_the_order_of_its_bundles(log: Path) -> None:
    """Mutant: the plan id hashed over the bundles as listed. The same set of bundles is
    the same plan; the launch id alone is fresh for each launch."""
    one = ("org.a", "1.0", "m-a")
    two = ("org.b", "2.0", "m-b")
    first = runtime_evidence.launch_environment([one, two])
    second = runtime_evidence.launch_environment([two, one])
    assert first["VLLM_ECPA_PLAN_ID"] == second["VLLM_ECPA_PLAN_ID"]
    assert first["VLLM_ECPA_LAUNCH_ID"] != second["VLLM_ECPA_LAUNCH_ID"]
    other = runtime_evidence.launch_environment([one])
    assert other["VLLM_ECPA_PLAN_ID"] != first["VLLM_ECPA_PLAN_ID"]


def test_status_reads_only_the_last_mib_of_the_log(log: Path) -> None:
    """Mutant: a window of 64 MiB. The log grows for as long as engines run; ``status``
    reads its last MiB, so a live line further back is no longer seen (and one inside the
    window is)."""
    filler = _live_line(extension_id="org.other")
    size = len(json.dumps(filler)) + 1
    count = (1 << 20) // size + 2  # just over one MiB of other bundles' lines
    _write(log, _live_line(), *([filler] * count))
    assert log.stat().st_size > 1 << 20
    assert runtime_evidence.runtime_effective_evidence(BUNDLE) is None
    _write(log, _live_line(), *([filler] * (count - 4)))
    assert log.stat().st_size < 1 << 20
    assert runtime_evidence.runtime_effective_evidence(BUNDLE) is not None


def test_an_entry_point_named_by_a_list_is_skipped_not_a_crash(log: Path) -> None:
    """Mutant: the entry point's group and name used without checking that they are
    strings. A list there made the set lookup raise TypeError, and ``status`` with it."""
    wanted = {("vllm.general_plugins", "p")}
    odd = _live_line(extension_id="org.other",
                entry_point={"group": ["vllm.general_plugins"], "name": "p"})
    named = _live_line(extension_id="org.other",
                  entry_point={"group": "vllm.general_plugins", "name": "p"})
    _write(log, named, odd)
    found = runtime_evidence.runtime_effective_evidence(BUNDLE, wanted)
    assert found == f"live runtime evidence launch_id=l pid={os.getpid()} event=effective"


def test_a_line_observed_as_runtime_effective_counts_whatever_its_event(log: Path) -> None:
    """Mutant: ``observation_kind`` ignored. A host that builds its own events may name
    them otherwise and mark the observation; such a line counts, an unmarked one does
    not."""
    _write(log, _live_line(event="initialized", observation_kind="runtime_effective"))
    found = runtime_evidence.runtime_effective_evidence(BUNDLE)
    assert found == f"live runtime evidence launch_id=l pid={os.getpid()} event=initialized"
    _write(log, _live_line(event="initialized", observation_kind=None))
    assert runtime_evidence.runtime_effective_evidence(BUNDLE) is None
