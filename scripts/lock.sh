#!/usr/bin/env bash
# Refresh the locked dependency sets in requirements/ (`make lock`), with uv's resolver, exact
# versions and sha256 hashes, for CPython 3.11 on Linux x86_64:
#   requirements/dev.txt        pdx's .venv: pyproject.toml's dependencies and its `dev` extra
#   requirements/runtime.txt    pdx alone (the container image): the same pins, no dev tools
#   requirements/bootstrap.txt  uv itself, which the Makefile installs with pip first
#   requirements/vllm.txt       .venv-vllm (scripts/vllm-env.sh), from requirements/vllm.in
#   requirements/nixl.txt       NIXL for .venv-vllm, installed without its dependencies
# A pin that is still allowed is kept (uv reads the current file as its preference); UPGRADE=1
# takes the newest allowed versions instead. torch is the CPU build (2.13.0+cpu), found through
# pip's find-links (scripts/pip-find-links) or UV_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
#
#   scripts/lock.sh            UV (default .venv/bin/uv), UPGRADE=1
set -euo pipefail
cd "$(dirname "$0")/.."
UV=${UV:-.venv/bin/uv}
[ -x "$UV" ] || { echo "error: no uv at $UV (make install bootstraps it)" >&2; exit 2; }

args=(--quiet --generate-hashes --python-version 3.11 --python-platform x86_64-manylinux_2_28
  --custom-compile-command "make lock")
[ "${UPGRADE:-0}" = 1 ] && args+=(--upgrade)
for dir in $(scripts/pip-find-links); do args+=(--find-links "$dir"); done

compile() {  # compile OUTPUT INPUT... [uv options]
  local out=$1
  shift
  echo "lock: $out" >&2
  "$UV" pip compile "${args[@]}" -o "$out" "$@"
}

compile requirements/dev.txt pyproject.toml --extra dev
# The runtime set is the dev set's pins, less what only the dev tools need.
compile requirements/runtime.txt pyproject.toml --constraint requirements/dev.txt
compile requirements/bootstrap.txt requirements/bootstrap.in
compile requirements/vllm.txt requirements/vllm.in \
  --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec
compile requirements/nixl.txt requirements/nixl.in --no-deps
