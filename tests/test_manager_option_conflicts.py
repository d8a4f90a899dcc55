"""Two enabled bundles whose configured JSON launch options disagree (manager-protocol.md
§9, per key): refused naming both bundles and the option, by ``run`` and by
``extension env`` alike.

The per-key rule had a test for the scalar ``--preemption-policy`` only; the JSON options
(``launch_options.speculative_config`` → ``--speculative-config``) go through the same
claim check, and without it ``env`` would print an environment that ``run`` refuses, and
``run`` would refuse with a message naming neither bundle.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.manager_helpers import fake_site, install_bundles, invoke

ROOT = Path(__file__).resolve().parents[1]
BASE: dict[str, Any] = json.loads(
    (ROOT / "manifests" / "bidkv" / "vllm-hust-extension-v0.2.json").read_text()
)
DECLARED = {"host_version": "0.33.0", "protocol_versions": {"vllm.preemption-policy": "1.0"}}


def _plain() -> dict[str, Any]:
    """A bundle that renders no option of its own and sets no environment."""
    document: dict[str, Any] = json.loads(json.dumps(BASE))
    document.update(components=[], protocols=[], kind="in_process_plugin")
    document["runtime"]["isolation"] = "external_service"
    document["activation"]["environment"] = {}
    return document


def test_bundles_with_different_json_launch_options_conflict_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--speculative-config`` configured differently for two enabled bundles is refused
    as ``extensions '<a>' and '<b>' conflict on --speculative-config`` by both verbs."""
    site = fake_site(tmp_path, monkeypatch, ("VLLM_PLUGINS",))
    install_bundles(site, {"org.test.p": BASE, "org.test.q": _plain()}, name="fake-conflict")
    entries = {
        "org.test.p": {"enabled": True, "configuration": {
            **DECLARED, "launch_options": {"speculative_config": {"n": 1}}}},
        "org.test.q": {"enabled": True, "configuration": {
            "host_version": "0.33.0", "launch_options": {"speculative_config": {"n": 2}}}},
    }
    (tmp_path / "config.json").write_text(
        json.dumps({"schema_version": 2, "extensions": entries})
    )
    expected = (
        "vllm-hust-ext: error: extensions 'org.test.p' and 'org.test.q' conflict on "
        "--speculative-config"
    )
    for argv in (["run", "--dry-run", "--", "h"], ["extension", "env"]):
        code, out, err = invoke(argv, capsys)
        assert (code, out) == (2, ""), argv
        assert err.splitlines()[-1] == expected, argv
