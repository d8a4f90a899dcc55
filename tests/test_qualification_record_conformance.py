"""Guards what a qualification record must say about its lane, and which records may
qualify a release (qualification.md §9; qualification/README.md "Outputs", "Release
check"): the record names the CUDA version torch was built with beside the torch version
(§9: "Record GPU model, driver, CUDA, torch and vLLM-HUST commit"), null for a CPU build;
and a record from a replay profile is the CI gate, never a release qualification, even when
its free-text ``accelerator`` names an accelerator.
"""

from __future__ import annotations

import email.message
import importlib.metadata
import json
from pathlib import Path

import pytest

import qualification.runner
from qualification.errors import QualificationError
from qualification.profile import load_profile
from qualification.release import check_release
from qualification.runner import build_record
from tests.test_qualification_release import _record, _tree

TORCH_VERSION_PY = """\
from typing import Optional

__all__ = ['__version__', 'debug', 'cuda', 'git_version', 'hip']
__version__ = '2.9.0+cu128'
debug = False
cuda: Optional[str] = {cuda}
git_version = 'abc'
hip: Optional[str] = None
"""


class _FakeTorch:
    """A torch distribution whose ``torch/version.py`` lies under ``root``."""

    version = "2.9.0+cu128"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.metadata = email.message.Message()  # what importlib's metadata reads as
        self.metadata["Name"] = "torch"
        self.metadata["Version"] = self.version

    def locate_file(self, path: str) -> Path:
        return self.root / path


def _with_torch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cuda: str) -> None:
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "version.py").write_text(TORCH_VERSION_PY.format(cuda=cuda))
    real = importlib.metadata.distribution

    def distribution(name: str) -> object:
        return _FakeTorch(tmp_path) if name == "torch" else real(name)

    monkeypatch.setattr(qualification.runner.importlib.metadata, "distribution", distribution)


@pytest.mark.parametrize(("literal", "expected"), [("'12.8'", "12.8"), ("None", None)])
def test_the_record_names_torchs_cuda_version(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, literal: str, expected: str | None
) -> None:
    """qualification.md §9: a CUDA record carries the CUDA version (torch.version.cuda,
    here 12.8 from torch's version.py, read without importing torch); a CPU build says
    null rather than leaving the key out."""
    _with_torch(monkeypatch, tmp_path, literal)
    record = build_record(load_profile("cuda"), [], 3)
    accelerator = record["accelerator"]
    assert isinstance(accelerator, dict)
    assert accelerator["torch"] == "2.9.0+cu128"  # the fake torch is the one read
    assert "cuda" in accelerator and accelerator["cuda"] == expected


def test_a_replay_record_does_not_qualify_a_release(tmp_path: Path) -> None:
    """A copy of cpu-replay.toml whose ``accelerator`` reads "cuda" still ran the CPU
    replay (profile kind "replay"): its passing record is the CI gate, so release-check
    fails; the same record from a serve profile qualifies."""
    root = _tree(tmp_path)
    path = _record(tmp_path / "records")
    doc = json.loads(path.read_text())
    doc["profile"]["kind"] = "serve"
    path.write_text(json.dumps(doc))
    assert check_release(root, [tmp_path / "records"]).passed
    doc["profile"]["kind"] = "replay"
    path.write_text(json.dumps(doc))
    result = check_release(root, [tmp_path / "records"])
    assert not result.passed
    assert any("a CPU replay record is the CI gate" in p for p in result.problems), result


def test_an_ascend_record_names_every_part_of_its_host_and_the_image(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """qualification.md §1: the Ascend host is vLLM-HUST core plus vllm-ascend-hust, with
    exact commits and image digests recorded per lane: the record carries the Ascend
    plugin's version and commit, torch_npu's version and the declared image digest (null
    when undeclared, not left out); a digest with a line break is refused in one line."""
    site = tmp_path / "site"
    for name, version, extra in (
        ("vllm_ascend", "0.11.0rc1", {"direct_url.json": json.dumps(
            {"url": "https://example.invalid/vllm-ascend-hust.git",
             "vcs_info": {"vcs": "git", "commit_id": "abc123"}})}),
        ("torch_npu", "2.7.1", {}),
    ):
        info = site / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n")
        for file, text in extra.items():
            (info / file).write_text(text)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("QUALIFICATION_IMAGE_DIGEST", "sha256:" + "0" * 64)
    record = build_record(load_profile("ascend-tp4"), [], 3)
    accelerator = record["accelerator"]
    assert isinstance(accelerator, dict)
    assert accelerator["vllm_ascend"] == {"version": "0.11.0rc1", "commit": "abc123"}
    assert accelerator["torch_npu"] == "2.7.1"
    assert accelerator["image_digest"] == "sha256:" + "0" * 64
    cuda = build_record(load_profile("cuda"), [], 3)["accelerator"]
    assert isinstance(cuda, dict) and "vllm_ascend" not in cuda
    monkeypatch.delenv("QUALIFICATION_IMAGE_DIGEST")
    assert build_record(load_profile("cuda"), [], 3)["accelerator"]["image_digest"] is None  # type: ignore[index]
    monkeypatch.setenv("QUALIFICATION_IMAGE_DIGEST", "sha256:0\nforged line")
    with pytest.raises(QualificationError, match="QUALIFICATION_IMAGE_DIGEST"):
        build_record(load_profile("cuda"), [], 3)
