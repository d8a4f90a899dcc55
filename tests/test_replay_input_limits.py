"""Bad input at the edges of what Python and the replay can hold fails as one line and
costs no finished arm (``bidkv-replay`` and the benchmarks).

Guarded behaviours:

* an integer over Python's int-digits limit (4300) in a Mooncake trace line, a capacity
  schedule, ``--additional-config`` or a ``--policies`` override names its input, and so
  does an over-deep ``--policies`` override (malformed ones stay plain strings);
* ``--additional-config`` refuses NaN, Infinity and numbers that overflow to infinity; a
  ``--rate-scale`` or ``--step-model`` that makes simulated times non-finite is refused
  naming the flag or file, all before any arm runs; and a figure JSON cannot hold that
  still reaches the report fails only the file that holds it, with one line naming it;
* ``--num-gpu-blocks`` has an upper bound (vLLM builds every block up front);
* every arm's policy is built in a preflight before any arm runs, so a policy whose
  ``from_vllm_config`` fails (wrong result, KeyError, ValueError) is one line naming the
  arm, and a failure while the engine is built later is one line naming the arm too; each
  arm runs with the policy instance the preflight built (one constructor call per arm);
* ``--output-dir ""`` (or blanks) is refused instead of writing into the working directory;
* CSV traces and capacity schedules may start with a UTF-8 byte-order mark;
* ``benchmarks/decision_cost.py`` refuses bad ``--sizes``/``--repeat`` as argparse errors;
* ``benchmarks/replay/run.py --reuse`` replays a slice whose saved report is unreadable,
  saying so, instead of crashing;
* ``benchmarks/replay/headroom.py --samples``/``BIDKV_ROLLOUT_SAMPLES`` below 0 is refused.

Cheap checks run the real entry point in a subprocess; cases that need vLLM (the preflight,
a finished replay) call ``main`` in-process, as tests/test_replay_cli_errors.py does.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bidkv_ext.replay import arms, cli
from bidkv_ext.replay.capacity import load_capacity_schedule
from bidkv_ext.replay.cli import main
from bidkv_ext.replay.trace import load_trace

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
HUGE = "1" + "0" * 5000  # over sys.get_int_max_str_digits() (4300)
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
AZURE_ROWS = "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:47.6805900,200,20\n"
QUICK = ["--policies", "builtin", "--max-requests", "3", "--num-gpu-blocks", "400",
         "--no-progress", "--no-plots"]
ENV = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_OFFLINE": "1"}


def _cli(cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bidkv_ext.replay.cli", *argv], cwd=cwd,
                          capture_output=True, text=True, env=ENV, timeout=60, check=False)


def _refused_line(done: subprocess.CompletedProcess[str], prefix: str = "bidkv-replay") -> str:
    """The single error line of a refused run (exit 2, no traceback)."""
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prefix}: error: "), done.stderr
    return lines[0]


def _refused_in_process(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run ``main`` expecting exit 2; return its one ``bidkv-replay`` stderr line (vLLM logs
    its own lines to stderr, which are not ours)."""
    code = main(list(argv))
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert "Traceback" not in captured.err
    ours = [line for line in captured.err.splitlines() if line.startswith("bidkv-replay")]
    assert len(ours) == 1 and ours[0].startswith("bidkv-replay: error: "), captured.err
    return ours[0]


# --- 1. integers over the int-digits limit --------------------------------------------


@pytest.mark.parametrize("where", ["trace", "capacity", "additional-config", "policies"])
def test_integer_over_digit_limit_names_its_input(tmp_path: Path, where: str) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5, '
                     '"hash_ids": [0]}\n')
    argv = ["--trace", str(trace), "--output-dir", str(tmp_path / "out")]
    if where == "trace":
        trace.write_text(f'{{"timestamp": 0, "input_length": {HUGE}, "output_length": 5}}\n')
        named = f"{trace}:1: an integer has more than"
    elif where == "capacity":
        schedule = tmp_path / "cap.json"
        schedule.write_text(f'[{{"t": 0, "blocks": {HUGE}}}]')
        argv += ["--capacity-schedule", str(schedule)]
        named = f"{schedule}: an integer has more than"
    elif where == "additional-config":
        argv += ["--additional-config", f'{{"x": {HUGE}}}']
        named = "--additional-config: an integer has more than"
    else:
        argv += ["--policies", f"bidkv{{seed={HUGE}}}"]
        named = "--policies: 'bidkv': seed: an integer has more than"
    line = _refused_line(_cli(tmp_path, *argv))
    assert named in line and "4300 digits" in line
    assert len(line) < 300  # the digits themselves are not echoed
    assert not (tmp_path / "out").exists()



