"""The one error type the CLI turns into a one-line message and a non-zero exit."""

from __future__ import annotations


class QualificationError(Exception):
    """Bad input or an environment that cannot run a profile; the message names the thing."""


class ManagerVerbError(QualificationError):
    """A ``vllm-hust-ext`` verb refused one arm's state change; the run records that arm
    as not run (with this one-line reason) and goes on, so finished arms are kept."""
