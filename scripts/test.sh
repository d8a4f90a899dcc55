#!/usr/bin/env bash
# The test command: lint and type-check src/, manager/src/ and qualification/, then the whole test suite against the
# real vLLM 0.33.0 scheduler installed by scripts/setup.sh.
set -euo pipefail
CDPATH='' cd -- "$(dirname -- "$0")/.."
VENV=${BIDKV_VENV:-.venv}
# Absolute, as in setup.sh: a message saying what to remove must not name another directory
# when read from where the command was typed.
case $VENV in /*) ;; *) VENV=$PWD/$VENV ;; esac
[ -x "$VENV/bin/python" ] \
    || { echo "test: no virtual environment at $VENV; run bash scripts/setup.sh first" >&2; exit 1; }
"$VENV/bin/python" -c 'import sys, ruff, mypy, pytest; sys.exit(sys.version_info[:2] != (3, 11))' \
    2>/dev/null \
    || { echo "test: $VENV is not a complete set-up (Python 3.11 with ruff, mypy and pytest); remove it and run bash scripts/setup.sh" >&2; exit 1; }
export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Through the venv's python, not its bin/ scripts: those keep the path the venv was built at.
"$VENV/bin/python" -m ruff check src manager/src qualification
"$VENV/bin/python" -m mypy src manager/src qualification
exec "$VENV/bin/python" -m pytest -q "$@"
