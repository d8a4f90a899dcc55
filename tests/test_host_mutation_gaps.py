"""Behaviours a mutation audit of the stock-vLLM host adapter (``bidkv_ext.hosts.vllm``:
``rewrite``, ``scheduler``, ``peer_plugin``, ``offline``) found unguarded by any other test.

- Host check (cpu-host.md section 7.2): a RECORD entry for the scheduler file without a
  hash vouches for nothing ("no RECORD hash", not an AttributeError); a metadata directory
  whose RECORD lists the file but whose copy of it is gone is skipped, not a crash.
- Shape match: every predicate the splice relies on refuses a source that differs from it
  in that one respect, naming the statement: the two PRIORITY tests (one ``==``, on
  ``self.policy``; exactly two of them), the victim choice (one statement, one target named
  ``preempted_req``, ``max`` of ``self.running`` alone, ``self.running[-1]``, not ``[+1]``), the
  removal (``self.running.index(preempted_req)`` into one target, ``self.running.pop()``),
  the ``allocate_slots`` block (one ``record_function_or_nullcontext`` item, exactly one
  such block), ``allocate_slots(request, num_new_tokens)`` and
  ``self._preempt_request(preempted_req, ...)`` after the removal; every rollback name is
  looked for in the removal's PRIORITY body, not anywhere in the loop.
- Rewrite: the adapter call keeps the line of the victim choice it replaces.
- Installed-method check: a plain function only, from the scheduler module's own globals
  and file, not a ``functools.wraps`` wrapper; a code object named ``"<string>"`` or
  globals without ``__file__`` are refused as replacements, never an OSError or TypeError.
- Scheduler: with no live policy no ``PreemptionContext`` is built; under a registered
  page model the host leaves ``in_shrink`` to the policy (``None``).
- Peer plugin (``scripts/peer_suite.sh``): only ``tests`` and ``tests.*`` modules are
  patched, and only names still bound to vLLM's own classes, each to its own adapter
  subclass; the patched count reaches the summary; each test's setup patches late imports;
  the adapter subclasses default to an abstaining policy (counted as abstentions, the run
  stays stock) but keep a policy the caller passes, and are counted in the summary line.
- Offline kit: a pool needs 2 blocks (one is the null block); ``run_to_completion``
  takes at most ``max_steps`` steps; a step digest names its preemptions; a request
  built with ``ignore_eos=False`` stops at the EOS it samples.
"""

from __future__ import annotations

import ast
import functools
import sys
import types
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from tests import test_host_rewrite as shapes

# -- host check: RECORD edge cases -----------------------------------------------------------


def test_a_record_entry_without_a_hash_vouches_for_nothing(
    rewrite: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rule: only a hashed RECORD entry vouches for the file. A RECORD line for the
    scheduler with an empty hash field is "no RECORD hash". Kills the mutant that drops
    ``entry.hash is None`` from the skip test (it raised AttributeError)."""
    imported = shapes._place_scheduler(tmp_path, shapes._installed_scheduler_bytes())
    shapes._fake_dist(tmp_path, shapes.FAKE_DIST, {shapes.SCHEDULER_FILE: ""})
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    with pytest.raises(rewrite.UnsupportedHostError, match="no RECORD hash"):
        rewrite.check_host("0.33.0", distribution=shapes.FAKE_DIST, scheduler_file=imported)


def test_a_record_whose_file_is_gone_is_skipped(
    rewrite: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rule: a metadata directory whose RECORD lists the scheduler file but whose copy of
    it is gone (a stale dist-info first on the path) is skipped; the owner of the imported
    file still vouches for it. Kills the mutant that drops ``located.exists()`` (samefile
    raised FileNotFoundError)."""
    pinned = rewrite.SUPPORTED_VERSIONS["0.33.0"].scheduler_record_hash
    stale, owner = tmp_path / "stale", tmp_path / "owner"
    shapes._fake_dist(stale, shapes.FAKE_DIST, {shapes.SCHEDULER_FILE: pinned})
    imported = shapes._place_scheduler(owner, shapes._installed_scheduler_bytes())
    shapes._fake_dist(owner, shapes.FAKE_DIST, {shapes.SCHEDULER_FILE: pinned})
    monkeypatch.setattr(sys, "path", [str(stale), str(owner), *sys.path])
    host = rewrite.check_host("0.33.0", distribution=shapes.FAKE_DIST, scheduler_file=imported)
    assert host.version == "0.33.0"


# -- shape match: each predicate refuses a source differing in that one respect -------------


def _expr(text: str) -> ast.expr:
    return ast.parse(text, mode="eval").body


def _stmt(text: str) -> ast.stmt:
    return ast.parse(text).body[0]


def _allocate_with(tree: ast.Module) -> ast.With:
    (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.With)
               and "schedule: allocate_slots" in ast.dump(n.items[0].context_expr)]
    return node


