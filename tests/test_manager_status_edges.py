"""``status`` edge cases found in audit: service probes that do not answer HTTP or are not
valid URLs, and the runtime-evidence tail window.

Guards: a required service whose configured endpoint is not a valid URL (an unclosed IPv6
bracket, a space in the host) is *unreachable* evidence naming the service, and a service
port that answers something other than HTTP is *reachable but unhealthy*; neither makes
``status`` fail, and ``run`` refuses the launch with the spec's service-health text
(manager-protocol.md §5.1, §6.2). A live ``effective`` line that starts exactly where the
1 MiB tail window of the evidence log starts still counts. A host distribution whose
METADATA cannot be decoded makes the bundle incompatible with one line naming the host.
A passed runtime qualification never lifts an unknown check result to ``compatible``, and
a live ``effective`` line of another bundle is not this bundle's runtime evidence.
"""

from __future__ import annotations

import importlib.metadata
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hust_ext_manager import runtime_evidence

from tests.manager_helpers import fake_site, invoke
from tests.manager_helpers import install_bundles as install
from tests.test_manager_status import BASE, DECLARED, _fake_host, _with, set_state

BUNDLE = "org.test.p"


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("VLLM_HUST_EXT_EVIDENCE_PATH", str(tmp_path / "evidence.jsonl"))
    return fake_site(tmp_path, monkeypatch)


