"""Guards the GPU profiles' launch plans (no GPU here): `run PROFILE --dry-run` renders the
exact `vllm serve` command, the per-arm environment, the tensor-parallel and graph-mode
flags and the KV budget, alternates arm order, and -- through the real `vllm-hust-ext
run --dry-run` -- shows the baseline unchanged and the candidate gaining the policy. The
record names the lane it ran (the declared host version and commit, whether the host lies
in the profile's range, the graph mode only when graphs are on, the repeats run). A
profile that breaks a rule of its schema (one KV budget, positive repeats and prompt
lengths, unique cells, the table its kind needs, a PEP 440 host range) is refused on load
with one line naming the rule."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qualification.cli import main
from qualification.errors import QualificationError
from qualification.profile import MAX_REPEATS, PROFILE_DIR, load_profile
from qualification.runner import launch_plan

MANAGER = shutil.which("vllm-hust-ext") or str(Path(sys.executable).parent / "vllm-hust-ext")
needs_manager = pytest.mark.skipif(
    not Path(MANAGER).is_file(), reason="vllm-hust-ext is not installed"
)

GRAPH = '{"cudagraph_mode":"FULL_DECODE_ONLY","cudagraph_capture_sizes":[1,2,4,8]}'
EXPECTED = {
    "ascend-tp4": (
        [
            "vllm",
            "serve",
            "Qwen3.8-27B",
            "--host",
            "127.0.0.1",
            "--port",
            "8000",
            "--tensor-parallel-size",
            "4",
            "--seed",
            "7",
            "--compilation-config",
            GRAPH,
            "--kv-cache-memory-bytes",
            "1073741824",
            "--max-model-len",
            "32768",
        ],
        {"ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3"},
    ),
    "cuda": (
        [
            "vllm",
            "serve",
            "meta-llama/Llama-3.1-8B-Instruct",
            "--host",
            "127.0.0.1",
            "--port",
            "8000",
            "--tensor-parallel-size",
            "1",
            "--seed",
            "7",
            "--compilation-config",
            GRAPH,
            "--kv-cache-memory-bytes",
            "2147483648",
            "--max-model-len",
            "8192",
        ],
        {"CUDA_VISIBLE_DEVICES": "0"},
    ),
}
POLICY_ENV = {
    "BIDKV_UTILITY_CASCADE_GAIN_RATIO": "1.25",
    "BIDKV_UTILITY_ENABLE": "1",
    "BIDKV_UTILITY_LIVENESS_PREEMPTIONS": "8",
    "BIDKV_UTILITY_STRATEGY": "bidkv",
    "VLLMHUST_EXT_ENABLED_BUNDLES": "org.vllm-hust.bidkv",
}


def _plan(profile: str, capsys: pytest.CaptureFixture[str], repeats: int = 2) -> dict[str, object]:
    assert main(["run", profile, "--dry-run", "--repeats", str(repeats)]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


@needs_manager
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_gpu_plan_is_exact(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    command, env = EXPECTED[name]
    plan = _plan(name, capsys)
    arms = plan["arms"]
    assert isinstance(arms, list)
    profile = load_profile(name)
    assert len(arms) == len(profile.cells) * 2 * 2
    for entry in arms:
        assert entry["command"] == command
        assert entry["manager_argv"][1:] == ["run", "--", *command]
        expected_env = dict(env)
        if entry["arm"] == "candidate":
            expected_env["VLLM_ENGINE_EXTRA_ENV_PREFIXES"] = "BIDKV_UTILITY_"
        assert entry["environment"] == expected_env
    # Order: (cell_index + repetition) % 2 == 0 -> baseline first.
    firsts = [(a["cell"], a["repetition"], a["arm"]) for a in arms[::2]]
    cells = [c.name for c in profile.cells]
    assert firsts == [
        (c, r, "baseline" if (i + r) % 2 == 0 else "candidate")
        for i, c in enumerate(cells)
        for r in range(2)
    ]
    rendered = plan["manager_dry_run"]
    # Baseline: bundle disabled, the manager launches the command unchanged.
    assert rendered["baseline"]["command"] == command
    assert rendered["baseline"]["environment"] == {"VLLMHUST_EXT_ENABLED_BUNDLES": ""}
    # Candidate on this machine: stock vLLM has no contract, so the manager fails closed.
    assert "refused" in rendered["candidate"]
    assert "lacks the vllm.preemption-policy contract" in rendered["candidate"]["refused"]


@needs_manager
def test_candidate_gains_policy_flag_and_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A host launched by a command other than `vllm serve` (here the module form) is
    # rendered like a vLLM-HUST host: the manager appends the policy flag.
    text = (PROFILE_DIR / "ascend-tp4.toml").read_text()
    module_cmd = '["python", "-m", "vllm.entrypoints.cli.main", "serve"]'
    variant = tmp_path / "ascend-module.toml"
    variant.write_text(text.replace('command = ["vllm", "serve"]', f"command = {module_cmd}"))
    plan = _plan(str(variant), capsys, repeats=1)
    command = ["python", "-m", "vllm.entrypoints.cli.main", *EXPECTED["ascend-tp4"][0][1:]]
    candidate = plan["manager_dry_run"]["candidate"]
    assert candidate["command"] == [
        *command,
        "--preemption-policy",
        "bidkv_ext.selector.BidkvPreemptionPolicy",
    ]
    assert candidate["environment"] == POLICY_ENV
    native = candidate["native_extension_manifests"]["org.vllm-hust.bidkv"]
    assert native["components"][0]["contracts"] == ["vllm.preemption-policy.v1"]
    assert plan["manager_dry_run"]["baseline"]["command"] == command


@needs_manager
def test_a_cuda_profile_on_stock_vllm_runs_the_candidate_through_the_adapter(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the README tells a stock-vLLM user: the cuda profile with ``scheduler_cls``
    naming our adapter and the contract version declared. The manager then launches the
    candidate (no refusal) with the policy in ``--additional-config`` and its environment;
    the baseline runs the same adapter with no policy."""
    text = (PROFILE_DIR / "cuda.toml").read_text()
    text = text.replace('command = ["vllm", "serve"]', 'command = ["vllm", "serve"]\n'
                        'scheduler_cls = "bidkv_ext.hosts.vllm.policy_scheduler"')
    text = text.replace("configuration = {}", 'configuration = { protocol_versions = { '
                        '"vllm.preemption-policy" = "1.0" } }')
    variant = tmp_path / "cuda-stock.toml"
    variant.write_text(text)
    rendered = _plan(str(variant), capsys, repeats=1)["manager_dry_run"]
    command = [*EXPECTED["cuda"][0], "--scheduler-cls", "bidkv_ext.hosts.vllm.policy_scheduler"]
    candidate = rendered["candidate"]
    assert "refused" not in candidate
    assert candidate["command"] == [
        *command, "--additional-config",
        '{"preemption_policy":"bidkv_ext.selector.BidkvPreemptionPolicy"}']
    assert candidate["environment"] == POLICY_ENV
    assert rendered["baseline"]["command"] == command


