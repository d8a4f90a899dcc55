"""The one error type the CLI turns into a one-line message and a non-zero exit."""

from __future__ import annotations


class QualificationError(Exception):
    """Bad input or an environment that cannot run a profile; the message names the thing."""
