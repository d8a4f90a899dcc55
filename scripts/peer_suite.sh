#!/usr/bin/env bash
# Peer suite (not part of CI): vLLM 0.33.0's own text-only scheduler tests,
# tests/v1/core/test_scheduler.py and test_prefix_caching.py, run twice on this machine:
# once against stock vLLM and once with bidkv_ext.hosts.vllm's PolicyScheduler (and
# PolicyAsyncScheduler) substituted for the scheduler, with an always-abstaining policy.
# Prints the pass counts side by side.
#
# The tests exist only in vLLM's sdist. It is obtained at run time (cpu-host.md section 6)
# into a cache directory, never into this repository:
#   ${BIDKV_PEER_CACHE:-${XDG_CACHE_HOME:-~/.cache}/bidkv-peer-suite}
# A throwaway build-tools venv there lets pip prepare the sdist's metadata without
# build isolation (isolation would pull CUDA torch). First run: a few minutes; later runs
# reuse the extracted tests.
#
# Usage: scripts/peer_suite.sh [extra pytest args]    (BIDKV_VENV overrides .venv)
set -euo pipefail
# An exported CDPATH would send a relative cd elsewhere and make it print the directory,
# which $(cd ... && pwd) would then capture as a second line of ROOT.
unset CDPATH
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${BIDKV_VENV:-$ROOT/.venv}
# A relative BIDKV_VENV is taken from the repository root, as setup.sh and test.sh take it.
case $VENV in /*) ;; *) VENV=$ROOT/$VENV ;; esac
PY="$VENV/bin/python"
VERSION=0.33.0
CACHE=${BIDKV_PEER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/bidkv-peer-suite}
SRC="$CACHE/vllm-$VERSION"
FILES=(tests/v1/core/test_scheduler.py tests/v1/core/test_prefix_caching.py)

die() { echo "peer_suite: $*" >&2; exit 2; }
[ -x "$PY" ] || die "no Python at $PY (run scripts/setup.sh or set BIDKV_VENV)"
"$PY" -c 'import vllm, sys; sys.exit(vllm.__version__ != "'$VERSION'")' 2>/dev/null \
  || die "vLLM $VERSION is not installed in $VENV"
mkdir -p "$CACHE"

obtain_sdist() {
  local tools="$CACHE/build-tools" dl="$CACHE/download"
  # The stamp is written last: tools left half-built by a failed or interrupted install
  # (pip there, setuptools-rust or the .pth not) are rebuilt, not reused.
  if [ ! -f "$tools/complete" ]; then
    echo "peer_suite: creating build-tools venv in $tools"
    rm -rf "$tools"
    "$("$PY" -c 'import sys; print(sys.base_prefix)')/bin/python3" -m venv "$tools"
    "$tools/bin/pip" install -q 'setuptools>=77,<81' setuptools-rust setuptools-scm wheel \
      cmake ninja jinja2
    # vLLM's setup.py imports torch: let the tools venv see the project venv's packages
    # (after its own, so its setuptools pin wins) instead of installing torch twice.
    local own main
    own=$("$tools/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    main=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    echo "$main" > "$own/_bidkv_project_venv.pth"
    touch "$tools/complete"
  fi
  echo "peer_suite: downloading the vLLM $VERSION sdist (47 MB)"
  rm -rf "$dl" && mkdir -p "$dl"
  VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE=$VERSION "$tools/bin/pip" download -q \
    --no-deps --no-binary :all: --no-build-isolation -d "$dl" "vllm==$VERSION"
  local tarball="$dl/vllm-$VERSION.tar.gz"
  [ -f "$tarball" ] || die "pip did not produce $tarball"
  local tmp="$CACHE/extract.$$"
  rm -rf "$tmp" && mkdir -p "$tmp"
  tar -xzf "$tarball" -C "$tmp"
  # The sdist's own vllm/ package would shadow the installed wheel: move it aside.
  mv "$tmp/vllm-$VERSION/vllm" "$tmp/vllm-$VERSION/_sdist_vllm_package"
  rm -rf "$SRC" && mv "$tmp/vllm-$VERSION" "$SRC" && rm -rf "$tmp"
}

prepare_env() {
  # vLLM's tests/conftest.py needs tblib (einops is pinned in the venv already).
  if ! "$PY" -c 'import tblib' 2>/dev/null && [ ! -d "$CACHE/pylib/tblib" ]; then
    "$VENV/bin/pip" install -q --target "$CACHE/pylib" tblib
  fi
  # The tests name facebook/opt-125m; give them its standard config (cpu-host.md section 4)
  # in a Hugging Face cache layout, written here, nothing downloaded.
  local repo="$CACHE/hf/hub/models--facebook--opt-125m" rev=0123456789abcdef0123456789abcdef01234567
  mkdir -p "$repo/refs" "$repo/snapshots/$rev"
  printf '%s' "$rev" > "$repo/refs/main"
  cat > "$repo/snapshots/$rev/config.json" <<'EOF'
{"architectures": ["OPTForCausalLM"], "model_type": "opt", "vocab_size": 50272,
 "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "ffn_dim": 3072,
 "max_position_embeddings": 2048, "word_embed_proj_dim": 768, "bos_token_id": 2,
 "eos_token_id": 2, "pad_token_id": 1, "torch_dtype": "float16",
 "do_layer_norm_before": true, "enable_bias": true, "activation_function": "relu",
 "dropout": 0.1, "attention_dropout": 0.0, "activation_dropout": 0.0,
 "layer_norm_elementwise_affine": true, "init_std": 0.02, "layerdrop": 0.0,
 "use_cache": true, "prefix": "</s>"}
EOF
}

# run LABEL FILE [pytest args...] -> prints "passed failed skipped errors total"
run() {
  local label=$1 file=$2; shift 2
  local xml="$CACHE/results/$label-$(basename "$file" .py).xml"
  mkdir -p "$CACHE/results"
  (
    cd "$SRC"
    export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HOME="$CACHE/hf"
    export PYTHONPATH="$CACHE/pylib${PYTHONPATH:+:$PYTHONPATH}"
    "$PY" -m pytest -q -p no:cacheprovider --junitxml="$xml" "$@" "$file" \
      > "$CACHE/results/$label-$(basename "$file" .py).log" 2>&1 || true
  )
  "$PY" - "$xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as exc:
    print(f"? ? ? ? ? ({exc})")
    raise SystemExit(0)
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
t = sum(int(s.get("tests", 0)) for s in suites)
f = sum(int(s.get("failures", 0)) for s in suites)
e = sum(int(s.get("errors", 0)) for s in suites)
k = sum(int(s.get("skipped", 0)) for s in suites)
print(t - f - e - k, f, k, e, t)
EOF
}

[ -d "$SRC/tests/v1/core" ] || obtain_sdist
prepare_env

printf '%-28s %-10s %8s %8s %8s %8s %8s\n' file run passed failed skipped errors total
for file in "${FILES[@]}"; do
  read -r p f k e t < <(run stock "$file" "$@")
  printf '%-28s %-10s %8s %8s %8s %8s %8s\n' "$(basename "$file")" stock "$p" "$f" "$k" "$e" "$t"
  read -r p f k e t < <(run bidkv "$file" -p bidkv_ext.hosts.vllm.peer_plugin "$@")
  printf '%-28s %-10s %8s %8s %8s %8s %8s\n' "" bidkv "$p" "$f" "$k" "$e" "$t"
  grep -h "bidkv peer plugin" "$CACHE/results/bidkv-$(basename "$file" .py).log" || true
done
echo "logs and JUnit XML: $CACHE/results"