def test_eager_and_block_budget_variants(tmp_path: Path) -> None:
    from qualification.serve import serve_command

    text = (PROFILE_DIR / "cuda.toml").read_text()
    text = text.replace("kv_cache_memory_bytes = 2147483648", "num_gpu_blocks_override = 512")
    text = text.replace("[server]\n", '[server]\nenforce_eager = true\nscheduler_cls = "a.B"\n')
    variant = tmp_path / "eager.toml"
    variant.write_text(text)
    argv = serve_command(load_profile(str(variant)))
    assert "--enforce-eager" in argv and "--compilation-config" not in argv
    assert argv[argv.index("--num-gpu-blocks-override") + 1] == "512"
    assert argv[argv.index("--scheduler-cls") + 1] == "a.B"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name = 'x'\n", "kind"),
        ("not toml [", "cannot be read as TOML"),
    ],
)
def test_bad_profile_is_one_line(
    tmp_path: Path, text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    assert main(["run", str(bad), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qualification: error: profile ") and message in err
    assert err.count("\n") == 1


def test_unknown_profile_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "no-such-profile", "--dry-run"]) == 2
    assert "expected one of" in capsys.readouterr().err
    # A .toml argument is a path, never a bundled name.
    assert main(["run", "no-such-profile.toml", "--dry-run"]) == 2
    assert "no such file no-such-profile.toml;" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_profile_path_that_is_not_a_regular_file(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory or FIFO given as the profile is named as such (not "no such file"), and
    the FIFO is never opened, so nothing waits on it."""
    path = tmp_path / "p.toml"
    path.mkdir() if kind == "directory" else os.mkfifo(path)
    assert main(["run", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"not a regular file {path};" in err and err.count("\n") == 1


_CPU_CELL = '[[cells]]\nname = "azure-conv-30s"\n'


@pytest.mark.parametrize(
    ("base", "old", "new", "message"),
    [
        ("cuda", "kv_cache_memory_bytes = 2147483648\n",
         "kv_cache_memory_bytes = 2147483648\nnum_gpu_blocks_override = 512\n",
         "server: Value error, set kv_cache_memory_bytes or num_gpu_blocks_override, not both"),
        ("cuda", "paragraph_repeats = [80]", "paragraph_repeats = [80, 0]",
         "cells.0.paragraph_repeats: Value error, paragraph_repeats must be positive"),
        ("cuda", "paragraph_repeats = [80]\n", "",
         "<top level>: Value error, every serve cell needs paragraph_repeats"),
        ("cuda", 'name = "homogeneous-ultralong"', 'name = "homogeneous-long"',
         "<top level>: Value error, cell names must be unique"),
        ("cuda", 'kind = "serve"', 'kind = "replay"',
         "<top level>: Value error, a replay profile needs a [replay] table"),
        ("cpu-replay", 'kind = "replay"', 'kind = "serve"',
         "<top level>: Value error, a serve profile needs a [server] table"),
        ("cpu-replay", "repeats = 3", "repeats = 0", "repeats: Input should be greater than 0"),
        ("cpu-replay", 'host_version_range = ">=0.33.0,<0.34"', 'host_version_range = "0.33"',
         "host_version_range: Value error, not a PEP 440 specifier set: '0.33'"),
    ],
)
def test_a_profile_breaking_a_rule_is_refused_on_load(
    tmp_path: Path, base: str, old: str, new: str, message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = (PROFILE_DIR / f"{base}.toml").read_text()
    assert old in text
    variant = tmp_path / "variant.toml"
    variant.write_text(text.replace(old, new, 1))
    assert main(["run", str(variant), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"qualification: error: profile {variant}: {message}"), err
    assert err.count("\n") == 1


def test_a_profile_without_cells_is_refused(tmp_path: Path) -> None:
    """A verdict applies to one cell: a profile must name at least one."""
    text = (PROFILE_DIR / "cpu-replay.toml").read_text().replace(_CPU_CELL, "")
    variant = tmp_path / "empty.toml"
    variant.write_text(text.replace("[manager]\n", "cells = []\n\n[manager]\n", 1))
    with pytest.raises(QualificationError, match="cells: Tuple should have at least 1 item"):
        load_profile(str(variant))


def test_out_must_not_be_an_existing_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `run --out FILE` is bad input named on one line, not a FileExistsError traceback.
    existing = tmp_path / "afile"
    existing.write_text("")
    assert main(["run", "cpu-replay", "--out", str(existing), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"qualification: error: --out {existing}: exists and is not a directory; "
        "expected a directory or a new path\n"
    )


@pytest.mark.parametrize("placeholder", ["{seed.real}", "{nope}", "{0}", "{"])
def test_bad_replay_placeholder_is_a_profile_error(
    tmp_path: Path, placeholder: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Attribute/index access in a replay argument used to escape as AttributeError.
    text = (PROFILE_DIR / "cpu-replay.toml").read_text()
    variant = tmp_path / "placeholder.toml"
    variant.write_text(text.replace('"--seed", "{seed}"', f'"--seed", "{placeholder}"'))
    assert main(["run", str(variant), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qualification: error: profile cpu-replay: replay argument ")
    assert repr(placeholder) in err and "expected plain {name}" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("(rank=(\\d+)", "not a valid regular expression"),
        ("rank=\\d+", "exactly one group capturing the rank, got 0"),
        ("(rank=)(\\d+)", "exactly one group capturing the rank, got 2"),
    ],
)
def test_tp_rank_pattern_is_checked_on_load(
    tmp_path: Path, pattern: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # An unusable tp_rank_pattern fails at load, not as re.error after the serve run.
    text = (PROFILE_DIR / "ascend-tp4.toml").read_text()
    old = "tp_rank_pattern = '(?:rank=|tp_rank=|TP rank )(\\d+)'"
    assert old in text
    variant = tmp_path / "rank.toml"
    variant.write_text(text.replace(old, f"tp_rank_pattern = '{pattern}'"))
    assert main(["run", str(variant), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"qualification: error: profile {variant}: server.tp_rank_pattern: ")
    assert message in err and err.count("\n") == 1


def test_gpu_profiles_carry_the_same_cells_and_recovery_text() -> None:
    """qualification.md §9: the CUDA lane runs the Ascend lane's cells (same names, same
    order) and both check the recovery request's exact text, not only its HTTP 200."""
    cuda, ascend = load_profile("cuda"), load_profile("ascend-tp4")
    assert [c.name for c in cuda.cells] == [c.name for c in ascend.cells]
    assert len(cuda.cells) == 6
    for profile in (cuda, ascend):
        assert profile.workload.recovery_expected == "BIDKV_MATRIX_CANCEL_RECOVERY_OK"


def test_record_hashes_the_profile_file_actually_loaded(tmp_path: Path) -> None:
    """A modified copy that keeps the bundled name must not be recorded under the bundled
    file's sha256: the record names the definition that ran."""
    import hashlib

    from qualification.runner import build_record

    bundled = PROFILE_DIR / "cpu-replay.toml"
    copy = tmp_path / "mine.toml"
    copy.write_text(bundled.read_text().replace("repeats = 3", "repeats = 4"))
    profile = load_profile(str(copy))
    assert profile.name == "cpu-replay"
    record = build_record(profile, [], profile.repeats)
    digest = record["profile"]["sha256"]  # type: ignore[index]
    assert digest == hashlib.sha256(copy.read_bytes()).hexdigest()
    assert digest != hashlib.sha256(bundled.read_bytes()).hexdigest()
    assert load_profile("cpu-replay").source_sha256 == hashlib.sha256(
        bundled.read_bytes()
    ).hexdigest()


@pytest.mark.parametrize("field", ["", "Version: \n"])
def test_an_installed_host_without_a_version_is_recorded_as_unknown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str
) -> None:
    """With no declared host_version the record reads the installed vLLM's METADATA; a
    missing or empty Version is an unknown version (null, range unknown), not ``""`` judged
    outside the profile's range."""
    from qualification.runner import build_record

    info = tmp_path / "site" / "vllm-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\n{field}")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    record = build_record(load_profile(str(PROFILE_DIR / "cuda.toml")), [], 1)
    assert record["host"]["version"] is None  # type: ignore[index]
    assert record["host"]["in_profile_range"] is None  # type: ignore[index]


