"""Bad input to ``bidkv-replay`` fails up front with one line and exit 2.

Every case here must be refused before the first engine starts (so none of these tests
runs a replay, except the one that needs finished results to lose): the message is one
``bidkv-replay: error: ...`` line naming the flag, file (and line) or setting, there is no
traceback, and a refused run leaves no output directory behind. Also: report files and
plots are written atomically with the umask's mode; JSON files hold NaN as null with sorted
keys; the plots skip an arm without TTFT samples.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bidkv_ext.replay import cli
from bidkv_ext.replay.cli import main
from bidkv_ext.replay.report import atomic_output, write_atomic, write_json

MOONCAKE_ROW = '{"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [0, 1]}\n'
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
AZURE_ROW = "2023-11-16 18:15:46.6805900,374,44\n"
QUICK = ["--policies", "builtin", "--duration", "5", "--num-gpu-blocks", "400", "--no-progress"]


def _refused(capsys: pytest.CaptureFixture[str], tmp_path: Path, *argv: str,
             plots: bool = False) -> str:
    """Run the CLI expecting a usage error; return its single stderr line."""
    out = tmp_path / "out"
    args = [*QUICK, *([] if plots else ["--no-plots"]), "--output-dir", str(out), *argv]
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bidkv-replay: error: "), err
    return lines[0]


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- 1. Mooncake timestamps and lengths ------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("timestamp", "NaN"),
        ("timestamp", "Infinity"),
        ("timestamp", "-Infinity"),
        ("timestamp", "1e999"),
        ("timestamp", "1" + "0" * 400),
        ("timestamp", '"5"'),
        ("input_length", '"600"'),
        ("input_length", "NaN"),
        ("output_length", "Infinity"),
    ],
)
def test_mooncake_non_finite_or_text_values_name_file_and_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, field: str, value: str
) -> None:
    """NaN/Infinity/1e999/huge-int timestamps and string or non-finite lengths are refused
    with file:line and the field (json.loads accepts them; NaN rows used to vanish)."""
    row = {"timestamp": "5", "input_length": "600", "output_length": "10"}
    row[field] = value
    line = "{" + ", ".join(f'"{k}": {v}' for k, v in row.items()) + ', "hash_ids": [0, 1]}\n'
    path = _write(tmp_path, "m.jsonl", MOONCAKE_ROW + line)
    message = _refused(capsys, tmp_path, "--trace", str(path))
    assert f"{path}:2: {field} must be" in message
    assert not (tmp_path / "out").exists()


def test_mooncake_deeply_nested_line_is_one_line_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A trace line nested deeper than the JSON parser's recursion limit is bad input."""
    path = _write(tmp_path, "m.jsonl", MOONCAKE_ROW + "[" * 100_000 + "]" * 100_000 + "\n")
    assert f"{path}:2: JSON nested too deeply" in _refused(capsys, tmp_path, "--trace", str(path))


# --- 9. Azure token counts, 8. CSV field limit -----------------------------------------


@pytest.mark.parametrize("count", ["--5", "²", "٣", "1_000", "5" * 5000])
def test_azure_token_counts_must_be_ascii_integers(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, count: str
) -> None:
    """Counts that pass str.isdigit() but not int() (or exceed int()'s digit limit) are
    refused naming file, line and column instead of int()'s bare message."""
    path = _write(tmp_path, "a.csv", AZURE_HEADER + f"2023-11-16 18:15:46.6805900,{count},44\n")
    message = _refused(capsys, tmp_path, "--trace", str(path))
    assert f"{path}:2: ContextTokens must be an integer >= 1" in message
    assert len(message) < 300


