#!/usr/bin/env bash
# The test command: lint and type-check src/, manager/src/ and qualification/, then the whole test suite against the
# real vLLM 0.33.0 scheduler installed by scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${BIDKV_VENV:-.venv}
export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
"$VENV/bin/ruff" check src manager/src qualification
"$VENV/bin/mypy" src manager/src qualification
exec "$VENV/bin/python" -m pytest -q "$@"