def _loop_body(tree: ast.Module) -> list[ast.stmt]:
    (loop,) = [n for n in _allocate_with(tree).body if isinstance(n, ast.While)]
    return loop.body


def _choice(tree: ast.Module) -> ast.If:
    return shapes._priority_ifs(tree)[0]


def _removal(tree: ast.Module) -> ast.If:
    return shapes._priority_ifs(tree)[1]


def _call_named(tree: ast.Module, attr: str) -> ast.Call:
    (call,) = [n for n in ast.walk(ast.Module(body=_loop_body(tree), type_ignores=[]))
               if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
               and n.func.attr == attr]
    return call


def _chained_priority_test(tree: ast.Module) -> None:
    _choice(tree).test = _expr("self.policy == SchedulingPolicy.PRIORITY == True")


def _other_policy_attribute(tree: ast.Module) -> None:
    _choice(tree).test.left = _expr("self.default_policy")  # type: ignore[attr-defined]


def _extra_statement_in_choice(tree: ast.Module) -> None:
    _choice(tree).body.append(_stmt("self.note(preempted_req)"))


def _chained_choice_assignment(tree: ast.Module) -> None:
    _choice(tree).body[0].targets.append(  # type: ignore[attr-defined]
        ast.Name(id="victim", ctx=ast.Store()))


def _choice_assigns_other_name(tree: ast.Module) -> None:
    _choice(tree).body[0].targets[0].id = "victim"  # type: ignore[attr-defined]


def _max_with_two_args(tree: ast.Module) -> None:
    _choice(tree).body[0].value.args.append(_expr("self.waiting"))  # type: ignore[attr-defined]


def _max_of_other_list(tree: ast.Module) -> None:
    _choice(tree).body[0].value.args[0] = _expr("self.waiting")  # type: ignore[attr-defined]


def _tail_of_other_list(tree: ast.Module) -> None:
    _choice(tree).orelse[0].value.value = _expr("self.waiting")  # type: ignore[attr-defined]


def _tail_at_plus_one(tree: ast.Module) -> None:
    _choice(tree).orelse[0].value.slice = _expr("+1")  # type: ignore[attr-defined]


def _removal_by_other_method(tree: ast.Module) -> None:
    _removal(tree).orelse[0].value.func.attr = "copy"  # type: ignore[attr-defined]


def _pop_from_other_list(tree: ast.Module) -> None:
    _removal(tree).orelse[0].value.func.value = _expr("self.waiting")  # type: ignore[attr-defined]


def _index_by_other_method(tree: ast.Module) -> None:
    _removal(tree).body[0].value.func.attr = "count"  # type: ignore[attr-defined]


def _chained_index_assignment(tree: ast.Module) -> None:
    _removal(tree).body[0].targets.append(  # type: ignore[attr-defined]
        ast.Name(id="other_index", ctx=ast.Store()))


def _index_in_other_list(tree: ast.Module) -> None:
    _removal(tree).body[0].value.func.value = _expr("self.waiting")  # type: ignore[attr-defined]


