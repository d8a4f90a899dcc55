"""Structural rewrite of the installed vLLM ``Scheduler.schedule`` (cpu-host.md section 7.2).

Stock vLLM has no victim hook: the choice is two inline ``if self.policy ==
SchedulingPolicy.PRIORITY`` statements inside the KV allocation retry loop of
``Scheduler.schedule``. This module reads the *installed* method's source, finds those two
statements by their AST shape (never by text), and produces a new function in which

1. the victim choice becomes ``preempted_req = self._bidkv_select_victim(request,
   scheduled_timestamp, num_new_tokens)`` (the adapter asks the policy controller), and
2. the removal becomes the PRIORITY branch unconditionally: removal by index, loop-index
   correction and full budget rollback, which is exactly stock behaviour for the FCFS tail
   and correct for any other victim.

Everything else is left as it is. The function is compiled against the globals of the
scheduler module, so every name it uses resolves as in the original. Only node shapes and
names live here; no vLLM source text is stored.

A vLLM version outside :data:`SUPPORTED_VERSIONS`, an installed file whose hash differs from
the distribution's RECORD entry, or a shape that does not match raises
:class:`UnsupportedHostError` naming the version and the statement that was not found.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import importlib.metadata
import importlib.util
import inspect
import textwrap
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ADAPTER_METHOD",
    "SUPPORTED_VERSIONS",
    "SupportedHost",
    "UnsupportedHostError",
    "build_schedule",
    "check_host",
    "rewrite_schedule_source",
]

ADAPTER_METHOD = "_bidkv_select_victim"
"""The method the rewritten ``schedule`` calls with ``(request, now, num_new_tokens)``."""

_SCHEDULER_FILE = "vllm/v1/core/sched/scheduler.py"


@dataclass(frozen=True, slots=True)
class SupportedHost:
    """A vLLM release whose ``Scheduler.schedule`` shape this rewriter was verified against."""

    version: str
    scheduler_record_hash: str  # RECORD entry: "sha256=<urlsafe b64, no padding>"


SUPPORTED_VERSIONS: dict[str, SupportedHost] = {
    "0.33.0": SupportedHost(
        version="0.33.0",
        scheduler_record_hash="sha256=12zCIldVCXITffnIk1BdC9D11II3RpHm7KQ3J3LeUBo",
    ),
}

# Names the PRIORITY removal body must touch (its rollback), checked on that body alone.
_ROLLBACK_NAMES = (
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
# Local names of Scheduler.schedule that the rewritten statements rely on.
_REQUIRED_NAMES = (
    "request",
    "scheduled_timestamp",
    "num_new_tokens",
    *_ROLLBACK_NAMES,
    "preempted_reqs",
)


class UnsupportedHostError(RuntimeError):
    """The installed vLLM cannot be adapted: wrong version, altered file, or unknown shape."""

    def __init__(self, version: str, what: str) -> None:
        self.version = version
        self.what = what
        super().__init__(
            f"bidkv_ext.hosts.vllm cannot adapt vLLM {version}: {what} "
            f"(supported versions: {', '.join(sorted(SUPPORTED_VERSIONS))})"
        )


def _record_hash_of(path: Path) -> str:
    digest = hashlib.sha256(path.read_bytes()).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def _scheduler_path() -> Path:
    spec = importlib.util.find_spec("vllm.v1.core.sched.scheduler")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("vllm.v1.core.sched.scheduler")
    return Path(spec.origin)


def _recorded_hash(distribution: str, path: Path) -> str | None:
    # Several metadata directories may claim the name (an sdist's egg-info on sys.path,
    # for instance); only the one whose RECORD lists the imported file counts.
    for dist in importlib.metadata.distributions(name=distribution):
        for entry in dist.files or ():
            if str(entry) != _SCHEDULER_FILE or entry.hash is None:
                continue
            located = Path(str(dist.locate_file(entry)))
            if located.exists() and located.samefile(path):
                return f"{entry.hash.mode}={entry.hash.value}"
    return None


def check_host(
    version: str, *, distribution: str = "vllm", scheduler_file: Path | None = None
) -> SupportedHost:
    """Check ``version`` is supported and the imported scheduler file matches its RECORD hash.

    The hash is read from the RECORD of the installed distribution that owns the imported
    ``vllm/v1/core/sched/scheduler.py``, and the file itself is hashed too, so an edited
    install is refused as well as an unknown release.
    """
    host = SUPPORTED_VERSIONS.get(version)
    if host is None:
        raise UnsupportedHostError(version, "this version is not in the supported list")
    path = scheduler_file if scheduler_file is not None else _scheduler_path()
    recorded = _recorded_hash(distribution, path)
    if recorded is None:
        raise UnsupportedHostError(
            version, f"no RECORD hash for {_SCHEDULER_FILE} in an installed {distribution!r}"
        )
    if recorded != host.scheduler_record_hash:
        raise UnsupportedHostError(
            version,
            f"{_SCHEDULER_FILE} RECORD hash {recorded} != pinned {host.scheduler_record_hash}",
        )
    actual = _record_hash_of(path)
    if actual != recorded:
        raise UnsupportedHostError(version, f"installed {_SCHEDULER_FILE} was modified ({actual})")
    return host


# --- structural predicates (node shapes only) -------------------------------------------


def _is_name(node: ast.AST | None, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _is_attr(node: ast.AST | None, base: str, attr: str) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == attr and _is_name(node.value, base)


def _is_self_running(node: ast.AST | None) -> bool:
    return _is_attr(node, "self", "running")


def _is_priority_test(node: ast.AST) -> bool:
    # self.policy == SchedulingPolicy.PRIORITY
    return (
        isinstance(node, ast.Compare)
        and len(node.ops) == 1
        and isinstance(node.ops[0], ast.Eq)
        and _is_attr(node.left, "self", "policy")
        and _is_attr(node.comparators[0], "SchedulingPolicy", "PRIORITY")
    )


def _assigns_preempted_req(stmts: list[ast.stmt], value_ok: Callable[[ast.expr], bool]) -> bool:
    if len(stmts) != 1 or not isinstance(stmts[0], ast.Assign):
        return False
    stmt = stmts[0]
    return (
        len(stmt.targets) == 1
        and _is_name(stmt.targets[0], "preempted_req")
        and value_ok(stmt.value)
    )


def _is_max_running(value: ast.expr) -> bool:
    return (
        isinstance(value, ast.Call)
        and _is_name(value.func, "max")
        and len(value.args) == 1
        and _is_self_running(value.args[0])
    )


def _is_running_tail(value: ast.expr) -> bool:
    if not isinstance(value, ast.Subscript) or not _is_self_running(value.value):
        return False
    index = value.slice
    if isinstance(index, ast.UnaryOp) and isinstance(index.op, ast.USub):
        index = index.operand
        return isinstance(index, ast.Constant) and index.value == 1
    return isinstance(index, ast.Constant) and index.value == -1


def _is_running_pop(value: ast.expr) -> bool:
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Attribute)
        and value.func.attr == "pop"
        and _is_self_running(value.func.value)
        and not value.args
    )


def _is_running_index_of_victim(stmt: ast.stmt) -> bool:
    # victim_index = self.running.index(preempted_req)
    if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
        return False
    value = stmt.value
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Attribute)
        and value.func.attr == "index"
        and _is_self_running(value.func.value)
        and len(value.args) == 1
        and _is_name(value.args[0], "preempted_req")
    )


def _names_in(nodes: list[ast.stmt]) -> set[str]:
    return {n.id for stmt in nodes for n in ast.walk(stmt) if isinstance(n, ast.Name)}


def _is_allocate_slots_with(node: ast.AST) -> bool:
    # with record_function_or_nullcontext("schedule: allocate_slots"):
    if not isinstance(node, ast.With) or len(node.items) != 1:
        return False
    call = node.items[0].context_expr
    return (
        isinstance(call, ast.Call)
        and _is_name(call.func, "record_function_or_nullcontext")
        and len(call.args) == 1
        and isinstance(call.args[0], ast.Constant)
        and call.args[0].value == "schedule: allocate_slots"
    )


def _allocates_with_num_new_tokens(stmts: list[ast.stmt]) -> bool:
    # new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens, ...)
    for node in (n for stmt in stmts for n in ast.walk(stmt)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "allocate_slots"
            and len(node.args) >= 2
            and _is_name(node.args[0], "request")
            and _is_name(node.args[1], "num_new_tokens")
        ):
            return True
    return False


def _preempts_with_timestamp(stmts: list[ast.stmt]) -> bool:
    # self._preempt_request(preempted_req, scheduled_timestamp, ...)
    for node in (n for stmt in stmts for n in ast.walk(stmt)):
        if (
            isinstance(node, ast.Call)
            and _is_attr(node.func, "self", "_preempt_request")
            and len(node.args) >= 2
            and _is_name(node.args[0], "preempted_req")
            and _is_name(node.args[1], "scheduled_timestamp")
        ):
            return True
    return False


def _only(nodes: Iterator[ast.AST] | list[Any], version: str, what: str) -> Any:
    found = list(nodes)
    if len(found) != 1:
        raise UnsupportedHostError(version, f"expected exactly one {what}, found {len(found)}")
    return found[0]


# --- the rewrite ----------------------------------------------------------------------------


def rewrite_schedule_source(source: str, *, version: str) -> ast.Module:
    """Rewrite the source of a ``schedule`` method; return the new module AST.

    ``source`` is the method's source (indentation is removed). Raises
    :class:`UnsupportedHostError` naming the first statement whose shape does not match.
    """
    tree, func = _parse_schedule(source, version)
    loop = _allocation_retry_loop(func, version)
    body: list[ast.stmt] = loop.body
    choice_at, removal_at, removal = _victim_statements(body, version)
    choice = body[choice_at]
    # Splice: the choice becomes one call, the removal becomes its PRIORITY body.
    loop.body = [
        *body[:choice_at],
        ast.copy_location(_adapter_call(), choice),
        *body[choice_at + 1 : removal_at],
        *removal.body,
        *body[removal_at + 1 :],
    ]
    ast.fix_missing_locations(tree)
    return tree


def _parse_schedule(source: str, version: str) -> tuple[ast.Module, ast.FunctionDef]:
    """The parsed source and its undecorated ``schedule`` using every required local."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError as exc:
        raise UnsupportedHostError(
            version, f"Scheduler.schedule source does not parse: {exc}"
        ) from exc
    func = _only(
        (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "schedule"),
        version,
        "statement 'def schedule(self, ...)'",
    )
    if func.decorator_list:
        raise UnsupportedHostError(version, "statement 'def schedule' is decorated")
    all_names = _names_in(func.body)
    missing = [name for name in _REQUIRED_NAMES if name not in all_names]
    if missing:
        raise UnsupportedHostError(
            version, f"local name(s) {', '.join(missing)} not used in schedule"
        )
    return tree, func


