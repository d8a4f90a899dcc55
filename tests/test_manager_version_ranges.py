"""Version ranges in ``status``: pre-releases match only when the range itself names one.

Guards manager-protocol.md §5.2 ("Version matching uses ``packaging``: ``Version(v) in
SpecifierSet(range)``; pre-releases match only when the range itself names one, as
``>=0.28.1rc1.dev319,<0.29`` does") for each of the three ranges the vLLM provider checks:
the host version range, the host API range and a protocol's range. A range naming a
pre-release (``>=0.28.1rc1.dev319``) admits pre-releases inside it; a range naming none
(``>=0.28,<0.34``, ``>=1,<2``) refuses them, whatever the installed packaging release does
by default (packaging 26 admits ``1.1rc1`` in ``>=1,<2``; packaging 24, the official
manager's floor, does not). Post-releases are final releases and always match.

A fake installed distribution registers the bundle; the CLI runs in-process.
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
BUNDLE = "org.test.ranges"
NAMES_PRE = ">=0.28.1rc1.dev319,<0.29"  # the published BidKV host range (§1.5)
NAMES_NONE = ">=0.28,<0.34"
PROTOCOL = "vllm.preemption-policy"


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return fake_site(tmp_path, monkeypatch, ("VLLM_HUST_EXT_EVIDENCE_PATH",))


def install(site: Path, host_range: str) -> None:
    """Register BASE (its host range replaced) as ``BUNDLE`` through a dist-info RECORD."""
    document = {**BASE, "host": {**BASE["host"], "version_range": host_range}}
    install_bundles(site, {BUNDLE: document}, name="fake-ranges")


def status(
    site: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    host_range: str,
    configuration: dict[str, Any],
) -> dict[str, Any]:
    install(site, host_range)
    entry = {"enabled": False, "configuration": configuration}
    (tmp_path / "config.json").write_text(
        json.dumps({"schema_version": 2, "extensions": {BUNDLE: entry}})
    )
    code, out, err = invoke(["extension", "status", BUNDLE], capsys)
    assert code == 0, err
    shown: dict[str, Any] = json.loads(out)
    return shown


@pytest.mark.parametrize(
    ("host_range", "version", "inside"),
    [
        (NAMES_PRE, "0.28.2rc1", True),
        (NAMES_PRE, "0.28.1rc1.dev400", True),
        (NAMES_PRE, "0.28.1rc1.dev100", False),  # below the named pre-release
        (NAMES_PRE, "0.29.0rc1", False),  # ``<0.29`` excludes 0.29's own pre-releases
        (NAMES_PRE, "0.28.5", True),
        (NAMES_NONE, "0.30.0rc1", False),
        (NAMES_NONE, "0.30.0.dev1", False),  # a dev release is a pre-release too
        (NAMES_NONE, "0.30.0", True),
        (NAMES_NONE, "0.30.0.post1", True),  # a post-release is a final release
    ],
)
def test_host_version_pre_releases_need_a_range_naming_one(
    site: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    host_range: str,
    version: str,
    inside: bool,
) -> None:
    shown = status(
        site,
        tmp_path,
        capsys,
        host_range,
        {"host_version": version, "protocol_versions": {PROTOCOL: "1.0"}},
    )
    if inside:
        assert shown["states"] == ["installed", "discovered", "compatible", "configured"]
        assert shown["evidence"][0] == f"host version {version} satisfies the declared range"
    else:
        assert shown["states"] == ["installed", "discovered", "incompatible"]
        assert shown["evidence"][0] == f"host version {version} is outside {host_range}"


@pytest.mark.parametrize(
    ("version", "inside"), [("1.1rc1", False), ("1.0.dev0", False), ("1.1", True)]
)
def test_a_protocol_range_naming_no_pre_release_refuses_one(
    site: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    version: str,
    inside: bool,
) -> None:
    """The BidKV protocol range ``>=1,<2`` names no pre-release."""
    shown = status(
        site,
        tmp_path,
        capsys,
        NAMES_PRE,
        {"host_version": "0.28.2", "protocol_versions": {PROTOCOL: version}},
    )
    if inside:
        assert "compatible" in shown["states"]
        assert f"protocol {PROTOCOL} {version} satisfies the declared range" in shown["evidence"]
    else:
        assert shown["states"] == ["installed", "discovered", "incompatible"]
        assert f"protocol {PROTOCOL} {version} is outside >=1,<2" in shown["evidence"]


def test_a_host_api_range_naming_no_pre_release_refuses_one(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The BidKV API range ``>=1,<2`` names no pre-release."""
    shown = status(
        site,
        tmp_path,
        capsys,
        NAMES_PRE,
        {
            "host_version": "0.28.2",
            "host_api_version": "1.1rc1",
            "protocol_versions": {PROTOCOL: "1.0"},
        },
    )
    assert shown["states"] == ["installed", "discovered", "incompatible"]
    assert "host API 1.1rc1 is outside >=1,<2" in shown["evidence"]


@pytest.mark.parametrize(
    ("version", "spec", "inside"),
    [
        ("0.9rc2", "<=1.0rc1", True),  # "<=" names a pre-release, as packaging 24 reads it
        ("1.0rc1", "~=1.0rc1", True),
        ("1.0rc1", "===1.0rc1", True),
        ("0.9rc2", "<1.0rc1", False),  # "<" and ">" never name one (packaging 24)
        ("1.1rc1", ">1.0rc1", False),
        ("1.0rc1", "<=1.0", False),
    ],
)
def test_each_operator_names_a_pre_release_as_packaging_24_does(
    version: str, spec: str, inside: bool
) -> None:
    """Which operators make a range name a pre-release: ``==``, ``>=``, ``<=``, ``~=`` and
    ``===`` with a pre-release version do; ``<`` and ``>`` do not."""
    from hust_ext_manager.provider import _in_range

    assert _in_range(version, spec) is inside
