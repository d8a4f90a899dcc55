"""``kvcached-provider``: operator commands for the kvcached bundle.

``kvcached-provider limit --ipc NAME SIZE`` applies a memory limit to instance ``NAME``
through kvcached's revisioned control API (see :mod:`kvcached_provider.limit` for where the
API runs, how revisions persist and how mixing with ``kvctl limit`` is refused). It prints
the result state first (``applied``, ``deferred``, ``stale``, ``conflict``, ``unavailable``
or ``rejected``) and exits 0 only for ``applied``/``deferred``, 1 for the other states and
2 for bad input.

``kvcached-provider check`` prints the bundle's pre-launch checks (exit 1 if any fails).

``kvcached-provider cleanup --ipc NAME`` removes the instance's leaked control records and
tensor-parallel socket directory, keeping anything a live process still uses (see
:mod:`kvcached_provider.segments`); exit 0 when nothing of the instance is left, 1 when
something was kept, 2 for bad input. ``--dry-run`` only reports.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from kvcached_provider import EXTENSION_ID
from kvcached_provider.checks import SettingError
from kvcached_provider.limit import (
    LimitError,
    LimitInterrupted,
    LimitResult,
    parse_size,
    set_limit,
    validate_ipc_name,
    validate_timeout,
)
from kvcached_provider.segments import CleanupError, cleanup

__all__ = ["main"]

# The manifest ships beside the package: ``<site-packages>/manifests/kvcached/`` in a wheel,
# ``<repo>/manifests/kvcached/`` in an editable install (the package is under ``src/``).
_MANIFEST_CANDIDATES = tuple(
    Path(__file__).resolve().parents[n] / "manifests" / "kvcached" / "vllm-hust-extension-v0.2.json"
    for n in (1, 2)
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvcached-provider", description="Operator commands for the kvcached bundle.")
    sub = parser.add_subparsers(dest="command", required=True)
    limit = sub.add_parser("limit", help="apply a revisioned memory limit to an instance")
    limit.add_argument("--ipc", required=True, metavar="NAME",
                       help="the instance's KVCACHED_IPC_NAME")
    limit.add_argument("size", metavar="SIZE", help="limit, e.g. 512M, 8G or bytes")
    limit.add_argument("--timeout", type=float, default=5.0, metavar="S",
                       help="seconds to wait for the engine's answer, and at most as long "
                            "for another limit command of the instance to finish (default 5)")
    limit.add_argument("--adopt", action="store_true",
                       help="skip the start-up comparison that detects a pre-existing kvctl "
                            "limit on the first revisioned limit of an engine run")
    limit.add_argument("--json", action="store_true", help="print the full result as JSON")
    check = sub.add_parser("check", help="run the bundle's pre-launch checks")
    check.add_argument("--ipc", metavar="NAME", help="KVCACHED_IPC_NAME to check")
    cleanup = sub.add_parser(
        "cleanup", help="remove an instance's leaked control records and TP socket directory")
    cleanup.add_argument("--ipc", required=True, metavar="NAME",
                         help="the instance's KVCACHED_IPC_NAME")
    cleanup.add_argument("--dry-run", action="store_true",
                         help="report what would be removed, remove nothing")
    return parser


def _summary(result: LimitResult) -> str:
    parts = [result.status, f"revision={result.revision}", f"limit_bytes={result.limit_bytes}",
             f"effective_limit_bytes={result.effective_limit_bytes}",
             f"mapped_bytes={result.mapped_bytes}", f"via={result.via}"]
    if result.reason:
        parts.append(f"reason={result.reason}")
    line = " ".join(parts)
    return f"{line}\n{result.detail}" if result.detail else line


def _limit(args: argparse.Namespace) -> int:
    validate_timeout(args.timeout)
    validate_ipc_name(args.ipc)
    result = set_limit(args.ipc, parse_size(args.size), timeout_s=args.timeout,
                       adopt=args.adopt)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, sort_keys=True))
    else:
        print(_summary(result))
    return 0 if result.accepted else 1


def _check(args: argparse.Namespace) -> int:
    from kvcached_provider.checks import check

    manifest: dict[str, object] = {}  # not found: the checks fall back to their defaults
    for candidate in _MANIFEST_CANDIDATES:
        try:
            manifest = json.loads(candidate.read_text(encoding="utf-8"))
            break
        except (OSError, ValueError):
            continue
    # `--ipc ''` is checked as given (and fails), not read as "no --ipc".
    configuration = ({"environment": {"KVCACHED_IPC_NAME": args.ipc}}
                     if args.ipc is not None else {})
    lines = check(manifest, configuration)
    for ok, text in lines:
        print(f"{'ok  ' if ok else 'FAIL'} {text}")
    failed = sum(1 for ok, _ in lines if not ok)
    print(f"{EXTENSION_ID}: {failed} check(s) failed" if failed else f"{EXTENSION_ID}: ready")
    return 1 if failed else 0


def _cleanup(args: argparse.Namespace) -> int:
    validate_ipc_name(args.ipc)
    report = cleanup(args.ipc, dry_run=args.dry_run)
    for line in report.lines():
        print(line)
    return 0 if report.clean else 1


_COMMANDS = {"limit": _limit, "check": _check, "cleanup": _cleanup}


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is, so that it unwinds as on Ctrl-C: a limit
    request still waiting for the engine is withdrawn rather than left to apply later."""


def _terminate(signum: int, frame: object) -> None:
    raise _Terminated


def _interrupted_status(interrupt: BaseException | None) -> int:
    return 128 + (signal.SIGTERM if isinstance(interrupt, _Terminated) else signal.SIGINT)


def _main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return _COMMANDS[args.command](args)
    except LimitInterrupted as exc:
        print(f"kvcached-provider: {exc}", file=sys.stderr)
        return _interrupted_status(exc.__cause__)
    except (LimitError, CleanupError, SettingError) as exc:
        print(f"kvcached-provider: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        return _interrupted_status(exc)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stdout_reader_left() -> bool:
    """Whether standard output is a pipe whose reader went away (``... | head -1``): the
    write end of such a pipe polls as an error. (The manager and qualification have their own
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


if __name__ == "__main__":
    raise SystemExit(main())
