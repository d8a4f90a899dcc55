"""Version guard and shape match of the ``Scheduler.schedule`` rewrite.

The adapter supports an explicit list of vLLM versions. Any other version, a scheduler
file whose RECORD hash differs from the pinned one, or a ``schedule`` whose victim-choice /
removal statements do not have the expected shape fails at start-up (class creation) with
:class:`UnsupportedHostError` naming the version and the missing statement. The modified
sources below are made in memory from the installed method's AST; no vLLM text is stored.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import textwrap
from collections.abc import Callable
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def rewrite(vllm_offline: ModuleType) -> ModuleType:
    from bidkv_ext.hosts.vllm import rewrite

    return rewrite


@pytest.fixture(scope="module")
def schedule_tree(vllm_offline: ModuleType) -> Callable[[], ast.Module]:
    from vllm.v1.core.sched.scheduler import Scheduler

    source = textwrap.dedent(inspect.getsource(Scheduler.schedule))
    return lambda: ast.parse(source)


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


def _drop_rollback_name(tree: ast.Module) -> None:
    removal = _priority_ifs(tree)[1]
    for node in ast.walk(removal):
        if isinstance(node, ast.Name) and node.id == "input_budget":
            node.id = "other_budget"


def _remove_priority_branch(tree: ast.Module) -> None:
    choice = _priority_ifs(tree)[0]
    choice.test = ast.parse("self.policy == SchedulingPolicy.FCFS", mode="eval").body


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_drop_victim_choice, r"victim choice statement .*self\.running\[-1\]"),
        (_drop_removal, r"removal statement .*self\.running\.pop\(\)"),
        (_rename_block, r"statement 'with record_function_or_nullcontext"),
        (_drop_rollback_name, r"rollback .* does not use input_budget"),
        (_remove_priority_branch, r"expected two statements 'if self\.policy == .*found 1"),
    ],
)
def test_non_matching_shape_names_the_statement(
    rewrite: ModuleType,
    schedule_tree: Callable[[], ast.Module],
    mutate: Callable[[ast.Module], None],
    message: str,
) -> None:
    tree = schedule_tree()
    mutate(tree)
    with pytest.raises(rewrite.UnsupportedHostError, match=message) as info:
        rewrite.rewrite_schedule_source(ast.unparse(tree), version="0.33.0")
    assert "vLLM 0.33.0" in str(info.value)


def test_source_that_does_not_parse(rewrite: ModuleType) -> None:
    with pytest.raises(rewrite.UnsupportedHostError, match="does not parse"):
        rewrite.rewrite_schedule_source("def schedule(self:\n", version="0.33.0")