def _allocation_retry_loop(func: ast.FunctionDef, version: str) -> ast.While:
    """The ``while True`` that retries ``allocate_slots`` after each preemption."""
    with_node = _only(
        (n for n in ast.walk(func) if _is_allocate_slots_with(n)),
        version,
        "statement 'with record_function_or_nullcontext(\"schedule: allocate_slots\")'",
    )
    loop: ast.While = _only(
        (
            n
            for n in with_node.body
            if isinstance(n, ast.While)
            and isinstance(n.test, ast.Constant)
            and n.test.value is True
        ),
        version,
        "statement 'while True' in the allocate_slots block",
    )
    if not _allocates_with_num_new_tokens(loop.body):
        raise UnsupportedHostError(
            version,
            "statement 'self.kv_cache_manager.allocate_slots(request, num_new_tokens, ...)'",
        )
    return loop


def _victim_statements(body: list[ast.stmt], version: str) -> tuple[int, int, ast.If]:
    """Where the loop chooses the victim and where it removes it (two PRIORITY tests),
    each checked to have the shape the splice relies on; and the removal statement."""
    ifs = [(i, s) for i, s in enumerate(body)
           if isinstance(s, ast.If) and _is_priority_test(s.test)]
    if len(ifs) != 2:
        raise UnsupportedHostError(
            version,
            "expected two statements 'if self.policy == SchedulingPolicy.PRIORITY' in the "
            f"allocation retry loop, found {len(ifs)}",
        )
    (choice_at, choice), (removal_at, removal) = ifs
    if not (
        _assigns_preempted_req(choice.body, _is_max_running)
        and _assigns_preempted_req(choice.orelse, _is_running_tail)
    ):
        raise UnsupportedHostError(
            version,
            "victim choice statement 'preempted_req = max(self.running, ...)' / "
            "'preempted_req = self.running[-1]'",
        )
    if not (
        removal.body
        and _is_running_index_of_victim(removal.body[0])
        and any(isinstance(s, ast.Delete) for s in removal.body)
        and _assigns_preempted_req(removal.orelse, _is_running_pop)
    ):
        raise UnsupportedHostError(
            version,
            "removal statement 'victim_index = self.running.index(preempted_req)' ... / "
            "'preempted_req = self.running.pop()'",
        )
    missing = [name for name in _ROLLBACK_NAMES if name not in _names_in(removal.body)]
    if missing:
        raise UnsupportedHostError(
            version, f"budget rollback in the PRIORITY removal does not use {', '.join(missing)}"
        )
    if not _preempts_with_timestamp(body[removal_at + 1 :]):
        raise UnsupportedHostError(
            version, "statement 'self._preempt_request(preempted_req, scheduled_timestamp, ...)'"
        )
    return choice_at, removal_at, removal