@pytest.mark.parametrize(
    ("host_version", "in_range"),
    [("0.28.1rc1.dev391", True), ("0.34.0", False), ("custom-build", False)],
)
def test_record_names_the_declared_host_and_the_lane(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host_version: str, in_range: bool
) -> None:
    """A declared host_version (the host is not installed here) and VLLM_HUST_COMMIT are
    what the record names; an unparsable version is not in range; an eager profile records
    no graph mode; `repeats` is the number run, not the profile's default."""
    from qualification.runner import build_record

    text = (PROFILE_DIR / "cuda.toml").read_text()
    text = text.replace('execution_mode = "graph"\n',
                        f'execution_mode = "graph"\nhost_version = "{host_version}"\n')
    variant = tmp_path / "declared.toml"
    variant.write_text(text)
    monkeypatch.setenv("VLLM_HUST_COMMIT", "a4d6aa02")
    record = build_record(load_profile(str(variant)), [], 5)
    assert record["host"]["version"] == host_version  # type: ignore[index]
    assert record["host"]["in_profile_range"] is in_range  # type: ignore[index]
    assert record["host"]["commit"] == "a4d6aa02"  # type: ignore[index]
    assert record["profile"]["graph_mode"] == "FULL_DECODE_ONLY"  # type: ignore[index]
    assert record["profile"]["repeats"] == 5  # type: ignore[index]
    variant.write_text(text.replace("[server]\n", "[server]\nenforce_eager = true\n", 1))
    eager = build_record(load_profile(str(variant)), [], 3)
    assert eager["profile"]["graph_mode"] is None  # type: ignore[index]


