"""Behaviours a mutation audit of ``bidkv_ext.contract`` and ``bidkv_ext.evidence`` found unguarded.

- Host module (contract module doc: "only when the host module declares API major version 1
  and the candidate and context fields in the contract's order"; spec section 1, host API
  range ``>=1,<2``): a host of API version 0.x is refused; a host whose *context* fields
  are in another order is refused; a host that lacks any of the shared names (the stats
  type, the controller) is refused with one warning naming every missing name; a version
  given as the integer 1 still declares major version 1 (read through ``str``).
- Optional facts (contract module doc, "Extra facts"; ``PreemptionContextFacts`` doc):
  ``pages_released`` is ``None`` unless the host has elastic KV, ``in_shrink`` is ``None``
  unless the host read the capacity signals, and a context's ``facts`` default to none.
- Facts are immutable snapshots (spec section 3, rule 3: a policy "only ever receives
  immutable snapshots"): ``CandidateFacts`` and ``PreemptionContextFacts`` refuse assignment.
- Module attributes (``__getattr__`` comment: only the controller is resolved late): any
  other missing name is an ``AttributeError`` (PEP 562), so ``hasattr`` and imports see it.
- Exports (docs/policy.md "Host facts (optional)" names ``bidkv_ext.contract.CandidateFacts``
  and ``PreemptionContextFacts``; the module's ``__all__``): a star import yields them,
  ``candidate_index`` and ``PreemptionSchedulingPolicy``.
- Evidence lines (``evidence_line`` signature and doc, "the JSON object for one event"): any
  ``Mapping`` of stats is copied into a plain dict that ``json`` writes.
- ``start_identity`` (its doc: None only when unreadable; the manager reads the same file as
  UTF-8): a non-ASCII command name still gives the identity.
- Appending (``_append`` comment, "concurrent writers never interleave lines"): one write
  per line, so lines from threads writing at once are each whole JSON.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from types import MappingProxyType

import pytest

from bidkv_ext import contract, evidence
from bidkv_ext.contract import CandidateFacts, PreemptionContextFacts
from bidkv_ext.evidence import evidence_line
from tests.test_contract_host_module import _host_tree, _run
from tests.test_report_mutation_gaps import _fake_stat

# Run in a fresh interpreter with the stand-in host first on the path: the local
# definitions must stay, and the controller name must still resolve (to ours).
_LOCAL_STAYS = """
    import vllm
    import vllm.v1.core.sched.preemption as host
    from bidkv_ext import contract
    assert contract.PreemptionCandidate is not host.PreemptionCandidate
    assert contract.PreemptionCandidate.__module__ == "bidkv_ext.contract"
    assert contract.PreemptionPolicyStats.__module__ == "bidkv_ext.contract"
    assert contract.PreemptionPolicyController.__module__ == "bidkv_ext.controller"
"""


def _edit_host(root: Path, old: str, new: str) -> Path:
    """The stand-in host tree under ``root`` with one piece of the host module replaced."""
    module = _host_tree(root) / "vllm" / "v1" / "core" / "sched" / "preemption.py"
    text = module.read_text()
    assert text.count(old) == 1, old
    module.write_text(text.replace(old, new))
    return root


def _one_warning(stderr: str) -> str:
    warnings = [line for line in stderr.splitlines() if "preemption contract" in line]
    assert len(warnings) == 1, stderr
    return warnings[0]


def test_a_host_of_api_version_zero_is_refused(tmp_path: Path) -> None:
    """Spec section 1, host API range ``>=1,<2``: a 0.x host is not version 1."""
    done = _run(_host_tree(tmp_path, version="0.9"), _LOCAL_STAYS)
    assert done.returncode == 0, done.stderr
    assert "API version is '0.9', expected 1.x" in _one_warning(done.stderr)


def test_an_integer_api_version_one_is_major_version_one(tmp_path: Path) -> None:
    """Module doc: a host that declares API major version 1 is used; the version is read
    through ``str``, so ``1`` (not ``"1.0"``) neither fails the import nor is refused."""
    root = _edit_host(
        tmp_path, "PREEMPTION_POLICY_API_VERSION = '1.0'", "PREEMPTION_POLICY_API_VERSION = 1"
    )
    done = _run(
        root,
        """
        import vllm
        import vllm.v1.core.sched.preemption as host
        from bidkv_ext import contract
        assert contract.PreemptionContext is host.PreemptionContext
        assert contract.PREEMPTION_POLICY_API_VERSION == 1
    """,
    )
    assert done.returncode == 0, done.stderr
    assert "preemption contract" not in done.stderr


def test_a_host_with_its_context_fields_in_another_order_is_refused(tmp_path: Path) -> None:
    """Module doc: the *context* fields, not only the candidate's, must be in the
    contract's order (spec section 2: "field order is part of the contract")."""
    root = _edit_host(
        tmp_path,
        '    scheduling_policy: Literal["fcfs", "priority"]\n    requesting_request_id: str\n',
        '    requesting_request_id: str\n    scheduling_policy: Literal["fcfs", "priority"]\n',
    )
    done = _run(root, _LOCAL_STAYS)
    assert done.returncode == 0, done.stderr
    assert "its PreemptionContext fields are" in _one_warning(done.stderr)