def _adapter_call() -> ast.Assign:
    """``preempted_req = self.<ADAPTER_METHOD>(request, scheduled_timestamp, num_new_tokens)``"""
    return ast.Assign(
        targets=[ast.Name(id="preempted_req", ctx=ast.Store())],
        value=ast.Call(
            func=ast.Attribute(
                value=ast.Name(id="self", ctx=ast.Load()), attr=ADAPTER_METHOD, ctx=ast.Load()
            ),
            args=[
                ast.Name(id="request", ctx=ast.Load()),
                ast.Name(id="scheduled_timestamp", ctx=ast.Load()),
                ast.Name(id="num_new_tokens", ctx=ast.Load()),
            ],
            keywords=[],
        ),
    )


def _same_file(first: str, second: object) -> bool:
    if not isinstance(second, str):
        return False
    if first == second:
        return True
    try:
        return Path(first).samefile(second)
    except OSError:  # "<string>", a removed file, ...
        return False


def _check_installed_method(
    original: Callable[..., Any], module_globals: dict[str, Any], version: str
) -> None:
    """``original`` must be the method defined in the scheduler module itself.

    A vLLM plugin (or any patch) may replace ``Scheduler.schedule`` before the adapter is
    imported. Rewriting that would not rewrite the hash-checked installed method: a
    ``functools.wraps`` wrapper's source is the original's (``inspect`` follows
    ``__wrapped__``), so the wrapper would be dropped silently and its defaults copied
    onto the rewritten method; a replacement from another module would be compiled
    against the wrong globals. Either is refused at class creation instead.
    """
    code = getattr(original, "__code__", None)
    module_file = module_globals.get("__file__")
    if (
        isinstance(original, types.FunctionType)
        and code is not None
        and getattr(original, "__wrapped__", None) is None
        and original.__globals__ is module_globals
        and _same_file(code.co_filename, module_file)
    ):
        return
    where = getattr(code, "co_filename", None) or type(original).__name__
    name = f"{getattr(original, '__module__', '?')}.{getattr(original, '__qualname__', '?')}"
    raise UnsupportedHostError(
        version,
        f"Scheduler.schedule is not the method installed in {module_file} but {name} "
        f"from {where} (a plugin or patch replaced it before the adapter was imported)",
    )


