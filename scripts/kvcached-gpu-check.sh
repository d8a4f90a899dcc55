#!/usr/bin/env bash
# Runs tests/test_kvcached_real.py against a real kvcached on a CUDA machine.
#
#   bash scripts/kvcached-gpu-check.sh KVCACHED_SDIST_DIR [WHEEL_DIR] [PYTEST ARGS...]
#
# KVCACHED_SDIST_DIR: an unpacked kvcached sdist (0.1.6 is the version the provider follows);
# its extension is built in place against the machine's CUDA torch (>= 2.10).
# WHEEL_DIR: optional wheels for what the machine lacks (pydantic, platformdirs, posix_ipc...),
# installed into a private directory, for machines that cannot reach a package index
# (pass '' for none, to give PYTEST ARGS without wheels).
# Nothing is installed into the machine's Python.
set -euo pipefail
# An exported CDPATH would send a relative cd elsewhere and make it print the directory,
# which $(cd ... && pwd) would then capture as a second line of SDIST.
unset CDPATH
# Relative arguments name paths from where the script was called, not from the repo root.
SDIST=$(cd "${1:?usage: kvcached-gpu-check.sh KVCACHED_SDIST_DIR [WHEEL_DIR] [PYTEST ARGS...]}" && pwd)
WHEELS=${2:+$(cd "$2" && pwd)}
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=$(mktemp -d)
SMOKE_LOG="$SITE/smoke.log"
trap 'rm -rf "$SITE"' EXIT
if [ -n "$WHEELS" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl
fi
export PYTHONPATH="$SITE"
build() { (cd "$SDIST" && rm -rf build && MAX_JOBS=${MAX_JOBS:-8} "$PY" setup.py -q build_ext --inplace >/dev/null); }
# Constructing a page allocator is the first thing that runs kvcached's C++ (it prints via
# std::cout); an extension built by one compiler and run on another's libstdc++ crashes here.
smoke() {
  "$PY" -c 'from kvcached.vmm_ops import PageAllocator
PageAllocator(1, 2 << 20, 2 << 20, 1, 0, False, True, False, 2, 0, "kvcached_gpu_check_smoke")' \
    >"$SMOKE_LOG" 2>&1
  local rc=$?
  rm -f /dev/shm/kvcached_gpu_check_smoke
  return $rc
}
build
export PYTHONPATH="$SDIST:$PWD/src:$PWD:$SITE"
if ! smoke; then
  CXX_USED=$(command -v "${CXX:-c++}" || true)
  LIBSTDCXX=$("${CXX_USED:-c++}" -print-file-name=libstdc++.so.6 2>/dev/null || true)
  echo "kvcached's extension crashed at start; retrying with $LIBSTDCXX preloaded" >&2
  export LD_PRELOAD="$LIBSTDCXX${LD_PRELOAD:+:$LD_PRELOAD}"
  if ! smoke; then
    unset LD_PRELOAD
    echo "still crashing; rebuilding with /usr/bin/g++" >&2
    export CXX=/usr/bin/g++ CC=/usr/bin/gcc
    build
    smoke || { cat "$SMOKE_LOG" >&2; echo "kvcached's extension does not run on this machine" >&2; exit 1; }
  fi
fi
"$PY" -c 'import kvcached, torch; print("kvcached", kvcached.__version__, "torch", torch.__version__, "cuda", torch.cuda.is_available())'
# Not exec: the EXIT trap must still remove the private directory. The module runs twice:
# with kvcached's prealloc thread off (exact page counts), then under kvcached's default
# (on); the fake-pool comparison runs each variant itself, so only in the first.
status=0
"$PY" -m pytest -p no:cacheprovider --noconftest -q -ra tests/test_kvcached_real.py "${@:3}" \
  || status=$?
echo "== again with kvcached's prealloc thread on"
BIDKV_REAL_KVCACHED_PREALLOC=true "$PY" -m pytest -p no:cacheprovider --noconftest -q -ra \
  tests/test_kvcached_real.py -k "not fake_pool" "${@:3}" || status=$?
exit "$status"