def _status(capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    code, out, err = invoke(["extension", "status", BUNDLE], capsys)
    assert code == 0, err
    shown: dict[str, Any] = json.loads(out)
    return shown


def _with_service(site: Path, tmp_path: Path, url: str) -> None:
    """``BUNDLE`` needing HTTP service ``kv`` (endpoint key ``health_url`` set to ``url``)."""
    service = {"service_id": "kv", "protocol": "http", "version_range": None,
               "endpoint_config": "health_url"}
    document = _with(BASE, requires_services=[service], runtime__isolation="external_service")
    install(site, {BUNDLE: document})
    set_state(tmp_path, {BUNDLE: {"enabled": True,
                                  "configuration": {**DECLARED, "health_url": url}}})


@pytest.fixture
def not_http() -> Iterator[str]:
    """A loopback TCP port that answers every request with a Redis-style error line (a
    service's own protocol, not HTTP)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)  # close() does not wake a blocked accept(): poll for the stop
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                client, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with client:
                client.recv(4096)
                client.sendall(b"-ERR unknown command\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}/health"
    stop.set()
    thread.join(timeout=5)
    server.close()


@pytest.mark.parametrize("url", ["http://[::1", "http://[zz]/health", "http://a b/health"],
                         ids=["unclosed-bracket", "bad-ipv6", "space-in-host"])
def test_an_invalid_endpoint_url_is_unreachable_evidence_not_an_error(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], url: str
) -> None:
    """An endpoint that is not a valid URL used to end ``status`` with exit 2 and a bare
    "Invalid IPv6 URL" (or an "internal error: InvalidURL") naming neither the service nor
    the URL. It is evidence now: unreachable, unhealthy, degraded; ``run`` refuses with
    the service-health text."""
    _with_service(site, tmp_path, url)
    shown = _status(capsys)
    assert "reachable" not in shown["states"] and "healthy" not in shown["states"]
    assert shown["states"][-1] == "degraded"
    assert any(line.startswith(f"service kv at {url} is unreachable: the endpoint is not a "
                               "valid URL") for line in shown["evidence"]), shown["evidence"]
    code, _, err = invoke(["run", "--dry-run", "--", "true"], capsys)
    assert code == 2
    assert "refusing to launch 'org.test.p': required service health is not verified (kv)" in (
        err.splitlines()[-1])


def test_a_port_that_does_not_answer_http_is_reachable_but_unhealthy(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], not_http: str
) -> None:
    """A health URL that points at a service's own (non-HTTP) port gets an answer that is
    no HTTP status line; http.client's BadStatusLine is no OSError, so it used to escape as
    "internal error: BadStatusLine". Something answered: reachable, not healthy."""
    _with_service(site, tmp_path, not_http)
    shown = _status(capsys)
    assert "reachable" in shown["states"] and "healthy" not in shown["states"]
    assert shown["states"][-1] == "degraded"
    assert (f"service kv at {not_http} is unhealthy: not an HTTP answer (BadStatusLine: "
            "-ERR unknown command)") in shown["evidence"]
    code, _, err = invoke(["run", "--dry-run", "--", "true"], capsys)
    assert code == 2
    assert "required service health is not verified (kv)" in err.splitlines()[-1]


def test_a_live_line_starting_the_tail_window_exactly_is_read(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reader takes the last 1 MiB of a longer log and drops the window's first line as
    a partial one. When the window starts exactly at a line's start, that line is whole:
    it used to be dropped too, so a live ``effective`` line there vanished from status."""
    install(site, {BUNDLE: BASE})
    set_state(tmp_path, {BUNDLE: {"enabled": True, "configuration": DECLARED}})
    monkeypatch.setenv("VLLM_ECPA_PLAN_ID", "p")
    monkeypatch.setenv("VLLM_ECPA_LAUNCH_ID", "l")
    monkeypatch.setenv("VLLMHUST_EXT_ENABLED_BUNDLES", BUNDLE)
    log = tmp_path / "evidence.jsonl"
    runtime_evidence.record_event("effective", {})  # this process, live
    live = log.read_bytes()
    window = runtime_evidence._MAX_READ_BYTES
    padding = b"#" * (window - len(live) - 1) + b"\n"  # one corrupt line fills the window
    log.write_bytes(b"#\n" + live + padding)  # an older line sits before the window
    assert log.stat().st_size == window + 2
    shown = _status(capsys)
    assert shown["states"][-1] == "runtime_effective"
    # A window that starts inside a line still drops that partial line.
    log.write_bytes(b"#" + live + padding)
    assert "runtime_effective" not in _status(capsys)["states"]


def test_an_undecodable_host_metadata_is_one_line_naming_the_host(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """§5.2 step 1 reads the host's version from its METADATA. Undecodable bytes there
    used to leave a bare "'utf-8' codec can't decode byte 0xff ..." as the only evidence
    (and as ``run``'s refusal), naming neither the host nor the file."""
    document = _with(BASE, host__name="fakehost", host__version_range=">=9,<10")
    install(site, {BUNDLE: document})
    _fake_host(site, contract=True)
    (site / "fakehost-9.1.dist-info" / "METADATA").write_bytes(
        b"Metadata-Version: 2.1\nName: fakehost\nVersion: 9.1\nSummary: \xff\n")
    set_state(tmp_path, {BUNDLE: {"enabled": True, "configuration": {}}})
    line = ("host distribution 'fakehost' METADATA cannot be read, so its version is "
            "unknown: reinstall fakehost")
    shown = _status(capsys)
    assert shown["states"] == ["installed", "discovered", "incompatible"]
    assert shown["evidence"] == [line]
    code, _, err = invoke(["run", "--dry-run", "--", "true"], capsys)
    assert code == 2
    assert err.splitlines()[-1] == (
        f"vllm-hust-ext: error: refusing to launch incompatible extension {BUNDLE!r}: {line}")
    # A declared host_version is the operator's word: the METADATA is not read then.
    set_state(tmp_path, {BUNDLE: {"enabled": True, "configuration": {"host_version": "9.1"}}})
    assert _status(capsys)["evidence"][0] == "host version 9.1 satisfies the declared range"


def _missing_keys_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    """What importlib.metadata has deprecated since Python 3.12 and promises next: ``[]``
    on a METADATA field that is absent raises KeyError instead of returning None. Patched
    on the one method that answers ``[]``; nothing else of importlib changes."""
    original = importlib.metadata._adapters.Message.__getitem__

    def getitem(self: Any, key: str) -> Any:
        value = original(self, key)
        if value is None:
            raise KeyError(key)
        return value

    monkeypatch.setattr(importlib.metadata._adapters.Message, "__getitem__", getitem)


@pytest.mark.parametrize("metadata, newer_python", [
    (b"Metadata-Version: 2.1\nName: fakehost\n", False),
    (b"Metadata-Version: 2.1\nName: fakehost\n", True),
    (b"Metadata-Version: 2.1\nName: fakehost\nVersion: \n", False),
], ids=["no-field", "no-field-keyerror", "empty"])
def test_a_host_metadata_without_a_version_is_unknown_not_an_error(
    site: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    metadata: bytes,
    newer_python: bool,
) -> None:
    """§5.2 step 1: a host METADATA with no (or an empty) Version field leaves the host
    version unavailable, so compatibility is unverified, as for no host at all. Where
    importlib raises KeyError for the missing field, reading ``dist.version`` made
    ``status`` exit 2 with "internal error: KeyError: 'Version'"; an empty version was
    judged outside the range."""
    if newer_python:
        _missing_keys_raise(monkeypatch)
    document = _with(BASE, host__name="fakehost", host__version_range=">=9,<10")
    install(site, {BUNDLE: document})
    _fake_host(site, contract=True)
    (site / "fakehost-9.1.dist-info" / "METADATA").write_bytes(metadata)
    set_state(tmp_path, {BUNDLE: {"enabled": True, "configuration": {}}})
    shown = _status(capsys)
    assert "incompatible" not in shown["states"]
    assert shown["evidence"][0] == "host version is unavailable; compatibility is unverified"


def test_a_passed_qualification_never_lifts_an_unknown_result(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """§5.2 step 5 runs only when steps 1-4 gave *true*: with the protocol version
    unavailable (stock vLLM, nothing declared) the result stays unknown even though the
    user's qualification matches the profile, so ``run`` still refuses the trusted
    in-process bundle as unverified (a mutation-test gap: no test held this)."""
    profile = {"accelerator": "cpu"}
    document = _with(BASE, activation__additional_config={
        "_manager_runtime_qualification": profile})
    install(site, {BUNDLE: document})
    configuration = {"host_version": "0.33.0",
                     "runtime_qualification": {"status": "passed", **profile}}
    set_state(tmp_path, {BUNDLE: {"enabled": True, "configuration": configuration}})
    shown = _status(capsys)
    assert shown["states"] == ["installed", "discovered", "configured", "enabled", "degraded"]
    assert "protocol vllm.preemption-policy version is unavailable" in shown["evidence"]
    assert "required runtime qualification profile passed" not in shown["evidence"]
    code, _, err = invoke(["run", "--dry-run", "--", "true"], capsys)
    assert code == 2
    assert "refusing to launch unverified trusted in-process extension 'org.test.p'" in err


def test_a_live_line_of_another_bundle_is_not_this_bundles_evidence(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``runtime_effective`` needs a live ``effective`` line *naming this bundle* (its id,
    or one of its activation entry points): a live line another bundle wrote in the same
    log says nothing about this one (a mutation-test gap: no test held this)."""
    install(site, {BUNDLE: BASE})
    set_state(tmp_path, {BUNDLE: {"enabled": True, "configuration": DECLARED}})
    monkeypatch.setenv("VLLM_ECPA_PLAN_ID", "p")
    monkeypatch.setenv("VLLM_ECPA_LAUNCH_ID", "l")
    runtime_evidence.record_event("effective", {}, extension_id="org.test.other")
    assert "runtime_effective" not in _status(capsys)["states"]
    runtime_evidence.record_event("effective", {}, extension_id=BUNDLE)
    assert _status(capsys)["states"][-1] == "runtime_effective"