def build_schedule(
    original: Callable[..., Any], module_globals: dict[str, Any], *, version: str
) -> types.FunctionType:
    """Rewrite ``original`` (the installed ``Scheduler.schedule``) and compile it.

    ``original`` must be the method as the scheduler module defines it (not wrapped or
    replaced). The code object's filename names the adapter and the vLLM version; line
    numbers are shifted to match the installed file, so tracebacks point at the real lines.
    """
    _check_installed_method(original, module_globals, version)
    try:
        lines, first_line = inspect.getsourcelines(original)
    except (OSError, TypeError) as exc:
        raise UnsupportedHostError(
            version, f"source of Scheduler.schedule unavailable: {exc}"
        ) from exc
    tree = rewrite_schedule_source("".join(lines), version=version)
    ast.increment_lineno(tree, first_line - 1)
    filename = f"<bidkv_ext.hosts.vllm adapter: Scheduler.schedule rewritten for vLLM {version}>"
    code = compile(tree, filename, "exec")
    namespace: dict[str, Any] = {}
    # Globals are the scheduler module's own, so SchedulingPolicy, time, etc. resolve;
    # the separate locals dict keeps the new function out of that module.
    exec(code, module_globals, namespace)
    func = namespace["schedule"]
    if not isinstance(func, types.FunctionType):  # pragma: no cover - exec defines it
        raise UnsupportedHostError(version, "rewritten schedule is not a function")
    func.__defaults__ = getattr(original, "__defaults__", None)
    func.__kwdefaults__ = getattr(original, "__kwdefaults__", None)
    func.__doc__ = original.__doc__
    return func