def test_policies_override_nested_too_deeply_is_one_line(tmp_path: Path) -> None:
    """A ``--policies`` value the JSON parser refuses for depth (not for syntax) is not
    taken as a plain string: it is a one-line error naming the arm and the key, not a
    RecursionError traceback."""
    deep = "[" * 5000 + "]" * 5000
    line = _refused_line(_cli(tmp_path, "--policies", f"bidkv{{seed={deep}}}",
                              "--output-dir", str(tmp_path / "out")))
    assert line.endswith("--policies: 'bidkv': seed: JSON nested too deeply")
    assert not (tmp_path / "out").exists()


def test_policies_override_that_is_not_json_stays_a_string() -> None:
    """Malformed JSON in an override is a plain string value (``strategy=lcf``), as before."""
    assert arms._overrides("bidkv{strategy=lcf; seed=3; x=[1,}")[1] == {
        "strategy": "lcf", "seed": 3, "x": "[1,"}


# --- 2. non-finite figures ------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ('{"other_component": Infinity}', "Infinity is not a JSON number"),
        ('{"a": [-Infinity]}', "-Infinity is not a JSON number"),
        ('{"a": NaN}', "NaN is not a JSON number"),
        ('{"bidkv": {"seed": 1e400}}', "number 1e400 is out of range"),
    ],
)
def test_additional_config_must_hold_finite_numbers(tmp_path: Path, config: str,
                                                    named: str) -> None:
    line = _refused_line(_cli(tmp_path, *QUICK, "--output-dir", str(tmp_path / "out"),
                              "--additional-config", config))
    assert line == f"bidkv-replay: error: --additional-config: {named}; expected finite numbers"
    assert not (tmp_path / "out").exists()


def test_rate_scale_that_overflows_arrivals_is_refused(tmp_path: Path) -> None:
    line = _refused_line(_cli(tmp_path, *QUICK, "--output-dir", str(tmp_path / "out"),
                              "--rate-scale", "1e-310"))
    assert line.startswith("bidkv-replay: error: --rate-scale 1e-310 stretches the last "
                           "arrival to inf s")
    assert not (tmp_path / "out").exists()


def test_a_trace_spanning_centuries_is_named_not_the_rate_scale(tmp_path: Path) -> None:
    trace = tmp_path / "far.jsonl"
    rows = [{"timestamp": 0, "input_length": 40, "output_length": 4, "hash_ids": [1]},
            {"timestamp": 2e13, "input_length": 40, "output_length": 4, "hash_ids": [2]}]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    line = _refused_line(_cli(tmp_path, *QUICK, "--trace", str(trace),
                              "--output-dir", str(tmp_path / "out")))
    assert line == (f"bidkv-replay: error: {trace}: the last selected arrival is at 2e+10 s; "
                    "expected arrivals below 1e+10 s")


def test_step_model_that_overflows_a_step_is_refused(tmp_path: Path) -> None:
    model = tmp_path / "step.json"
    model.write_text(json.dumps({"name": "huge", "a": 1e307, "b": 1e307, "c": 1e307,
                                 "d": 1e307}))
    line = _refused_line(_cli(tmp_path, *QUICK, "--output-dir", str(tmp_path / "out"),
                              "--step-model", str(model)))
    assert line.startswith(f"bidkv-replay: error: step model {model}: the longest step")
    assert "takes inf s" in line
    assert not (tmp_path / "out").exists()


