"""Command line: ``python -m qualification {run,release-check,profiles,rollback}``.

Exit codes: 0 gate (or release check, or rollback step) passed; 1 it did not; 2 bad input
or an environment that cannot run the profile (one line on stderr, no traceback); 130
interrupted (SIGINT) and 143 terminated (SIGTERM), in both cases after the running arm's
server was stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import NoReturn

from qualification.errors import QualificationError, one_line
from qualification.paths import path_kind, read_regular
from qualification.profile import MAX_REPEATS, PROFILE_DIR, ManagerSpec, load_profile

__all__ = ["main"]

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RECORDS = REPO_ROOT / "qualification" / "records"


class _Parser(argparse.ArgumentParser):
    """argparse with its refusals on one line, like every other refusal of this tool (the
    sub-commands' parsers are of this class too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.splitlines())} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m qualification", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a profile's paired arms and write the record")
    run.add_argument("profile", help=f"a profile name ({PROFILE_DIR}) or a .toml path")
    run.add_argument(
        "--out", type=Path, help="output directory (default qualification/records/<profile>-<utc>)"
    )
    run.add_argument("--repeats", type=int, help="pairs per cell (default: the profile's)")
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="print the launch plan (and the manager's own --dry-run rendering) and exit",
    )
    run.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    rel = sub.add_parser("release-check", help="versions agree and a passing record exists")
    rel.add_argument("--root", type=Path, default=REPO_ROOT, help="repository root")
    rel.add_argument(
        "--records",
        type=Path,
        action="append",
        help=f"record file or directory, repeatable (default {DEFAULT_RECORDS})",
    )
    sub.add_parser("profiles", help="list the bundled profiles")
    back = sub.add_parser(
        "rollback",
        help="print the rollback plan (qualification.md §10); run its manager steps and "
        "verify the fallback only when asked",
    )
    back.add_argument("--extension-id", default=ManagerSpec().extension_id, help="bundle id")
    back.add_argument(
        "--disable", action="store_true", help="run `vllm-hust-ext extension disable ID`"
    )
    back.add_argument(
        "--forget", action="store_true", help="disable, then `vllm-hust-ext extension forget ID`"
    )
    back.add_argument(
        "--verify-log",
        type=Path,
        metavar="ENGINE_LOG",
        help="check the restarted engine's log: policy=builtin enabled=False or no policy line",
    )
    return parser


def _say(text: str) -> None:
    """Print one line: an undecodable path (surrogate escapes) or a line break from a
    record or profile is shown escaped rather than raising or splitting the line."""
    print(one_line(text))


def _run(args: argparse.Namespace) -> int:
    from qualification.report import procedure_notes
    from qualification.runner import ensure_out_dir, launch_plan, render_with_manager, run_profile

    if args.repeats is not None and not 1 <= args.repeats <= MAX_REPEATS:
        raise QualificationError(
            f"--repeats {args.repeats} is invalid: expected an integer from 1 to {MAX_REPEATS} "
            "(pairs per cell)"
        )
    profile = load_profile(args.profile)
    if args.dry_run:
        plan = launch_plan(profile, repeats=args.repeats)
        with tempfile.TemporaryDirectory(prefix="qualification-dry-run-") as tmp:
            render_with_manager(profile, plan, Path(tmp))
        print(json.dumps(plan, indent=2, sort_keys=True))
        return 0
    out = ensure_out_dir(args.out, profile)

    def log(message: str) -> None:
        if not args.quiet:
            print(message, file=sys.stderr, flush=True)

    result = run_profile(profile, out, repeats=args.repeats, log=log)
    _say(f"record: {result.record_path}")
    _say(f"report: {result.report_path}")
    _say(f"plot:   {result.plot_path}")
    for outcome in result.outcomes:
        _say(f"{outcome.cell}: {outcome.label} ({outcome.reason})")
    for note in procedure_notes(result.outcomes):
        _say(f"policy environment missing: {note}")
    gate = result.record["gate"]
    assert isinstance(gate, dict)
    if result.passed:
        print("gate: PASSED")
        return 0
    print("gate: FAILED")
    for failure in gate["failures"]:
        _say(f"  - {failure}")
    return 1