def _dry_run(*argv: str) -> subprocess.CompletedProcess[str]:
    """`python -m qualification run --dry-run ...` as a real process (bounded: a hang fails)."""
    return subprocess.run(
        [sys.executable, "-m", "qualification", "run", "--dry-run", *argv],
        capture_output=True, text=True, timeout=60, check=False,
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("repeats = 1" + "0" * 5000 + "\n", "value has 5001 digits"),
        ("x = " + "[" * 100_000 + "]" * 100_000 + "\n", "nested too deeply"),
    ],
)
def test_hostile_profile_is_one_line(tmp_path: Path, text: str, message: str) -> None:
    """An integer over Python's 4300-digit limit (a plain ValueError from tomllib) and deep
    nesting (RecursionError) are profile errors naming the file, not tracebacks."""
    bad = tmp_path / "hostile.toml"
    bad.write_text(text)
    proc = _dry_run(str(bad))
    assert proc.returncode == 2, proc.stderr[-500:]
    assert proc.stderr.startswith(f"qualification: error: profile {bad}: cannot be read as TOML")
    assert message in proc.stderr and proc.stderr.count("\n") == 1


@pytest.mark.parametrize("repeats", ["99999999999999999999", str(MAX_REPEATS + 1), "0"])
def test_absurd_repeats_option_is_refused_at_once(repeats: str) -> None:
    proc = _dry_run("cpu-replay", "--repeats", repeats)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (
        f"qualification: error: --repeats {repeats} is invalid: expected an integer from 1 to "
        f"{MAX_REPEATS} (pairs per cell)\n"
    )