def test_a_host_lacking_shared_names_is_refused_naming_each(tmp_path: Path) -> None:
    """Module doc and spec section 1 (exports): the stats type and the controller are
    among the names the host shares; a host without them is refused, and the one warning
    names every missing name."""
    root = _edit_host(tmp_path, "class PreemptionPolicyStats:", "class HostStats:")
    module = root / "vllm" / "v1" / "core" / "sched" / "preemption.py"
    module.write_text(
        module.read_text().replace("class PreemptionPolicyController:", "class HostController:")
    )
    done = _run(root, _LOCAL_STAYS)
    assert done.returncode == 0, done.stderr
    assert "it lacks PreemptionPolicyStats, PreemptionPolicyController" in _one_warning(done.stderr)


def test_optional_facts_default_to_absent() -> None:
    """Module doc "Extra facts": hosts without elastic KV leave ``pages_released`` None;
    ``PreemptionContextFacts`` doc: ``in_shrink`` None means the host did not read the
    signals; a context without per-candidate facts has none."""
    assert CandidateFacts(3, 1, 4).pages_released is None
    context = PreemptionContextFacts(16, 2)
    assert context.in_shrink is None
    assert dict(context.facts) == {}


def test_facts_are_immutable_snapshots() -> None:
    """Spec section 3, rule 3: a policy only ever receives immutable snapshots, the
    host's facts beside the context included."""
    facts = CandidateFacts(3, 1, 4, 2)
    context = PreemptionContextFacts(16, 2, {"a": facts}, True)
    for obj in (facts, context):
        for f in dataclasses.fields(obj):
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(obj, f.name, getattr(obj, f.name))


def test_an_unknown_name_is_an_attribute_error() -> None:
    """The module ``__getattr__`` resolves only the controller (module comment); any other
    missing name is an ``AttributeError`` (PEP 562), so ``hasattr`` and imports see it."""
    misspelt = "PreemptionPolicyControler"
    assert not hasattr(contract, misspelt)
    with pytest.raises(AttributeError, match=misspelt):
        getattr(contract, misspelt)
    with pytest.raises(ImportError):
        exec(f"from bidkv_ext.contract import {misspelt}", {})


def test_the_facts_types_and_candidate_index_are_exported() -> None:
    """docs/policy.md "Host facts (optional)" names ``bidkv_ext.contract.CandidateFacts`` and
    ``PreemptionContextFacts`` as the module's API; ``candidate_index`` is public beside
    them (the module's ``__all__``): a star import yields all of them."""
    names: dict[str, object] = {}
    exec("from bidkv_ext.contract import *", names)
    for name in (
        "CandidateFacts",
        "PreemptionContextFacts",
        "candidate_index",
        "PreemptionSchedulingPolicy",
    ):
        assert names[name] is getattr(contract, name), name


def test_an_evidence_line_copies_any_mapping_of_stats_into_json() -> None:
    """``evidence_line`` takes any ``Mapping`` of stats (its signature) and gives "the
    JSON object for one event" (its doc): a read-only mapping becomes a plain dict that
    ``json`` writes, and a later change to the caller's mapping does not reach the line."""
    source = {"calls": 1}
    line = evidence_line("initialized", MappingProxyType(source), {})
    source["calls"] = 2
    assert line["stats"] == {"calls": 1}
    assert json.loads(json.dumps(line))["stats"] == {"calls": 1}


def test_start_identity_reads_a_non_ascii_command_name(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``start_identity`` doc: None only when ``/proc/<pid>/stat`` is unreadable; a command
    name is any UTF-8 text (the manager reads the file as UTF-8 too, and the identities
    must agree for ``runtime_effective``)."""
    ticks = " ".join(str(n) for n in range(18))
    _fake_stat(monkeypatch, tmp_path, f"42 (évidence ü) S {ticks} 777 0\n")
    assert evidence.start_identity(42) == "pid:42:start_ticks:777"


def test_concurrent_events_never_interleave_lines(tmp_path: Path) -> None:
    """``_append``: one ``write()`` per line on an ``O_APPEND`` descriptor, so writers
    running at once never interleave lines: every line of the file is whole JSON."""
    path = tmp_path / "ev.jsonl"
    sink = evidence.evidence_sink_from_env({evidence.EVIDENCE_PATH_ENV: str(path)})
    assert sink is not None
    stats: dict[str, object] = {"note": "x" * 200}

    def emit(worker: int) -> None:
        for n in range(50):
            sink("effective", {**stats, "worker": worker, "n": n})

    threads = [threading.Thread(target=emit, args=(worker,)) for worker in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lines = [json.loads(text) for text in path.read_text().splitlines()]
    assert sorted((line["stats"]["worker"], line["stats"]["n"]) for line in lines) == [
        (worker, n) for worker in range(4) for n in range(50)
    ]