def _with_two_items(tree: ast.Module) -> None:
    _allocate_with(tree).items.append(ast.withitem(context_expr=_expr("other_context()")))


def _with_other_function(tree: ast.Module) -> None:
    _allocate_with(tree).items[0].context_expr.func.id = "other_context"  # type: ignore[attr-defined]


def _allocate_by_other_method(tree: ast.Module) -> None:
    _call_named(tree, "allocate_slots").func.attr = "allocate_other"  # type: ignore[attr-defined]


def _allocate_for_other_request(tree: ast.Module) -> None:
    _call_named(tree, "allocate_slots").args[0] = _expr("other_request")


def _preempt_the_requester(tree: ast.Module) -> None:
    _call_named(tree, "_preempt_request").args[0] = _expr("request")


def _preempt_by_other_method(tree: ast.Module) -> None:
    _call_named(tree, "_preempt_request").func.attr = "_free_request"  # type: ignore[attr-defined]


def _two_allocate_blocks(tree: ast.Module) -> None:
    block = _allocate_with(tree)
    for node in ast.walk(tree):
        for field in ("body", "orelse"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list) and block in stmts:
                stmts.insert(stmts.index(block), ast.parse(ast.unparse(block)).body[0])
                return
    raise AssertionError("allocate_slots block has no parent")


def _third_priority_test(tree: ast.Module) -> None:
    body = _loop_body(tree)
    choice = _choice(tree)
    body.insert(body.index(choice), ast.parse(ast.unparse(choice)).body[0])


def _preempt_before_removal(tree: ast.Module) -> None:
    body = _loop_body(tree)
    removal = _removal(tree)
    (preempt,) = [s for s in body if "_preempt_request" in ast.dump(s)]
    body.remove(preempt)
    body.insert(body.index(removal), preempt)


def _rollback_outside_the_removal(tree: ast.Module) -> None:
    body = _loop_body(tree)
    removal = _removal(tree)
    (fix,) = [s for s in removal.body if isinstance(s, ast.If) and "req_index" in ast.dump(s)]
    removal.body.remove(fix)
    body.insert(body.index(removal) + 1, fix)


CHOICE = r"victim choice statement 'preempted_req = max\(self\.running"
REMOVAL = r"removal statement 'victim_index = self\.running\.index\(preempted_req\)'"
BLOCK = r"statement 'with record_function_or_nullcontext\(\"schedule: allocate_slots\"\)'"
ALLOCATE = r"statement 'self\.kv_cache_manager\.allocate_slots\(request, num_new_tokens"
PREEMPT = r"statement 'self\._preempt_request\(preempted_req, scheduled_timestamp"
TESTS = r"expected two statements 'if self\.policy == SchedulingPolicy\.PRIORITY'"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_chained_priority_test, TESTS + r" .*found 1"),  # len(ops) == 1
        (_other_policy_attribute, TESTS + r" .*found 1"),  # left is self.policy
        (_third_priority_test, TESTS + r" .*found 3"),  # exactly two
        (_extra_statement_in_choice, CHOICE),  # one statement
        (_chained_choice_assignment, CHOICE),  # one target
        (_choice_assigns_other_name, CHOICE),  # named preempted_req
        (_max_with_two_args, CHOICE),  # max of one argument
        (_max_of_other_list, CHOICE),  # ... which is self.running
        (_tail_of_other_list, CHOICE),  # self.running[-1]
        (_tail_at_plus_one, CHOICE),  # ... minus, not plus, one
        (_removal_by_other_method, REMOVAL),  # self.running.pop()
        (_pop_from_other_list, REMOVAL),
        (_index_by_other_method, REMOVAL),  # self.running.index(preempted_req)
        (_chained_index_assignment, REMOVAL),
        (_rollback_outside_the_removal, r"rollback in the PRIORITY removal does not use req_index"),
        (_index_in_other_list, REMOVAL),
        (_with_two_items, BLOCK + r", found 0"),
        (_with_other_function, BLOCK + r", found 0"),
        (_two_allocate_blocks, BLOCK + r", found 2"),
        (_allocate_by_other_method, ALLOCATE),
        (_allocate_for_other_request, ALLOCATE),
        (_preempt_the_requester, PREEMPT),
        (_preempt_by_other_method, PREEMPT),
        (_preempt_before_removal, PREEMPT),
    ],
)
def test_each_shape_predicate_refuses_a_near_miss(
    rewrite: ModuleType,
    schedule_source: str,
    mutate: Callable[[ast.Module], None],
    message: str,
) -> None:
    """Rule: the rewrite splices only the shape it was verified against (cpu-host.md
    section 7.2); a source differing in one respect is refused naming the statement, never
    rewritten. Each case kills the mutant that drops (or loosens) that one check of the
    shape predicates (``_is_priority_test``, ``_assigns_preempted_req``, ``_is_max_running``,
    ``_is_running_tail``, ``_is_running_pop``, ``_is_running_index_of_victim``,
    ``_is_allocate_slots_with``, ``_only``, ``_allocates_with_num_new_tokens``,
    ``_preempts_with_timestamp`` and the search after the removal, the ``!= 2`` count, the
    rollback names looked for in the removal's body alone)."""
    tree = ast.parse(schedule_source)
    mutate(tree)
    shapes.assert_shape_refused(rewrite, tree, message)