def test_absurd_profile_repeats_is_refused(tmp_path: Path) -> None:
    text = (PROFILE_DIR / "cpu-replay.toml").read_text()
    variant = tmp_path / "many.toml"
    variant.write_text(text.replace("repeats = 3", f"repeats = {MAX_REPEATS + 1}", 1))
    proc = _dry_run(str(variant))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert f"repeats: Input should be less than or equal to {MAX_REPEATS}" in proc.stderr


def test_the_largest_repeats_still_plans() -> None:
    plan = launch_plan(load_profile("cpu-replay"), repeats=MAX_REPEATS)
    assert plan["repeats"] == MAX_REPEATS


@needs_manager
def test_the_largest_repeats_option_is_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    assert _plan("cpu-replay", capsys, repeats=MAX_REPEATS)["repeats"] == MAX_REPEATS


def test_profiles_lists_the_bundled_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profiles"]) == 0
    assert capsys.readouterr().out.splitlines() == sorted(
        p.stem for p in PROFILE_DIR.glob("*.toml"))


def test_an_interrupted_run_is_one_line_and_exit_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C is the shell's 128 + SIGINT with one line, not a KeyboardInterrupt traceback."""
    import qualification.cli

    def interrupt(_name: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(qualification.cli, "load_profile", interrupt)
    assert main(["run", "cpu-replay", "--dry-run"]) == 130
    assert capsys.readouterr().err == "qualification: interrupted\n"


@needs_manager
def test_each_arm_hands_the_manager_its_shutdown_grace(tmp_path: Path) -> None:
    from qualification.manager import ManagerSession

    profile = load_profile("cpu-replay")
    session = ManagerSession(profile.manager, tmp_path, {})
    program = session.program
    assert session.run_argv(["bidkv-replay"]) == [
        *program, "run", "--shutdown-grace-seconds", "10", "--", "bidkv-replay"]
    assert session.run_argv(["bidkv-replay"], dry_run=True) == [
        *program, "run", "--dry-run", "--", "bidkv-replay"]
