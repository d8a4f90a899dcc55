#!/usr/bin/env bash
# Runs tests/test_kvcached_python.py: kvcached's own Python code, over a Python emulation of
# its compiled layer (tests/kvcached_cpp_emulation.py), against the tests' fake pool. No GPU
# needed; CI skips it, since kvcached's source is not installed there.
#
#   bash scripts/kvcached-python-check.sh KVCACHED_SDIST_DIR [PYTEST ARGS...]
#
# KVCACHED_SDIST_DIR: an unpacked kvcached sdist (0.1.6 is the version the provider follows);
# nothing is built or installed from it.
set -euo pipefail
unset CDPATH
SRC=$(cd "${1:?usage: kvcached-python-check.sh KVCACHED_SDIST_DIR [PYTEST ARGS...]}" && pwd)
[ -f "$SRC/kvcached/kv_cache_manager.py" ] \
  || { echo "kvcached-python-check: $SRC is not an unpacked kvcached sdist (no kvcached/kv_cache_manager.py)" >&2; exit 2; }
cd "$(dirname "$0")/.."
VENV=${BIDKV_VENV:-.venv}
BIDKV_KVCACHED_SRC=$SRC exec "$VENV/bin/python" -m pytest -p no:cacheprovider -q \
  tests/test_kvcached_python.py "${@:2}"