def test_the_adapter_call_keeps_the_line_of_the_choice(
    rewrite: ModuleType, schedule_source: str
) -> None:
    """Rule: tracebacks through the rewritten ``schedule`` point at the installed lines,
    the adapter call included: it takes the line of the victim choice it replaces. Kills
    the mutant that drops ``ast.copy_location`` (the call got the loop's line)."""
    choice = _choice(ast.parse(schedule_source))
    tree = rewrite.rewrite_schedule_source(schedule_source, version="0.33.0")
    (call,) = [n for n in ast.walk(tree) if isinstance(n, ast.Assign)
               and rewrite.ADAPTER_METHOD in ast.dump(n.value)]
    assert (call.lineno, call.end_lineno) == (choice.lineno, choice.end_lineno)


# -- installed-method check ------------------------------------------------------------------

_PROBE = "def schedule(self, *args, **kwargs):\n    return None\n"


def _defined(globals_: dict[str, Any], filename: str) -> types.FunctionType:
    """A ``schedule`` compiled as ``filename`` and run in ``globals_`` (left unchanged)."""
    namespace: dict[str, Any] = {}
    exec(compile(_PROBE, filename, "exec"), globals_, namespace)
    function: types.FunctionType = namespace["schedule"]
    return function


def _replacement(kind: str) -> tuple[object, dict[str, Any]]:
    from vllm.v1.core.sched import scheduler as sched_module

    own = sched_module.__dict__
    if kind == "string-code":  # the module's globals, but code from exec'd text
        return _defined(own, "<string>"), own
    if kind == "other-globals":  # the installed file's name, but globals of its own
        return _defined(dict(own), sched_module.__file__), own
    if kind == "wrapper":  # module, file and globals right, but a functools.wraps wrapper
        wrapper = _defined(own, sched_module.__file__)
        return functools.update_wrapper(wrapper, sched_module.Scheduler.schedule), own
    if kind == "bound-method":  # the installed method, bound: not a plain function
        return types.MethodType(sched_module.Scheduler.schedule, object()), own
    assert kind == "no-file-globals"  # an existing file's code, globals with no __file__
    bare: dict[str, Any] = {"__name__": "bidkv_probe"}
    return _defined(bare, sched_module.__file__), bare


@pytest.mark.parametrize(
    "kind", ["string-code", "other-globals", "wrapper", "bound-method", "no-file-globals"])