def test_azure_field_over_csv_limit_names_file_and_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A CSV field larger than csv.field_size_limit() is a one-line error, not _csv.Error."""
    huge = "x" * (csv.field_size_limit() + 10)
    path = _write(tmp_path, "a.csv", AZURE_HEADER + AZURE_ROW + f"{huge},1,1\n")
    message = _refused(capsys, tmp_path, "--trace", str(path))
    assert f"{path}:3: not valid CSV (field larger than field limit" in message


def test_capacity_schedule_csv_field_over_limit_and_deep_json(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """--capacity-schedule: an oversized CSV field and over-deep JSON name the file."""
    huge = _write(tmp_path, "c.csv", "t,blocks\n0," + "9" * (csv.field_size_limit() + 1) + "\n")
    message = _refused(capsys, tmp_path, "--capacity-schedule", str(huge))
    assert str(huge) in message and "not valid CSV" in message
    deep = _write(tmp_path, "c.json", "[" * 100_000 + "]" * 100_000)
    message = _refused(capsys, tmp_path, "--capacity-schedule", str(deep))
    assert f"{deep}: JSON nested too deeply" in message


def test_a_final_capacity_below_a_late_request_is_refused_before_any_arm(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A request that arrives after a capacity schedule's last change and needs more blocks
    than that last capacity stalls every arm: the schedule is refused up front (it used to
    stop the run inside an arm, losing those before it). The least capacity it asks for
    holds every such request, not only the first (which led from one refusal to the next);
    with that capacity the run completes."""
    rows = ({"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0]},
            {"timestamp": 3000, "input_length": 150, "output_length": 100, "hash_ids": [1]},
            {"timestamp": 3100, "input_length": 200, "output_length": 100, "hash_ids": [2]})
    trace = _write(tmp_path, "three.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    # Request 1 holds ceil((150 + 100 - 1) / 16) = 16 blocks, request 2 ceil(299 / 16) = 19.
    low = _write(tmp_path, "low.json", '[{"t": 1.0, "blocks": 15}]')
    message = _refused(capsys, tmp_path, "--trace", str(trace), "--num-gpu-blocks", "21",
                       "--policies", "least-computed-first,builtin",
                       "--capacity-schedule", str(low))
    assert message == (
        f"bidkv-replay: error: --capacity-schedule {low}: its final capacity of 15 blocks "
        "cannot hold request 1 (150 prompt + 100 output tokens, 16 blocks of 16 tokens) and "
        "1 more, arriving after the last change, so every arm would stall; expected a final "
        "capacity of at least 19 blocks, or a window without them")
    assert not (tmp_path / "out").exists()
    almost = _write(tmp_path, "almost.json", '[{"t": 1.0, "blocks": 18}]')
    message = _refused(capsys, tmp_path, "--trace", str(trace), "--num-gpu-blocks", "21",
                       "--policies", "least-computed-first,builtin",
                       "--capacity-schedule", str(almost))
    assert "cannot hold request 2 (200 prompt + 100 output tokens, 19 blocks" in message
    assert "at least 19 blocks" in message
    enough = _write(tmp_path, "enough.json", '[{"t": 1.0, "blocks": 19}]')
    out = tmp_path / "ran"
    code = main(["--trace", str(trace), "--num-gpu-blocks", "21", "--no-plots",
                 "--no-progress", "--policies", "least-computed-first,builtin",
                 "--capacity-schedule", str(enough), "--output-dir", str(out)])
    assert code == 0, capsys.readouterr().err
    arms = json.loads((out / "report.json").read_text())["arms"]
    assert [arm["completed"] for arm in arms] == [3, 3]


_STALLED = ("bidkv-replay: error: arm 'largest-first' stopped: the scheduler cannot make "
            "progress: request 0 (150 prompt + 100 output tokens) needs more KV blocks than "
            "the capacity schedule's final 15 blocks provide")


@pytest.mark.parametrize(("policies", "kept"), [
    ("least-computed-first,largest-first", ["least-computed-first"]),
    ("largest-first,least-computed-first", []),
])
def test_an_arm_that_stalls_keeps_the_arms_before_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, policies: str, kept: list[str]
) -> None:
    """Whether a request larger than the last capacity is still unfinished at the last
    change depends on the policy: here least-computed-first finishes it in time and
    largest-first (which preempts it) does not. The run stops at the stalled arm with exit
    2 and one line naming it, and the outputs hold the arms before it (they used to hold
    nothing, losing the finished arm); with none before it, no report is written, and the
    arm is still named (it was not)."""
    rows = ({"timestamp": 0, "input_length": 150, "output_length": 100, "hash_ids": [0]},
            {"timestamp": 100, "input_length": 60, "output_length": 60, "hash_ids": [1]},
            {"timestamp": 200, "input_length": 60, "output_length": 60, "hash_ids": [2]})
    trace = _write(tmp_path, "three.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    schedule = _write(tmp_path, "shrink.json", '[{"t": 0.7, "blocks": 15}]')
    out = tmp_path / "out"
    code = main(["--trace", str(trace), "--num-gpu-blocks", "21", "--no-plots",
                 "--no-progress", "--policies", policies,
                 "--capacity-schedule", str(schedule), "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    held = f"; the outputs hold the {len(kept)} arm(s) before it" if kept else ""
    assert err.strip().splitlines()[-1] == _STALLED + held
    if not kept:
        assert not (out / "report.json").exists()
        return
    arms = json.loads((out / "report.json").read_text())["arms"]
    assert [(arm["label"], arm["completed"]) for arm in arms] == [(k, 3) for k in kept]


@pytest.mark.parametrize("policies", ["bidkv", "builtin,bidkv{liveness_preemptions=0}"])
@pytest.mark.parametrize("section", ['"enabled=false"', "[1]", "7"])
def test_a_bidkv_section_that_is_not_an_object_is_refused_for_named_arms(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, policies: str, section: str
) -> None:
    """``--additional-config '{"bidkv": <not an object>}'`` was refused for a
    ``--preemption-policy`` arm but silently replaced for ``--policies`` arms, whose report
    still recorded it as the configuration used. Every arm refuses it now."""
    message = _refused(capsys, tmp_path, "--policies", policies,
                       "--additional-config", f'{{"bidkv": {section}}}')
    assert message == "bidkv-replay: error: additional_config['bidkv'] must be a JSON object"


def test_additional_config_and_step_model_nested_too_deeply(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Over-deep JSON in --additional-config and --step-model is a one-line error."""
    deep = "[" * 20_000 + "]" * 20_000
    message = _refused(capsys, tmp_path, "--additional-config", deep)
    assert message.endswith("--additional-config: JSON nested too deeply; expected a JSON object")
    path = _write(tmp_path, "model.json", deep)
    assert f"{path}: JSON/TOML nested too deeply" in _refused(
        capsys, tmp_path, "--step-model", str(path)
    )


# --- 4. float flags and the step model ------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--duration", "inf"),
        ("--duration", "nan"),
        ("--start", "nan"),
        ("--start", "inf"),
        ("--start", "-1"),
        ("--rate-scale", "inf"),
        ("--rate-scale", "nan"),
        ("--seed", "-1"),
    ],
)
def test_numeric_flags_are_checked_up_front(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flag: str, value: str
) -> None:
    """Non-finite or out-of-range --duration/--start/--rate-scale and a negative --seed
    are refused before the engine, naming the flag (argparse's float() takes nan/inf)."""
    message = _refused(capsys, tmp_path, f"{flag}={value}")
    assert f"error: {flag} must be" in message


def test_batched_tokens_below_max_num_seqs_is_refused_up_front(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """vLLM's max_num_batched_tokens >= max_num_seqs rule fails as one line, not pydantic's
    multi-line ValidationError after engine start."""
    message = _refused(capsys, tmp_path, "--max-num-batched-tokens", "16")
    assert "--max-num-batched-tokens (16) must be >= --max-num-seqs (256)" in message


@pytest.mark.parametrize("value", ["Infinity", "NaN", "1e999"])
def test_step_model_coefficients_must_be_finite(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, value: str
) -> None:
    """A --step-model file with an infinite/NaN coefficient is refused naming file and key."""
    path = _write(tmp_path, "m.json", f'{{"name": "x", "a": 0.001, "b": {value}, "c": 0, "d": 0}}')
    message = _refused(capsys, tmp_path, "--step-model", str(path))
    assert f"{path}: b: Input should be a finite number" in message


# --- 2. output directory --------------------------------------------------------------


def test_output_dir_that_is_a_file_or_under_a_file_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """--output-dir naming a regular file, or a path under one, fails before any replay."""
    regular = _write(tmp_path, "regular", "keep me")
    message = _refused(capsys, tmp_path, "--output-dir", str(regular))
    assert f"--output-dir {str(regular)!r} exists and is not a directory" in message
    message = _refused(capsys, tmp_path, "--output-dir", str(regular / "sub"))
    assert f"--output-dir {str(regular / 'sub')!r}: cannot create the directory" in message
    assert regular.read_text() == "keep me"


@pytest.mark.parametrize(("name", "plots"), [("report.json", False), ("bars.png", True)])
def test_output_name_that_is_a_directory_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str, plots: bool
) -> None:
    """An output file's name taken by a directory (os.replace cannot overwrite it) fails
    before any replay, naming the flag and the file."""
    out = tmp_path / "o"
    (out / name).mkdir(parents=True)
    message = _refused(capsys, tmp_path, "--output-dir", str(out), plots=plots)
    assert f"--output-dir {str(out)!r}: {name} in it is a directory" in message


def test_unwritable_output_dir_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A directory that exists but does not accept files fails before any replay. Root
    writes into a read-only directory, so as root the directory is sysfs's ``/sys/kernel``,
    which refuses new files to everyone."""
    if os.geteuid() != 0:
        out = tmp_path / "ro"
        out.mkdir()
        out.chmod(0o555)
    else:
        out = Path("/sys/kernel")
        if not out.is_dir():
            pytest.skip("no sysfs: no directory refuses root a new file here")
    try:
        message = _refused(capsys, tmp_path, "--output-dir", str(out))
    finally:
        if out.parent == tmp_path:
            out.chmod(0o755)
    assert f"--output-dir {str(out)!r}: cannot write there" in message


# --- 3. policy objects ----------------------------------------------------------------


@pytest.fixture
def policy_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An importable module with assorted non-policies; returns its name."""
    (tmp_path / "replay_probe_policies.py").write_text(
        "class NeedsArgs:\n"
        "    def __init__(self, weight):\n"
        "        self.weight = weight\n"
        "    def select_victim(self, context):\n"
        "        return None\n"
        "class NoSelect:\n"
        "    pass\n"
    )
    (tmp_path / "replay_probe_broken.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "replay_probe_policies"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--preemption-policy", "no.such.Module"],
         "--preemption-policy 'no.such.Module' cannot be imported: ModuleNotFoundError"),
        (["--preemption-policy", "os.NoSuchThing"],
         "--preemption-policy 'os.NoSuchThing' cannot be imported: AttributeError"),
        (["--policy-class", "os:path"],
         "--policy-class 'os:path': module posixpath is not a preemption policy"),
        (["--policy-class", "replay_probe_policies:NoSelect"],
         "--policy-class 'replay_probe_policies:NoSelect': class NoSelect has no select_victim"),
        (["--policy-class", "replay_probe_policies:NeedsArgs"],
         "--policy-class 'replay_probe_policies:NeedsArgs': class NeedsArgs cannot be built "
         "without arguments"),
        (["--policy-class", "replay_probe_broken:X"],
         "--policy-class 'replay_probe_broken:X' cannot be imported: RuntimeError: boom"),
    ],
)
def test_policy_objects_are_resolved_before_any_engine(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, policy_module: str, argv: list[str],
    expected: str,
) -> None:
    """--preemption-policy/--policy-class that cannot be imported or cannot become a policy
    fail up front naming the flag (they used to raise after the engine started)."""
    assert expected in _refused(capsys, tmp_path, *argv)
    assert not (tmp_path / "out").exists()


def test_unimportable_preemption_policy_in_a_subprocess_prints_one_line(tmp_path: Path) -> None:
    """End to end through the real entry: exit 2, one stderr line, no traceback."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "bidkv_ext.replay.cli", *QUICK, "--preemption-policy",
         "no.such.Module", "--output-dir", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "bidkv-replay: error: --preemption-policy 'no.such.Module' cannot be imported: "
        "ModuleNotFoundError: No module named 'no'"
    ]


# --- 5. per-arm settings --------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("bidkv{nope=1}", "nope is not a BidKV setting; accepted: "),
        ("bidkv{liveness_preemptions=abc}", "liveness_preemptions='abc' is invalid"),
        ("bidkv{strategy=nope}", "strategy='nope' is invalid: unknown strategy"),
        ("bidkv{preempt_weight=NaN}", "preempt_weight=nan is invalid"),
        ("lcf{cascade_gain_ratio=0.5}", "cascade_gain_ratio=0.5 is invalid"),
        ("clairvoyant{x=1}", "clairvoyant takes no settings"),
        ("bidkv-0.2.1{x=1}", "bidkv-0.2.1 takes no settings"),
    ],
)
def test_every_arm_is_validated_before_the_first_runs_naming_the_spec(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, spec: str, expected: str
) -> None:
    """A bad override in a later arm fails before the first arm runs, and the message names
    the --policies entry the user wrote (not additional_config['bidkv'])."""
    message = _refused(capsys, tmp_path, "--policies", f"builtin,{spec}")
    assert message.startswith(f"bidkv-replay: error: --policies {spec!r}: {expected}")
    assert "additional_config" not in message
    assert not (tmp_path / "out").exists()


def test_environment_and_additional_config_are_validated_up_front(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BIDKV_UTILITY_* and --additional-config errors surface before any engine, naming the
    variable or key, also for a host-loaded selector arm."""
    monkeypatch.setenv("BIDKV_UTILITY_TYPO", "1")
    message = _refused(capsys, tmp_path)
    assert message.startswith("bidkv-replay: error: BIDKV_UTILITY_TYPO is not a BidKV setting")
    monkeypatch.delenv("BIDKV_UTILITY_TYPO")
    message = _refused(
        capsys, tmp_path, "--policies", "", "--preemption-policy",
        "bidkv_ext.selector.BidkvPreemptionPolicy",
        "--additional-config", json.dumps({"bidkv": {"zz": 1}}),
    )
    assert "additional_config['bidkv']['zz'] is not a BidKV setting" in message


@pytest.mark.parametrize(
    ("variable", "raw", "policies"),
    [
        ("BIDKV_UTILITY_ENABLE", "maybe", "bidkv"),
        ("BIDKV_UTILITY_STRATEGY", "nonsense", "bidkv"),
        ("BIDKV_UTILITY_LIVENESS_PREEMPTIONS", "-5", "lcf"),
        ("BIDKV_UTILITY_BLOCK_SIZE", "abc", "bidkv"),
    ],
)
def test_a_malformed_variable_an_arm_replaces_is_still_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    variable: str, raw: str, policies: str,
) -> None:
    """Every arm sets ``enabled`` and ``strategy`` (peers also the liveness guard off) and
    the engine sets the block size: a malformed BIDKV_UTILITY_* value they replace would
    otherwise pass unseen, where the same variable fails a host-loaded selector."""
    monkeypatch.setenv(variable, raw)
    message = _refused(capsys, tmp_path, "--policies", policies)
    assert message.startswith(f"bidkv-replay: error: {variable}={raw!r} is invalid"), message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("section", "policies", "expected"),
    [
        ({"enabled": "maybe"}, "bidkv,lifo", "['enabled']='maybe' is invalid"),
        ({"kill_switch": "garbage"}, "bidkv", "['kill_switch']='garbage' is invalid"),
        ({"strategy": "nope"}, "bidkv", "['strategy']='nope' is invalid"),
        ({"seed": 1.5}, "random", "['seed']=1.5 is invalid"),
        ({"liveness_preemptions": -3}, "lcf", "['liveness_preemptions']=-3 is invalid"),
        ({"preempt_weight": -1}, "bidkv{preempt_weight=1}", "['preempt_weight']=-1 is invalid"),
    ],
)
def test_a_malformed_shared_value_an_arm_replaces_is_still_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path,
    section: dict[str, object], policies: str, expected: str,
) -> None:
    """Every arm writes its own ``enabled``, ``strategy``, ``kill_switch`` and ``seed``
    (and its ``{...}`` settings) over ``additional_config["bidkv"]`` before the engine reads
    it, so a malformed shared value for one of those keys never reached a check and the
    replay ran (``{"bidkv": {"enabled": "maybe"}}`` exited 0). Like a malformed
    BIDKV_UTILITY_* value an arm replaces, it is refused, naming its key, before any arm."""
    message = _refused(capsys, tmp_path, "--policies", policies,
                       "--additional-config", json.dumps({"bidkv": section}))
    assert message.startswith(f"bidkv-replay: error: additional_config['bidkv']{expected}")
    assert not (tmp_path / "out").exists()


