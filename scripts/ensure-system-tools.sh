#!/usr/bin/env bash
# Best-effort install of the Debian tools that system tests and benchmarks use (network namespaces,
# nft loss for the probe benchmark, ping, iperf3, headless Chromium for report rendering,
# promtool for the shipped alert rules' tests: Debian's prometheus package). Needs
# root and apt-get;
# without them it says so and the tests that need these tools skip cleanly.
# Set PDX_NO_APT=1 to never touch system packages.
set -u
want=()
command -v ip >/dev/null 2>&1 || want+=(iproute2)
command -v nft >/dev/null 2>&1 || want+=(nftables)
command -v ping >/dev/null 2>&1 || want+=(iputils-ping)
command -v iperf3 >/dev/null 2>&1 || want+=(iperf3)
command -v chromium >/dev/null 2>&1 || want+=(chromium)
command -v promtool >/dev/null 2>&1 || want+=(prometheus)
[ ${#want[@]} -eq 0 ] && exit 0
if [ "${PDX_NO_APT:-0}" = "1" ] || [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "system tools missing (${want[*]}); tests that need them will skip" >&2
  exit 0
fi
echo "installing system tools: ${want[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null 2>&1 || true
apt-get install -y -qq --no-install-recommends "${want[@]}" >/dev/null 2>&1 \
  || echo "could not install ${want[*]}; tests that need them will skip" >&2
exit 0