def _release_check(args: argparse.Namespace) -> int:
    from qualification.release import RECORDS_EXPECTED, check_release

    missing = [
        str(p) for p in args.records or []
        if path_kind(p, f"--records {p}", RECORDS_EXPECTED) == "missing"
    ]
    if missing:
        raise QualificationError(
            f"--records {', '.join(missing)}: no such file or directory; "
            f"expected {RECORDS_EXPECTED}"
        )
    records = args.records or [DEFAULT_RECORDS]
    result = check_release(args.root, records)
    if result.passed:
        _say(
            f"release check passed for {result.version}; "
            f"records: {', '.join(result.matched_records)}"
        )
        return 0
    _say(f"release check FAILED for {result.version or 'unknown version'}; missing:")
    for problem in result.problems:
        _say(f"  - {problem}")
    return 1


def _read_log(path: Path) -> str:
    # A named FIFO (or a device) is refused, not waited on: a plain open blocks until a
    # writer. A shell's pipe (/dev/stdin, <(docker logs ...)) has its writer and is read.
    try:
        return read_regular(path, unnamed_pipe=True).decode("utf-8", errors="replace")
    except OSError as exc:
        raise QualificationError(
            f"--verify-log {path}: cannot be read ({exc.strerror or exc}); "
            "expected the restarted engine's log file"
        ) from None


def _rollback(args: argparse.Namespace) -> int:
    from qualification.rollback import manager_step, plan, verify_fallback

    ext = args.extension_id
    if not ext or not ext.isprintable():
        raise QualificationError(f"--extension-id {ext!r} is invalid: expected a bundle id")
    log_text = None if args.verify_log is None else _read_log(args.verify_log)
    verbs = (["disable"] if args.disable or args.forget else []) + (
        ["forget"] if args.forget else []
    )
    if not verbs and log_text is None:
        for line in plan(ext):
            _say(line)
        return 0
    for verb in verbs:
        ok, said = manager_step(ManagerSpec().command, verb, ext)
        _say(said)
        if not ok:
            return 1
    if log_text is not None:
        fallback = verify_fallback(log_text)
        _say(f"fallback {'verified' if fallback.verified else 'NOT verified'}: {fallback.detail}")
        return 0 if fallback.verified else 1
    return 0


class _Terminated(BaseException):
    """SIGTERM, raised where the run is so that its ``finally`` blocks stop the server."""


def _on_sigterm(_signum: int, _frame: FrameType | None) -> None:
    # Once: a second SIGTERM must not cut short the stop of the arm's server, whose
    # manager and engine run in their own sessions and would be orphaned.
    signal.signal(signal.SIGTERM, lambda _s, _f: None)
    raise _Terminated


@contextmanager
def _sigterm_stops_the_run() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            with _sigterm_stops_the_run():
                return _run(args)
        if args.command == "release-check":
            return _release_check(args)
        if args.command == "rollback":
            return _rollback(args)
        for path in sorted(PROFILE_DIR.glob("*.toml")):
            print(path.stem)
        return 0
    except QualificationError as exc:
        print(f"qualification: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("qualification: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        print("qualification: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM


def _stdout_reader_left() -> bool:
    """Whether standard output is a pipe whose reader went away (``... | head -1``): the
    write end of such a pipe polls as an error. (The manager and kvcached-provider have their own
    copy: the packages import nothing from one another.)"""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no real descriptor: not a pipe's end
        return False


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; a reader that left the pipe ends it quietly, as a pipeline's writer
    ends, with the shell's status for SIGPIPE (no traceback, no "Exception ignored")."""
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # here, not at exit, where a broken pipe can still be told apart
    except BrokenPipeError:
        if not _stdout_reader_left():
            raise
        devnull = os.open(os.devnull, os.O_WRONLY)  # so the exit's last flush cannot fail
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE
