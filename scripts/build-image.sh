#!/usr/bin/env bash
# Build the pdx container image (Containerfile) without a registry and without network access
# beyond this machine's own package sources:
#   1. a wheelhouse in build/image/wheels: exactly the locked runtime set
#      (requirements/runtime.txt, hash-checked, the CPU torch included) and pdx's own wheel, from
#      the pip sources configured here (`pip config list`); with --target vllm also
#      build/image/wheels-vllm with the vLLM environment's locks (requirements/vllm.txt, nixl.txt);
#   2. the base: a Debian bookworm root filesystem made with mmdebstrap from the configured
#      Debian mirror and imported as localhost/pdx-base:bookworm (BASE_IMAGE=... uses an image
#      you have instead, e.g. debian:bookworm-slim where a registry is reachable);
#   3. the build, with the first of docker, podman, buildah that is installed and answers, RUN
#      steps without network (pip installs only from the wheelhouse).
#
#   scripts/build-image.sh [--target runtime|vllm] [--dry-run]
#     --dry-run  print the plan (the builder chosen or why none, the commands) and run nothing
#                that changes anything; exit 0 when a build could run, 2 when it could not
# Exit 2: nothing could build (the reason is printed); other non-zero: a step failed.
#
# Environment: IMAGE (default pdx:latest, pdx:vllm for --target vllm), BASE_IMAGE,
# BUILDER (docker|podman|buildah: only that one), CONTAINER_RUNTIME (podman/buildah OCI
# runtime, e.g. runc), PYTHON (the Python 3.11 that runs pip;
# default .venv/bin/python, else python3), DEBIAN_SUITE (bookworm), DEBIAN_SOURCES (an apt
# sources file or mirror URL; default the host's Debian sources), REBUILD_BASE=1 (remake the
# base image even when it exists).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

TARGET=runtime
DRY_RUN=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --target) TARGET=${2:?--target needs runtime or vllm}; shift ;;
    --target=*) TARGET=${1#--target=} ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
case "$TARGET" in
  runtime|vllm) ;;
  *) echo "error: --target must be runtime or vllm (got $TARGET)" >&2; exit 2 ;;
esac

OUT=build/image
WHEELS=$OUT/wheels
WHEELS_VLLM=$OUT/wheels-vllm
LOCAL_BASE=localhost/pdx-base:bookworm
DEBIAN_SUITE=${DEBIAN_SUITE:-bookworm}
BASE_PACKAGES="python3.11,python3-venv,iproute2,nftables,iperf3,iputils-ping,ca-certificates"
if [ "$TARGET" = vllm ]; then IMAGE=${IMAGE:-pdx:vllm}; else IMAGE=${IMAGE:-pdx:latest}; fi
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

say() { echo "build-image: $*"; }
die() { echo "build-image: error: $*" >&2; exit 2; }
show() {  # a command as it could be typed again
  local arg line="  \$"
  for arg in "$@"; do
    if [[ "$arg" =~ ^[][A-Za-z0-9_./:=,+@%|\&-]+$ ]]; then line+=" $arg"
    else line+=" '${arg//\'/\'\\\'\'}'"; fi
  done
  echo "$line"
}
run() {  # show a command, and run it unless --dry-run
  show "$@"
  [ $DRY_RUN -eq 1 ] || "$@"
}

# --- 1. the builder ------------------------------------------------------------------------
usable() {  # usable NAME: 0 and nothing, or 1 and the reason on stdout
  local name=$1 path err
  path=$(command -v "$name" 2>/dev/null) || { echo "$name: not installed"; return 1; }
  local rc=0
  err=$(timeout 20 "$name" info 2>&1 >/dev/null) || rc=$?
  [ $rc -eq 0 ] && return 0
  err=$(printf '%s\n' "$err" | grep -v '^[[:space:]]*$' | tail -n 1)
  echo "$name: $path is installed but '$name info' fails: ${err:-exit status $rc}"
  return 1
}

choose_builder() {
  local candidates=(docker podman buildah) name why
  if [ -n "${BUILDER:-}" ]; then
    case "$BUILDER" in docker|podman|buildah) ;; *) die "BUILDER must be docker, podman or buildah (got $BUILDER)" ;; esac
    candidates=("$BUILDER")
  fi
  for name in "${candidates[@]}"; do
    if why=$(usable "$name"); then
      BUILDER=$name
      say "builder: $name ($(command -v "$name"))"
      return 0
    fi
    say "skipping $why"
  done
  say "no builder could run: install podman (apt-get install podman) or buildah, or start a docker daemon"
  return 1
}

# --- 2. the wheelhouse ---------------------------------------------------------------------
wheelhouse() {
  local pyver src
  pyver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) \
    || die "no $PYTHON to run pip (set PYTHON=)"
  # The image runs Debian bookworm's Python 3.11: the wheels must be cp311.
  [ "$pyver" = "3.11" ] || die "PYTHON=$PYTHON is Python $pyver; the wheelhouse needs 3.11"
  say "wheelhouse $WHEELS: requirements/runtime.txt + pdx (pip sources: $PYTHON -m pip config list)"
  src=$OUT/src  # pdx's wheel is built from a clean copy: no stale files from an old build/lib
  run rm -rf "$src" "$WHEELS" "$WHEELS_VLLM"
  run mkdir -p "$src" "$WHEELS" "$WHEELS_VLLM"
  show tar -cf - --exclude=__pycache__ pyproject.toml README.md pdx '|' tar -xf - -C "$src"
  if [ $DRY_RUN -eq 0 ]; then
    tar -cf - --exclude=__pycache__ pyproject.toml README.md pdx | tar -xf - -C "$src"
  fi
  # The locked files themselves (hash-checked), then the lock beside them for the image's pip.
  run "$PYTHON" -m pip download --quiet --no-deps --require-hashes --dest "$WHEELS" \
    -r requirements/runtime.txt
  run cp requirements/runtime.txt "$WHEELS/requirements.txt"
  # A fixed SOURCE_DATE_EPOCH makes pdx's wheel the same bytes while its source is: the
  # builder's cache then keeps the install layer.
  run env SOURCE_DATE_EPOCH=315532800 "$PYTHON" -m pip wheel --quiet --no-deps \
    --wheel-dir "$WHEELS" "./$src"
  if [ "$TARGET" = vllm ]; then
    say "wheelhouse $WHEELS_VLLM: requirements/vllm.txt + requirements/nixl.txt (scripts/vllm-env.sh's locks)"
    run "$PYTHON" -m pip download --quiet --no-deps --require-hashes --dest "$WHEELS_VLLM" \
      -r requirements/vllm.txt -r requirements/nixl.txt
  fi
}

# --- 3. the base ---------------------------------------------------------------------------
debian_sources() {  # the host's Debian apt sources, which mmdebstrap then uses too
  local f
  if [ -n "${DEBIAN_SOURCES:-}" ]; then echo "$DEBIAN_SOURCES"; return; fi
  for f in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list; do
    if [ -s "$f" ] && grep -Eq '^[[:space:]]*(deb|URIs:)' "$f"; then echo "$f"; return; fi
  done
  echo "http://deb.debian.org/debian"
}

image_exists() {
  case "$BUILDER" in
    docker) docker image inspect "$1" >/dev/null 2>&1 ;;
    podman) podman image exists "$1" ;;
    buildah) buildah inspect --type image "$1" >/dev/null 2>&1 ;;
  esac
}

import_rootfs() {  # import_rootfs TAR IMAGE
  case "$BUILDER" in
    docker) run docker import "$1" "$2" ;;
    podman) run podman import "$1" "$2" ;;
    buildah)
      show buildah from scratch '&&' buildah add CTR "$1" / '&&' buildah commit CTR "$2"
      if [ $DRY_RUN -eq 0 ]; then
        local ctr
        ctr=$(buildah from scratch)
        buildah add --quiet "$ctr" "$1" / && buildah commit --quiet "$ctr" "$2" >/dev/null
        buildah rm "$ctr" >/dev/null
      fi
      ;;
  esac
}

base_image() {
  if [ -n "${BASE_IMAGE:-}" ]; then
    say "base: BASE_IMAGE=$BASE_IMAGE (not made here; the builder pulls it if it must)"
    return
  fi
  BASE_IMAGE=$LOCAL_BASE
  if [ $DRY_RUN -eq 0 ] && [ "${REBUILD_BASE:-0}" != 1 ] && image_exists "$BASE_IMAGE"; then
    say "base: $BASE_IMAGE exists in $BUILDER's store (REBUILD_BASE=1 remakes it)"
    return
  fi
  command -v mmdebstrap >/dev/null 2>&1 \
    || die "mmdebstrap is not installed (apt-get install mmdebstrap), or set BASE_IMAGE=debian:bookworm-slim where a registry is reachable"
  local sources
  sources=$(debian_sources)
  say "base: Debian $DEBIAN_SUITE from $sources with mmdebstrap, imported as $BASE_IMAGE"
  run mkdir -p "$OUT"
  # Docs and man pages left out (copyright files kept); apt lists are cleaned by mmdebstrap.
  run mmdebstrap --quiet --variant=apt --include="$BASE_PACKAGES" \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    "$DEBIAN_SUITE" "$OUT/rootfs.tar" "$sources"
  import_rootfs "$OUT/rootfs.tar" "$BASE_IMAGE"
}

# --- 4. what podman/buildah need to run a step here ----------------------------------------
# A one-line build (FROM base, RUN true) with no flags, then with the OCI runtime runc and/or
# resource limits this machine allows: some sandboxes refuse crun on hybrid cgroups, or the
# default RLIMIT_NOFILE/RLIMIT_NPROC (raising them needs CAP_SYS_RESOURCE).
# This process's hard limits (RLIMIT_NPROC at most pid_max, which this kernel enforces).
limit_flags() {
  local nofile nproc pid_max
  nofile=$(ulimit -Hn); nproc=$(ulimit -Hu)
  pid_max=$(cat /proc/sys/kernel/pid_max 2>/dev/null || echo "$nproc")
  [ "$nofile" = unlimited ] && nofile=1048576
  if [ "$nproc" = unlimited ] || [ "$nproc" -gt "$pid_max" ]; then nproc=$pid_max; fi
  echo "--ulimit nofile=$nofile:$nofile --ulimit nproc=$nproc:$nproc"
}
RUNTIME_FLAGS=()  # --runtime R: a build option, and a global option of `podman run`
LIMIT_FLAGS=()    # --ulimit ...: options of both `build` and `run`
probe_flags() {
  [ "$BUILDER" = docker ] && return 0
  local limits runtimes=("") rt lim err ctx
  limits=$(limit_flags)
  if [ -n "${CONTAINER_RUNTIME:-}" ]; then runtimes=("--runtime $CONTAINER_RUNTIME")
  elif command -v runc >/dev/null 2>&1; then runtimes+=("--runtime runc"); fi
  if [ $DRY_RUN -eq 1 ]; then
    say "would probe $BUILDER with a one-line build, adding if needed: ${runtimes[*]:1} $limits"
    return 0
  fi
  ctx=$(mktemp -d)
  printf 'FROM %s\nRUN true\n' "$BASE_IMAGE" > "$ctx/Containerfile"
  for rt in "${runtimes[@]}"; do
    for lim in "" "$limits"; do
      # shellcheck disable=SC2206  # word-split on purpose: flags
      RUNTIME_FLAGS=($rt); LIMIT_FLAGS=($lim)
      if err=$("$BUILDER" build --pull=never --network=none "${RUNTIME_FLAGS[@]}" \
          "${LIMIT_FLAGS[@]}" -t localhost/pdx-probe:tmp -f "$ctx/Containerfile" "$ctx" 2>&1); then
        "$BUILDER" rmi localhost/pdx-probe:tmp >/dev/null 2>&1 || true
        rm -rf "$ctx"
        say "$BUILDER runs a build step here with: ${rt:-default runtime} ${lim:-default limits}"
        return 0
      fi
      say "probe [${rt:-default runtime} ${lim:-default limits}] failed:" \
        "$(printf '%s\n' "$err" | grep -i -m1 -E 'error|denied' || printf '%s\n' "$err" | tail -n 1)"
    done
  done
  rm -rf "$ctx"
  die "$BUILDER cannot run a build step on this machine (see the probes above)"
}

# --- 5. the build --------------------------------------------------------------------------
build() {
  local cmd isolation=(--network=none)
  BUILD_ARGS+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
  case "$BUILDER" in
    docker) cmd=(env DOCKER_BUILDKIT=1 docker build) ;;
    podman) cmd=(podman build) ;;
    buildah) cmd=(buildah build) ;;
  esac
  if [ "$BASE_IMAGE" != "$LOCAL_BASE" ]; then
    isolation=()  # a pulled base may lack tools that the base stage installs with apt
  elif [ "$BUILDER" != docker ]; then
    isolation+=(--pull=never)
  fi
  say "building $IMAGE (target $TARGET) with $BUILDER"
  run "${cmd[@]}" "${isolation[@]}" "${RUNTIME_FLAGS[@]}" "${LIMIT_FLAGS[@]}" "${BUILD_ARGS[@]}" \
    --target "$TARGET" -t "$IMAGE" -f Containerfile .
}

# `podman run` sets higher default limits than a build step: probe it too, on the new image.
run_command() {
  local runner=$BUILDER lim
  [ "$BUILDER" = buildah ] && runner=podman  # buildah builds; podman (same store) runs
  [ "$runner" = docker ] && { echo "docker run --rm --network=none $IMAGE"; return; }
  local limits=("" "$(limit_flags)")
  for lim in "${limits[@]}"; do
    # shellcheck disable=SC2086  # word-split on purpose: flags
    if [ $DRY_RUN -eq 1 ] || ! command -v "$runner" >/dev/null 2>&1 \
        || "$runner" "${RUNTIME_FLAGS[@]}" run --rm --network=none $lim --entrypoint true \
          "$IMAGE" >/dev/null 2>&1; then
      echo "$runner ${RUNTIME_FLAGS[*]} run $lim --rm --network=none $IMAGE" | tr -s ' '
      return
    fi
  done
  echo "$runner ${RUNTIME_FLAGS[*]} run --rm --network=none $IMAGE" | tr -s ' '
}

report() {
  local size
  if [ $DRY_RUN -eq 1 ]; then say "then: $(run_command) --help"; return; fi
  case "$BUILDER" in
    docker) size=$(docker image inspect -f '{{.Size}}' "$IMAGE") ;;
    *) size=$("$BUILDER" inspect --type image -f '{{.Size}}' "$IMAGE" 2>/dev/null || echo "?") ;;
  esac
  [[ "$size" =~ ^[0-9]+$ ]] && size="$((size / 1000000)) MB"
  say "built $IMAGE with $BUILDER in $(($(date +%s) - T0)) s, $size"
  say "run it: $(run_command) --help"
}

T0=$(date +%s)
BUILD_ARGS=()
[ $DRY_RUN -eq 1 ] && say "dry run: the plan for target $TARGET (nothing is built)"
choose_builder || exit 2
wheelhouse
base_image
probe_flags
build
# Also the versioned tag that `pdx deploy --render k8s` names (k8s.image / k8s.vllm_image).
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
if [ "$TARGET" = vllm ]; then VERSIONED=pdx:$VERSION-vllm; else VERSIONED=pdx:$VERSION; fi
[ "$IMAGE" = "$VERSIONED" ] || run "$BUILDER" tag "$IMAGE" "$VERSIONED"
report