def test_non_finite_figure_fails_only_its_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backstop: should an infinite figure reach the report after all (here the input
    check is bypassed), the arms' results are kept: the table is on stdout, every file
    that can hold them is written, and one line names the figure."""
    monkeypatch.setattr(cli, "_additional_config", lambda _raw: {"other_component": math.inf})
    out = tmp_path / "out"
    line = _refused_in_process(capsys, *QUICK, "--output-dir", str(out))
    assert line == (f"bidkv-replay: error: cannot write {out / 'report.json'}: "
                    "settings.additional_config.other_component is inf; JSON holds only "
                    "finite numbers")
    assert (out / "report.md").exists() and (out / "timing.json").exists()
    assert not (out / "report.json").exists()


# --- 3. --num-gpu-blocks upper bound --------------------------------------------------


@pytest.mark.parametrize("blocks", ["999999999999999999999", "10000001"])
def test_num_gpu_blocks_has_an_upper_bound(tmp_path: Path, blocks: str) -> None:
    line = _refused_line(_cli(tmp_path, *QUICK, "--output-dir", str(tmp_path / "out"),
                              "--num-gpu-blocks", blocks))
    assert line == (f"bidkv-replay: error: --num-gpu-blocks must be between 2 and "
                    f"10,000,000, got {blocks}")
    assert not (tmp_path / "out").exists()


# --- 4. policies are built before any arm runs ----------------------------------------

POLICIES = '''\
class Five:
    @classmethod
    def from_vllm_config(cls, config):
        return 5
class MissingKey:
    @classmethod
    def from_vllm_config(cls, config):
        raise KeyError("zz")
class BadValue:
    @classmethod
    def from_vllm_config(cls, config):
        raise ValueError("bad value")
class FactsFlagFails:
    """Builds, but the host reads wants_host_facts only when its engine is built."""
    def select_victim(self, context):
        return None
    def select_victim_with_facts(self, context, facts):
        return None
    @property
    def wants_host_facts(self):
        raise KeyError("engine build")
class Counted:
    """Counts its constructor calls and the instances that decide."""
    built = []
    decided = set()
    def __init__(self):
        Counted.built.append(self)
    def select_victim(self, context):
        Counted.decided.add(id(self))
        return None
class CountedFactory:
    """The same, built through from_vllm_config (as the selector is)."""
    built = []
    decided = set()
    @classmethod
    def from_vllm_config(cls, config):
        policy = cls()
        cls.built.append(policy)
        return policy
    def select_victim(self, context):
        CountedFactory.decided.add(id(self))
        return None
'''


@pytest.fixture
def policy_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"replay_limits_policies_{tmp_path.name.replace('[', '_').replace(']', '_')}"
    name = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name)
    (tmp_path / f"{name}.py").write_text(POLICIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


@pytest.mark.parametrize(
    ("cls", "expected"),
    [
        ("Five", "TypeError: preemption_policy must resolve to an object implementing "
                 "PreemptionPolicy"),
        ("MissingKey", "KeyError: 'zz'"),
        ("BadValue", "ValueError: bad value"),
    ],
)
def test_policy_that_fails_to_build_is_refused_before_any_arm(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    policy_module: str, cls: str, expected: str,
) -> None:
    from bidkv_ext.replay import engine

    ran: list[str] = []
    real = engine.run_arm
    monkeypatch.setattr(engine, "run_arm",
                        lambda requests, arm, *a, **k: ran.append(arm.label) or real(
                            requests, arm, *a, **k))
    spec = f"{policy_module}:{cls}"
    line = _refused_in_process(capsys, *QUICK, "--policies", "bidkv", "--policy-class", spec,
                               "--output-dir", str(tmp_path / "out"))
    assert line == f"bidkv-replay: error: arm {spec!r}: its policy cannot be built: {expected}"
    assert ran == []  # nothing was run, so nothing finished was lost
    assert not (tmp_path / "out").exists()


def test_each_policy_is_built_once_and_decides_in_its_arm(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, policy_module: str
) -> None:
    """The preflight builds each arm's policy (a plain class, and one built by
    ``from_vllm_config``) and the arm runs with that instance: one constructor call per
    arm, not one in the preflight and another in the engine, and the instance built is
    the one that decides (the run preempts)."""
    import importlib

    code = main(["--max-requests", "60", "--num-gpu-blocks", "300",
                 "--no-progress", "--no-plots", "--policy-class", f"{policy_module}:Counted",
                 "--policy-class", f"{policy_module}:CountedFactory",
                 "--output-dir", str(tmp_path / "out")])
    capsys.readouterr()
    module = importlib.import_module(policy_module)
    assert code == 0
    for cls in (module.Counted, module.CountedFactory):
        assert len(cls.built) == 1, cls.__name__
        assert cls.decided == {id(cls.built[0])}, cls.__name__
    arms = json.loads((tmp_path / "out" / "report.json").read_text())["arms"]
    assert [a["controller"]["policy_name"] for a in arms] == [
        f"{policy_module}.Counted", f"{policy_module}.CountedFactory"]
    assert all(a["controller"]["abstentions"] == a["preemptions"] > 0 for a in arms)


def test_engine_build_failure_during_the_run_names_the_arm(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, policy_module: str
) -> None:
    """A policy that passes the preflight and fails when its engine is built (the host
    reads ``wants_host_facts`` then): one line naming the arm once, no traceback; the
    builtin arm that ran before it keeps its results."""
    spec = f"{policy_module}:FactsFlagFails"
    line = _refused_in_process(capsys, *QUICK, "--policy-class", spec,
                               "--output-dir", str(tmp_path / "out"))
    assert line == (f"bidkv-replay: error: arm {spec!r} stopped: the engine cannot be built: "
                    "KeyError: 'engine build'; the outputs hold the 1 arm(s) before it")
    arms = json.loads((tmp_path / "out" / "report.json").read_text())["arms"]
    assert [arm["label"] for arm in arms] == ["builtin"]


# --- 5. empty --output-dir ------------------------------------------------------------


@pytest.mark.parametrize("value", ["", "   "])
def test_empty_output_dir_is_refused(tmp_path: Path, value: str) -> None:
    (tmp_path / "report.md").write_text("keep me")
    line = _refused_line(_cli(tmp_path, *QUICK, "--output-dir", value))
    assert line == "bidkv-replay: error: --output-dir must name a directory, got an empty value"
    assert (tmp_path / "report.md").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md"]


# --- 6. UTF-8 byte-order mark ---------------------------------------------------------


def test_csv_trace_and_capacity_schedule_may_start_with_a_bom(tmp_path: Path) -> None:
    bom = "\ufeff"
    trace = tmp_path / "azure.csv"
    trace.write_text(bom + AZURE_HEADER + AZURE_ROWS, encoding="utf-8")
    assert [r.input_length for r in load_trace(trace)] == [374, 200]
    for name, text in [("cap.csv", "t,blocks\n0,100\n"), ("cap.json", '[{"t": 0, "blocks": 100}]')]:
        schedule = tmp_path / name
        schedule.write_text(bom + text, encoding="utf-8")
        assert load_capacity_schedule(schedule, 399).as_list() == [{"t": 0.0, "blocks": 100}]


# --- 7. benchmarks/decision_cost.py ---------------------------------------------------


def _bench(script: str, *argv: str, env: dict[str, str] | None = None
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCH / script), *argv], cwd=REPO,
                          capture_output=True, text=True, env=env or ENV, timeout=60,
                          check=False)


@pytest.mark.parametrize(
    "argv",
    [["--sizes="], ["--sizes=abc"], ["--sizes=8,,64"], ["--sizes=1e3"], ["--sizes=0"],
     ["--sizes=-5"], ["--repeat=0"], ["--repeat=-1"]],
)
def test_decision_cost_refuses_bad_sizes_and_repeat(argv: list[str]) -> None:
    done = _bench("decision_cost.py", *argv)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    flag = argv[0].split("=")[0]
    assert last.startswith(f"decision_cost.py: error: argument {flag}: expected "), last


# --- 8. benchmarks/replay/run.py --reuse ----------------------------------------------


@pytest.fixture
def run_module() -> object:
    sys.path.insert(0, str(BENCH / "replay"))
    try:
        import run  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(BENCH / "replay"))
    return run


@pytest.mark.parametrize("text", ['{"arms": [', "[1]", '{"arms": [{"x": 1}]}', "\xff"])
def test_reuse_treats_an_unreadable_report_as_stale(
    tmp_path: Path, run_module: object, text: str
) -> None:
    report = tmp_path / "report.json"
    report.write_bytes(text.encode("latin-1"))
    reason = run_module.stale_reason(report, ["--policies", "builtin"])  # type: ignore[attr-defined]
    assert reason is not None and reason.startswith("saved report is unreadable")


def test_reuse_replays_a_slice_whose_report_is_unreadable(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, run_module: object
) -> None:
    out = tmp_path / "slice"
    out.mkdir()
    (out / "report.json").write_text('{"arms": [')
    arms = run_module.replay_arms(  # type: ignore[attr-defined]
        ["--policies", "builtin", "--max-requests", "3", "--num-gpu-blocks", "400"], out,
        "the test slice", reuse=True)
    assert list(arms) == ["builtin"]
    err = capsys.readouterr().err
    assert f"{out / 'report.json'}: saved report is unreadable" in err
    assert "replaying the test slice" in err


# --- 9. benchmarks/replay/headroom.py --samples ---------------------------------------


def test_headroom_refuses_negative_samples() -> None:
    done = _bench("replay/headroom.py", "rollout", "--samples", "-1", "--no-write")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "headroom.py: error: argument --samples: expected a whole number >= 0 "
        "(0: true output lengths), got '-1'")
    done = _bench("replay/headroom.py", "rollout", "--no-write",
                  env={**ENV, "BIDKV_ROLLOUT_SAMPLES": "-1"})
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "BIDKV_ROLLOUT_SAMPLES: expected a whole number of futures >= 0, got '-1'"]