def test_every_replacement_of_the_installed_method_is_refused(
    rewrite: ModuleType, kind: str
) -> None:
    """Rule: only the plain function that the scheduler module's own file defines, in that
    module's globals and not wrapped, is rewritten; anything else is refused as a
    replacement, with UnsupportedHostError, never OSError / TypeError out of the check.
    Kills the mutants that drop, in ``_check_installed_method``, the ``FunctionType`` test,
    the ``__wrapped__`` test, the globals identity or the ``_same_file`` test, and in
    ``_same_file`` the ``except OSError`` or the ``isinstance(second, str)`` guard."""
    original, module_globals = _replacement(kind)
    with pytest.raises(rewrite.UnsupportedHostError, match="not the method installed") as info:
        rewrite.build_schedule(original, module_globals, version="0.33.0")  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


# -- scheduler: the no-policy fast path and the shrink state under a page model ------------


def test_no_policy_builds_no_context(
    vllm_offline: ModuleType, make_scheduler: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rule (``_bidkv_select_victim``): with no live policy the stock victim is returned
    without building a ``PreemptionContext`` (the no-policy cost is stock vLLM's). Kills
    the mutant that never takes the no-policy branch (``controller.enabled is None``): its
    victims are the same, but every decision built a context."""
    from bidkv_ext.hosts.vllm import scheduler as host

    built: list[object] = []
    real = host.PreemptionContext

    def counted(*args: Any) -> Any:
        built.append(args)
        return real(*args)

    monkeypatch.setattr(host, "PreemptionContext", counted)
    scheduler = make_scheduler(num_gpu_blocks=9)
    assert not scheduler.controller.enabled
    _pressured_digests(vllm_offline, scheduler)
    assert any(r.num_preemptions for r in scheduler.requests.values())
    assert built == []


def test_a_page_model_leaves_the_shrink_state_to_the_policy(
    vllm_offline: ModuleType, make_scheduler: Any
) -> None:
    """Rule (contract ``PreemptionContextFacts.in_shrink``): the host passes a shrink state
    only when it read kvcached's signals itself; with a registered page model (the replay's
    elastic pool) it read none, so ``in_shrink`` is ``None`` and the policy reads the
    signals (a ``False`` would make it score a shrinking pool as steady). Kills the mutant
    that starts ``in_shrink`` at ``False``."""
    from kvcached_provider import signals
    from tests.policy_helpers import PageModelSource

    scheduler = make_scheduler(num_gpu_blocks=21)
    scheduler.add_request(vllm_offline.make_request("a", list(range(100, 148)), 4, 0.0))
    scheduler.schedule()
    with signals.signals_source(PageModelSource(signals.PageModel(4, 21))):
        facts = scheduler._host_facts(scheduler.requests["a"], 1)
    assert facts.facts["a"].pages_released is not None
    assert facts.in_shrink is None


# -- peer plugin (scripts/peer_suite.sh) -----------------------------------------------------


@pytest.fixture
def peer(vllm_offline: ModuleType, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The peer plugin with a fresh list of built controllers."""
    from bidkv_ext.hosts.vllm import peer_plugin

    monkeypatch.setattr(peer_plugin, "_built", [])
    return peer_plugin


def _module(name: str, **names: object) -> ModuleType:
    module = ModuleType(name)
    vars(module).update(names)
    return module


def test_peer_plugin_patches_only_stock_names_in_tests_modules(
    peer: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rule: after collection, in ``tests`` and every ``tests.*`` module, each of the names
    ``Scheduler`` / ``AsyncScheduler`` still bound to vLLM's class is replaced by its own
    adapter subclass; names bound to anything else, and other packages' modules, are left
    alone; the number patched is kept for the summary; each test's setup patches modules
    imported since. Kills the mutants that match any module name starting with "tests",
    replace a name whatever it is bound to, drop the ``None``-module skip, miscount, swap
    the two substitutes, or make the setup hook do nothing."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from bidkv_ext.hosts.vllm import PolicyScheduler

    modules: dict[str, ModuleType | None] = {
        "tests": _module("tests", Scheduler=Scheduler),
        "tests.probe": _module("tests.probe", Scheduler=Scheduler, AsyncScheduler=AsyncScheduler),
        "tests.custom": _module("tests.custom", Scheduler=PolicyScheduler),
        "tests_elsewhere": _module("tests_elsewhere", Scheduler=Scheduler),
        "vllm_probe": _module("vllm_probe", AsyncScheduler=AsyncScheduler),
        "tests.gone": None,
    }
    monkeypatch.setattr(peer, "sys", SimpleNamespace(modules=modules))
    config = SimpleNamespace()
    peer.pytest_collection_modifyitems(None, config, [])
    assert config._bidkv_patched == 3

    def bound(name: str, attr: str) -> object:
        return getattr(modules[name], attr)

    assert bound("tests", "Scheduler") is peer.PeerScheduler
    assert bound("tests.probe", "Scheduler") is peer.PeerScheduler
    assert bound("tests.probe", "AsyncScheduler") is peer.PeerAsyncScheduler
    assert bound("tests.custom", "Scheduler") is PolicyScheduler
    assert bound("tests_elsewhere", "Scheduler") is Scheduler
    assert bound("vllm_probe", "AsyncScheduler") is AsyncScheduler
    modules["tests.late"] = _module("tests.late", Scheduler=Scheduler)
    peer.pytest_runtest_setup(None)
    assert bound("tests.late", "Scheduler") is peer.PeerScheduler


def _peer_scheduler(offline: ModuleType, cls: type, **kwargs: Any) -> Any:
    """Built as vLLM's own tests build one (no ``preemption_policy`` unless given)."""
    from vllm.v1.structured_output import StructuredOutputManager

    vllm_config, kv_cache_config = offline.build_vllm_config(
        num_gpu_blocks=9, async_scheduling=cls.__name__ == "PeerAsyncScheduler")
    return cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config, log_stats=True,
               structured_output_manager=StructuredOutputManager(vllm_config),
               block_size=16, **kwargs)


def _pressured_digests(offline: ModuleType, scheduler: Any, steps: int = 6) -> list[object]:
    from tests.test_host_adapter import _three_requests

    _three_requests(offline, scheduler)
    digests = []
    for _ in range(steps):
        out = scheduler.schedule()
        digests.append(offline.schedule_digest(out))
        scheduler.update_from_output(out, offline.runner_output_for(out, scheduler))
    return digests


class _ChooseBuiltin:
    """Always names the host's own victim (a selection, not an abstention)."""

    def select_victim(self, context: Any) -> str | None:
        return str(context.builtin_victim_id)


@pytest.mark.parametrize("variant", ["PeerScheduler", "PeerAsyncScheduler"])
def test_peer_schedulers_abstain_by_default_and_are_counted(
    peer: ModuleType, vllm_offline: ModuleType, variant: str
) -> None:
    """Rule: the peer plugin's schedulers, built without a policy, ask an always-abstaining
    one (every call counted as an abstention, the run step for step stock vLLM's); a policy
    the caller passes is kept; every one built is counted in the summary line. Kills the
    mutants that make ``AbstainingPolicy`` name the builtin victim, overwrite the caller's
    policy (assignment for ``setdefault``), drop ``_built.append``, or swap the summary's
    figures."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    cls = getattr(peer, variant)
    stock_cls = AsyncScheduler if variant == "PeerAsyncScheduler" else Scheduler
    default = _peer_scheduler(vllm_offline, cls)
    assert isinstance(default.controller.policy, peer.AbstainingPolicy)
    stock = _peer_scheduler(vllm_offline, stock_cls)
    assert _pressured_digests(vllm_offline, default) == _pressured_digests(vllm_offline, stock)
    asked = default.controller.stats
    assert asked.calls > 0 and asked.abstentions == asked.calls

    chooser = _ChooseBuiltin()
    explicit = _peer_scheduler(vllm_offline, cls, preemption_policy=chooser)
    assert explicit.controller.policy is chooser
    _pressured_digests(vllm_offline, explicit)
    chose = explicit.controller.stats
    assert chose.calls > 0 and chose.abstentions == 0
    assert peer._built == [default.controller, explicit.controller]

    lines: list[str] = []
    peer.pytest_terminal_summary(SimpleNamespace(write_line=lines.append), 0,
                                 SimpleNamespace(_bidkv_patched=5))
    calls = asked.calls + chose.calls
    assert lines == [f"bidkv peer plugin: 5 names substituted, 2 adapter schedulers built, "
                     f"policy asked {calls} times ({asked.abstentions} abstentions)"]


# The offline kit (``offline.py``) the host tests, the replay and the peer suite build on.


def test_the_smallest_pool_is_two_blocks(vllm_offline: ModuleType) -> None:
    """One of ``num_gpu_blocks`` is vLLM's null block, so 2 is the smallest usable pool and
    1 is refused by name. Kills the mutant that accepts 1 (``< 1``)."""
    with pytest.raises(ValueError, match=r"^num_gpu_blocks must be >= 2 \(one is the null "
                                         r"block\), got 1$"):
        vllm_offline.build_vllm_config(num_gpu_blocks=1)
    vllm_offline.build_vllm_config(num_gpu_blocks=2)


def test_run_to_completion_takes_at_most_max_steps(make_scheduler: Callable[..., Any],
                                                   vllm_offline: ModuleType) -> None:
    """``max_steps`` is the most steps it takes: a run needing N steps completes with
    ``max_steps=N`` and is refused with N - 1. Kills the mutant that allows one more
    (``steps > max_steps``)."""
    def loaded() -> Any:
        scheduler = make_scheduler(num_gpu_blocks=64)
        scheduler.add_request(vllm_offline.make_request("a", list(range(100, 140)), 5, 1.0))
        return scheduler

    needed = vllm_offline.run_to_completion(loaded())
    assert needed > 1
    assert vllm_offline.run_to_completion(loaded(), max_steps=needed) == needed
    with pytest.raises(RuntimeError, match=rf"^scheduler did not finish within "
                                           rf"{needed - 1} steps$"):
        vllm_offline.run_to_completion(loaded(), max_steps=needed - 1)


def test_a_step_digest_names_the_steps_preemptions(make_scheduler: Callable[..., Any],
                                                   vllm_offline: ModuleType) -> None:
    """The digest the equivalence tests compare covers the step's preempted ids, so two
    runs that preempt different requests differ. Kills the mutant that leaves them out."""
    scheduler = make_scheduler(num_gpu_blocks=9)
    for i in range(3):
        scheduler.add_request(vllm_offline.make_request(
            str(i), [1000 * (i + 1) + j for j in range(40)], 40, 10.0 + i))
    for _ in range(50):
        out = scheduler.schedule()
        scheduler.update_from_output(out, vllm_offline.runner_output_for(out, scheduler))
        if out.preempted_req_ids:
            break
    else:
        pytest.fail("no step preempted")
    assert vllm_offline.schedule_digest(out)[4] == tuple(sorted(out.preempted_req_ids))


def test_a_request_that_keeps_eos_stops_at_it(make_scheduler: Callable[..., Any],
                                              vllm_offline: ModuleType) -> None:
    """``make_request(..., ignore_eos=False)`` stops at the first EOS it samples, as a real
    request does (the replay's ``--max-tokens`` caps rely on it); with the default it
    generates ``max_tokens``. Kills the mutant that always ignores EOS."""
    finished = {}
    for keep, rid in ((False, "stops"), (True, "runs-on")):
        scheduler = make_scheduler(num_gpu_blocks=64)
        scheduler.add_request(vllm_offline.make_request(
            rid, list(range(100, 120)), 10, 1.0, ignore_eos=keep))
        out = scheduler.schedule()
        sampled = vllm_offline.ModelRunnerOutput(
            req_ids=[rid], req_id_to_index={rid: 0},
            sampled_token_ids=[[vllm_offline.EOS_TOKEN_ID]])
        scheduler.update_from_output(out, sampled)
        finished[rid] = not scheduler.has_unfinished_requests()
    assert finished == {"stops": True, "runs-on": False}
