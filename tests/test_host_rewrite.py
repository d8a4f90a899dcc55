"""Version guard and shape match of the ``Scheduler.schedule`` rewrite.

The adapter supports an explicit list of vLLM versions. Any other version, a scheduler
file whose RECORD hash differs from the pinned one, or a ``schedule`` whose victim-choice /
removal statements do not have the expected shape fails at start-up (class creation) with
:class:`UnsupportedHostError` naming the version and the missing statement. So does a
``Scheduler.schedule`` that a plugin or patch replaced before the adapter was imported (a
``functools.wraps`` wrapper, or a copy defined elsewhere): the adapter rewrites only the
method the hash-checked file defines. The modified sources below are made in memory from
the installed method's AST; no vLLM text is stored.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def schedule_tree(schedule_source: str) -> Callable[[], ast.Module]:
    """A fresh parse of the installed ``schedule`` per call, for a test to mutate."""
    return lambda: ast.parse(schedule_source)


def assert_shape_refused(rewrite: ModuleType, tree: ast.Module, message: str) -> None:
    """The rewrite refuses ``tree`` in one line matching ``message`` and naming the version
    (cpu-host.md section 7.2): a shape it was not verified against is never rewritten."""
    with pytest.raises(rewrite.UnsupportedHostError, match=message) as info:
        rewrite.rewrite_schedule_source(ast.unparse(tree), version="0.33.0")
    assert "vLLM 0.33.0" in str(info.value) and "\n" not in str(info.value)


def _priority_ifs(tree: ast.Module) -> list[ast.If]:
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.If)
        and isinstance(n.test, ast.Compare)
        and isinstance(n.test.left, ast.Attribute)
        and n.test.left.attr == "policy"
        and any(isinstance(s, ast.Assign) and "preempted_req" in ast.dump(s) for s in n.body)
    ]


def test_installed_version_is_supported(rewrite: ModuleType) -> None:
    import vllm

    assert vllm.__version__ in rewrite.SUPPORTED_VERSIONS
    assert rewrite.check_host(vllm.__version__).version == vllm.__version__


def test_unsupported_version_names_itself(rewrite: ModuleType) -> None:
    with pytest.raises(rewrite.UnsupportedHostError, match=r"vLLM 0\.34\.0: .*supported list"):
        rewrite.check_host("0.34.0")


def test_record_hash_mismatch_is_refused(
    rewrite: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    pinned = rewrite.SupportedHost("0.33.0", "sha256=not-the-real-hash")
    monkeypatch.setitem(rewrite.SUPPORTED_VERSIONS, "0.33.0", pinned)
    with pytest.raises(rewrite.UnsupportedHostError, match=r"RECORD hash .* != pinned"):
        rewrite.check_host("0.33.0")


def test_unsupported_version_fails_at_class_creation(
    rewrite: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm

    from bidkv_ext.hosts.vllm import scheduler

    monkeypatch.setattr(vllm, "__version__", "0.32.9")
    spec = importlib.util.spec_from_file_location("bidkv_probe_scheduler", scheduler.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with pytest.raises(rewrite.UnsupportedHostError) as info:
        spec.loader.exec_module(module)
    assert "vLLM 0.32.9" in str(info.value) and "0.33.0" in str(info.value)


def _wrapped(original: Callable[..., object]) -> Callable[..., object]:
    """A plugin's decorator: ``inspect`` follows its ``__wrapped__`` to vLLM's source."""

    @functools.wraps(original)
    def schedule(self: object, *args: object, **kwargs: object) -> object:
        return original(self, *args, **kwargs)

    return schedule


def _copied(original: Callable[..., object], where: Path) -> Callable[..., object]:
    """A plugin's copy of the method, in a module file of its own (its own globals)."""
    path = where / "bidkv_probe_plugin.py"
    path.write_text("from vllm.v1.core.sched.scheduler import *  # noqa: F403\n\n"
                    + textwrap.dedent(inspect.getsource(original)))
    spec = importlib.util.spec_from_file_location("bidkv_probe_plugin", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.schedule  # type: ignore[no-any-return]


@pytest.mark.parametrize("kind", ["wrapper", "copy"])
def test_replaced_schedule_is_refused_at_class_creation(
    rewrite: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind: str
) -> None:
    """Unrefused, a wrapper was dropped silently (and its defaults copied, so the first
    ``schedule()`` raised TypeError mid-run); a plugin's copy was rewritten instead of the
    checked file and run under vLLM's globals."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from bidkv_ext.hosts.vllm import scheduler

    original = Scheduler.schedule
    replaced = _wrapped(original) if kind == "wrapper" else _copied(original, tmp_path)
    monkeypatch.setattr(Scheduler, "schedule", replaced)
    spec = importlib.util.spec_from_file_location("bidkv_probe_scheduler", scheduler.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with pytest.raises(rewrite.UnsupportedHostError, match="not the method installed") as info:
        spec.loader.exec_module(module)
    assert "vLLM 0.33.0" in str(info.value) and "\n" not in str(info.value)


def test_rewritten_schedule_is_attached_and_named(vllm_offline: ModuleType) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    from bidkv_ext.hosts.vllm import PolicyAsyncScheduler, PolicyScheduler

    for cls in (PolicyScheduler, PolicyAsyncScheduler):
        code = cls.schedule.__code__
        assert cls.schedule is not Scheduler.schedule
        assert "bidkv_ext.hosts.vllm" in code.co_filename and "0.33.0" in code.co_filename
        assert "_bidkv_select_victim" in code.co_names
        assert cls.schedule.__globals__ is Scheduler.schedule.__globals__


def test_unmodified_source_rewrites(
    rewrite: ModuleType, schedule_tree: Callable[[], ast.Module]
) -> None:
    tree = rewrite.rewrite_schedule_source(ast.unparse(schedule_tree()), version="0.33.0")
    assert _priority_ifs(tree) == []  # both PRIORITY statements are gone
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and n.attr == rewrite.ADAPTER_METHOD
    ]
    assert len(calls) == 1


def _drop_victim_choice(tree: ast.Module) -> None:
    choice = _priority_ifs(tree)[0]
    choice.orelse[0].value = ast.parse("self.running[0]", mode="eval").body  # type: ignore[attr-defined]


def _drop_removal(tree: ast.Module) -> None:
    removal = _priority_ifs(tree)[1]
    removal.orelse = [ast.parse("preempted_req = self.running.pop(0)").body[0]]


def _rename_block(tree: ast.Module) -> None:
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value == "schedule: allocate_slots":
            node.value = "schedule: allocate"


def _drop_rollback_name(tree: ast.Module, name: str = "input_budget") -> None:
    removal = _priority_ifs(tree)[1]
    for node in ast.walk(removal):
        if isinstance(node, ast.Name) and node.id == name:
            node.id = "other_name"


def _remove_priority_branch(tree: ast.Module) -> None:
    choice = _priority_ifs(tree)[0]
    choice.test = ast.parse("self.policy == SchedulingPolicy.FCFS", mode="eval").body


def _schedule_def(tree: ast.Module) -> ast.FunctionDef:
    func = tree.body[0]
    assert isinstance(func, ast.FunctionDef) and func.name == "schedule"
    return func


def _retry_loop_calls(tree: ast.Module, method: str) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == method
        and any(isinstance(a, ast.Name) and a.id in ("num_new_tokens", "preempted_req")
                for a in n.args)
    ]


def _decorate(tree: ast.Module) -> None:
    _schedule_def(tree).decorator_list.append(ast.Name(id="staticmethod", ctx=ast.Load()))


def _drop_required_local(tree: ast.Module) -> None:
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "preempted_reqs":
            node.id = "victims"


def _loop_while_one(tree: ast.Module) -> None:
    for node in ast.walk(tree):
        if isinstance(node, ast.While) and isinstance(node.test, ast.Constant):
            node.test = ast.Constant(value=1)


def _allocate_other_count(tree: ast.Module) -> None:
    (call,) = _retry_loop_calls(tree, "allocate_slots")
    call.args[1] = ast.parse("num_new_tokens + 1", mode="eval").body


def _choose_by_min(tree: ast.Module) -> None:
    choice = _priority_ifs(tree)[0]
    choice.body[0].value.func.id = "min"  # type: ignore[attr-defined]


def _choose_second_to_last(tree: ast.Module) -> None:
    choice = _priority_ifs(tree)[0]
    choice.orelse[0].value = ast.parse("self.running[-2]", mode="eval").body  # type: ignore[attr-defined]


def _compare_not_equal(tree: ast.Module) -> None:
    _priority_ifs(tree)[0].test.ops = [ast.NotEq()]  # type: ignore[attr-defined]


def _index_of_requester(tree: ast.Module) -> None:
    removal = _priority_ifs(tree)[1]
    removal.body[0].value.args[0].id = "request"  # type: ignore[attr-defined]


def _pop_instead_of_del(tree: ast.Module) -> None:
    removal = _priority_ifs(tree)[1]
    removal.body = [
        ast.parse("self.running.pop(victim_index)").body[0]
        if isinstance(stmt, ast.Delete) else stmt
        for stmt in removal.body
    ]


def _preempt_with_other_time(tree: ast.Module) -> None:
    (call,) = _retry_loop_calls(tree, "_preempt_request")
    call.args[1] = ast.parse("time.monotonic()", mode="eval").body


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_drop_victim_choice, r"victim choice statement .*self\.running\[-1\]"),
        (_drop_removal, r"removal statement .*self\.running\.pop\(\)"),
        (_rename_block, r"statement 'with record_function_or_nullcontext"),
        (_drop_rollback_name, r"rollback .* does not use input_budget"),
        (_remove_priority_branch, r"expected two statements 'if self\.policy == .*found 1"),
        (_decorate, r"statement 'def schedule' is decorated"),
        (_drop_required_local, r"local name\(s\) preempted_reqs not used in schedule"),
        (_loop_while_one, r"one statement 'while True' in the allocate_slots block, found 0"),
        (_allocate_other_count, r"statement 'self\.kv_cache_manager\.allocate_slots\(request, "),
        (_choose_by_min, r"victim choice statement 'preempted_req = max\(self\.running"),
        (_choose_second_to_last, r"victim choice statement .*self\.running\[-1\]"),
        (_compare_not_equal, r"expected two statements 'if self\.policy == .*found 1"),
        (_index_of_requester, r"removal statement 'victim_index = self\.running\.index"),
        (_pop_instead_of_del, r"removal statement 'victim_index = self\.running\.index"),
        (_preempt_with_other_time,
         r"statement 'self\._preempt_request\(preempted_req, scheduled_timestamp"),
    ],
)
def test_non_matching_shape_names_the_statement(
    rewrite: ModuleType,
    schedule_tree: Callable[[], ast.Module],
    mutate: Callable[[ast.Module], None],
    message: str,
) -> None:
    """Each shape the splice relies on is checked: a source that differs in any one of them
    is refused at class creation naming the statement, never rewritten wrongly."""
    tree = schedule_tree()
    mutate(tree)
    assert_shape_refused(rewrite, tree, message)


def test_source_that_does_not_parse(rewrite: ModuleType) -> None:
    with pytest.raises(rewrite.UnsupportedHostError, match="does not parse"):
        rewrite.rewrite_schedule_source("def schedule(self:\n", version="0.33.0")


# Every local the PRIORITY removal must roll back, spelled out here (not read from the
# module) so that dropping one from the rewriter's list is caught.
ROLLBACK_NAMES = (
    "req_index",
    "scheduled_running_reqs",
    "num_scheduled_tokens",
    "token_budget",
    "input_budget",
    "draft_slots",
    "req_to_new_blocks",
    "scheduled_spec_decode_tokens",
    "scheduled_encoder_inputs",
    "encoder_compute_budget",
)


@pytest.mark.parametrize("name", ROLLBACK_NAMES)
def test_each_rollback_name_is_required(
    rewrite: ModuleType, schedule_tree: Callable[[], ast.Module], name: str
) -> None:
    """A PRIORITY removal that no longer rolls back any one of these locals is refused,
    naming it: the rewrite makes that body unconditional, so each rollback must be there."""
    assert set(rewrite._ROLLBACK_NAMES) <= set(ROLLBACK_NAMES)  # keep this list complete
    tree = schedule_tree()
    _drop_rollback_name(tree, name)
    assert_shape_refused(rewrite, tree, rf"rollback .* does not use {name} \(supported")


def _fake_dist(root: Path, name: str, files: dict[str, str]) -> None:
    """A minimal installed distribution under ``root``: METADATA and a RECORD of
    ``path -> hash``."""
    info = root / f"{name.replace('-', '_')}-0.33.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.33.0\n")
    (info / "RECORD").write_text("".join(f"{path},{digest},\n" for path, digest in files.items()))


def _place_scheduler(root: Path, text: bytes) -> Path:
    path = root / "vllm" / "v1" / "core" / "sched" / "scheduler.py"
    path.parent.mkdir(parents=True)
    path.write_bytes(text)
    return path


def _installed_scheduler_bytes() -> bytes:
    spec = importlib.util.find_spec("vllm.v1.core.sched.scheduler")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).read_bytes()


FAKE_DIST = "bidkv-probe-vllm"
SCHEDULER_FILE = "vllm/v1/core/sched/scheduler.py"


def test_edited_install_of_the_pinned_release_is_refused(
    rewrite: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file itself is hashed: an install whose RECORD carries the pinned hash but whose
    scheduler file was edited afterwards is refused as modified."""
    pinned = rewrite.SUPPORTED_VERSIONS["0.33.0"].scheduler_record_hash
    _fake_dist(tmp_path, FAKE_DIST, {SCHEDULER_FILE: pinned})
    edited = _place_scheduler(tmp_path, _installed_scheduler_bytes() + b"\n# edited\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    with pytest.raises(rewrite.UnsupportedHostError, match="was modified"):
        rewrite.check_host("0.33.0", distribution=FAKE_DIST, scheduler_file=edited)


def test_only_the_distribution_owning_the_file_vouches_for_it(
    rewrite: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Of several metadata directories claiming the name, only the one whose RECORD lists
    the imported file counts: another one's pinned hash does not vouch for it."""
    genuine = _installed_scheduler_bytes()
    pinned = rewrite.SUPPORTED_VERSIONS["0.33.0"].scheduler_record_hash
    other, owner = tmp_path / "other", tmp_path / "owner"
    # First on the path: a directory with the pinned hash and its own (genuine) file.
    _fake_dist(other, FAKE_DIST, {SCHEDULER_FILE: pinned})
    _place_scheduler(other, genuine)
    # The owner of the imported file records that file's real (different) hash.
    imported = _place_scheduler(owner, genuine + b"\n# another release\n")
    _fake_dist(owner, FAKE_DIST, {SCHEDULER_FILE: rewrite._record_hash_of(imported)})
    monkeypatch.setattr(sys, "path", [str(other), str(owner), *sys.path])
    with pytest.raises(rewrite.UnsupportedHostError, match=r"RECORD hash sha256=\S+ != pinned"):
        rewrite.check_host("0.33.0", distribution=FAKE_DIST, scheduler_file=imported)
    # Owned by nobody: the other directory's entry does not vouch either.
    lone = _place_scheduler(tmp_path / "lone", genuine)
    with pytest.raises(rewrite.UnsupportedHostError, match="no RECORD hash"):
        rewrite.check_host("0.33.0", distribution=FAKE_DIST, scheduler_file=lone)


def test_rewritten_schedule_keeps_the_installed_line_numbers(
    rewrite: ModuleType, vllm_offline: ModuleType
) -> None:
    """Line numbers are shifted to the installed file, so tracebacks through the
    rewritten schedule point at the real vLLM lines."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from bidkv_ext.hosts.vllm import PolicyScheduler

    first_line = inspect.getsourcelines(Scheduler.schedule)[1]
    assert first_line > 1
    built = rewrite.build_schedule(Scheduler.schedule, Scheduler.schedule.__globals__,
                                   version="0.33.0")
    assert built.__code__.co_firstlineno == first_line
    assert PolicyScheduler.schedule.__code__.co_firstlineno == first_line