def test_arm_settings_replace_well_formed_shared_values(tmp_path: Path) -> None:
    """Precedence still picks among well-formed values: an arm's settings replace the
    shared section's without a refusal, and the engine reads the arm's."""
    from bidkv_ext.replay.arms import arm_config, check_arms, parse_arms

    arms = parse_arms("bidkv{preempt_weight=1},lcf", preemption_policy=None,
                      policy_classes=[], seed=0)
    shared = {"bidkv": {"preempt_weight": 3, "strategy": "random", "enabled": False}}
    check_arms(arms, shared, environ={}, block_size=16, prefix_caching=True)
    config = arm_config(arms[0], shared, environ={}, block_size=16, prefix_caching=True)
    assert (config.preempt_weight, config.strategy, config.enabled) == (1.0, "bidkv", True)


# --- 7. atomic writes -----------------------------------------------------------------


@pytest.mark.parametrize(("mask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_writes_get_the_umask_mode(tmp_path: Path, mask: int, mode: int) -> None:
    """report.json/timing.json/report.md get 0o666 & ~umask (not mkstemp's 0600)."""
    old = os.umask(mask)
    try:
        write_json(tmp_path / "report.json", {"a": 1})
        write_atomic(tmp_path / "report.md", b"x")
    finally:
        os.umask(old)
    for name in ("report.json", "report.md"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == mode


def test_atomic_output_failure_keeps_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    """A write that fails midway leaves the previous file intact and no temporary behind."""
    target = _write(tmp_path, "report.md", "old")
    with pytest.raises(RuntimeError), atomic_output(target) as handle:
        handle.write(b"half")
        raise RuntimeError("disk full")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md"]


def test_plots_are_atomic_and_a_directory_target_is_an_oserror(
    tmp_path: Path, umask_022: None
) -> None:
    """Each PNG goes through a temporary file + os.replace: a target that is a directory
    raises OSError (the CLI's one-line error) and leaves no partial or temporary file."""
    from bidkv_ext.replay.report import write_plots

    arms = [{"label": "a", "recompute_tax": 0.1, "ttft_s": {"p95": 0.5}}]
    write_plots(tmp_path, [("a", [0.1, 0.2])], arms)
    for name in ("ttft_cdf.png", "bars.png"):
        png = tmp_path / name
        assert png.read_bytes().startswith(b"\x89PNG")
        assert stat.S_IMODE(png.stat().st_mode) == 0o644
    (tmp_path / "ttft_cdf.png").unlink()
    (tmp_path / "ttft_cdf.png").mkdir()
    (tmp_path / "bars.png").unlink()
    with pytest.raises(IsADirectoryError):
        write_plots(tmp_path, [("a", [0.1, 0.2])], arms)
    # The other plot is still written; nothing partial or temporary is left.
    assert (tmp_path / "bars.png").read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bars.png", "ttft_cdf.png"]


def test_output_failure_after_the_replay_keeps_the_results(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If a file cannot be written after all (the directory changed during the replay),
    the table is already on stdout, every other file is still written, and the error is
    one line naming the file (runs one short replay)."""
    out = tmp_path / "o"
    (out / "ttft_cdf.png").mkdir(parents=True)
    monkeypatch.setattr(cli, "prepare_output_dir", lambda *_args: None)
    code = main([*QUICK, "--output-dir", str(out)])
    captured = capsys.readouterr()
    assert code == 2
    assert "Traceback" not in captured.err
    errors = [line for line in captured.err.splitlines() if line.startswith("bidkv-replay:")]
    assert errors == [f"bidkv-replay: error: cannot write {out / 'ttft_cdf.png'}: Is a directory"]
    assert "builtin" in captured.out and "TTFT p50" in captured.out
    assert json.loads((out / "report.json").read_text())["arms"][0]["label"] == "builtin"
    assert (out / "report.md").exists() and (out / "bars.png").exists()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_json_writes_nan_as_null_with_sorted_keys(tmp_path: Path) -> None:
    """write_json: NaN (a missing figure) becomes null, inside mappings, lists and tuples
    too; keys are sorted, so a report's bytes depend on its content only."""
    write_json(tmp_path / "report.json", {"b": float("nan"), "a": [1.5, (float("nan"), 2)],
                                          "c": {"z": float("nan"), "y": 0}})
    text = (tmp_path / "report.json").read_text()
    assert json.loads(text) == {"a": [1.5, [None, 2]], "b": None, "c": {"y": 0, "z": None}}
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"
    assert text.index('"a"') < text.index('"b"') < text.index('"c"')


def test_plots_skip_an_arm_without_ttft_samples(tmp_path: Path, umask_022: None) -> None:
    """An arm with no TTFT (no request produced a token) has no CDF line and a P95 bar of
    0; both PNGs are still written."""
    from bidkv_ext.replay.report import write_plots

    arms = [{"label": "a", "recompute_tax": 0.1, "ttft_s": {"p95": 0.5}},
            {"label": "none", "recompute_tax": 0.0, "ttft_s": {"p95": None}}]
    write_plots(tmp_path, [("a", [0.1, 0.2]), ("none", [])], arms)
    for name in ("ttft_cdf.png", "bars.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")


def test_ctrl_c_during_an_arm_exits_130_in_one_line(tmp_path: Path) -> None:
    """SIGINT while an arm runs (a real subprocess, a real signal) used to end in a
    KeyboardInterrupt traceback; it is one line and exit status 130, as a shell reports
    Ctrl-C, with no report written."""
    out = tmp_path / "out"
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    process = subprocess.Popen(
        [sys.executable, "-c", "import sys; from bidkv_ext.replay.cli import main; "
         "sys.exit(main())", "--no-plots", "--no-progress", "--output-dir", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        # A test run started in the background (nohup ... &) inherits SIGINT ignored, and
        # Python keeps an ignored SIGINT ignored: give the child the terminal's default.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # The output directory is created after every check, right before the first arm.
        deadline = time.monotonic() + 120
        while not out.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert out.exists(), "the replay never reached its first arm"
        time.sleep(1.0)
        assert process.poll() is None, "the replay finished before it could be interrupted"
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 130, err
    assert err.strip().splitlines()[-1] == "bidkv-replay: interrupted", err
    assert "Traceback" not in err
    assert not (out / "report.json").exists()
