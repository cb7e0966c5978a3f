"""What to set for vLLM's NIXL (UCX over TCP) on a probed link: a ``vllm:`` block to paste.

vLLM's NixlConnector moves KV with UCX; without RDMA UCX runs over TCP and takes the host's
defaults for everything pdx's own transfer tunes itself. ``benchmarks/bench_nixl.py`` measured
which of them matter on the emulated WAN, iperf3 beside it with as many streams as NIXL used
(one run, 2-core box):

- **congestion control**: UCX sets none, so its sockets get the host's default (CUBIC on most
  distributions): at 40 ms and 0.1 % loss a 64 MiB pull would take ~37 s; BBR, which pdx's own
  KV transfer uses, moved it at 0.47-0.86 Gbit/s (12x over the sweep; 1.25x at 80 ms clean);
- **the kernel's buffer caps**: ``tcp_wmem``/``tcp_rmem`` max at twice the path's BDP, on top of
  BBR, 1.50x at 80 ms and 1.30x with loss. ``UCX_TCP_SNDBUF``/``RCVBUF`` reach the same limit
  less well (1.29x / 1.18x): an explicit size turns autotuning off and is capped by the
  host-wide ``net.core.wmem_max``/``rmem_max``, so pdx advises the kernel's caps instead;
- **slow start after idle**: NIXL's connections idle between pulls; under CUBIC
  ``tcp_slow_start_after_idle=0`` lifted an idle pull 1.23x at 80 ms, under BBR (exempt from
  restart after idle) nothing: advised only where BBR is not;
- **the interface**: UCX offers its peer every interface it has; ``UCX_NET_DEVICES`` keeps the
  KV on the one that faces the other site. UCX's segment sizes and ``UCX_RNDV_THRESH`` /
  ``UCX_ZCOPY_THRESH`` changed nothing (over TCP a READ is always UCX's software emulation).
"""

from __future__ import annotations

import subprocess
from typing import Any

from pdx.tcp import bdp_bytes, window_for

KERNEL_MAX_DEFAULT = 6 << 20  # Linux's tcp_rmem max (tcp_wmem's is 4 MiB): enough below it
BBR_LOSS_PCT = 0.01  # any loss this large on a long path: a loss-based stream is bounded
LONG_RTT_MS = 5.0


def interface_to(host: str) -> str | None:
    """The interface this host's route to ``host`` leaves by (None when unknown)."""
    try:
        out = subprocess.run(["ip", "route", "get", host], capture_output=True, text=True,
                             check=False, timeout=5).stdout.split()  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out[out.index("dev") + 1] if "dev" in out and out.index("dev") + 1 < len(out) else None


def vllm_settings(report: dict[str, Any], peer_host: str | None = None) -> dict[str, Any] | None:
    """``{"env": {...}, "sysctl": {...}, "why": [...]}`` for both sites' vLLM instances and
    hosts, from the probe's goodput, RTT and loss (None without goodput or RTT)."""
    tp, rtt = report.get("throughput"), report.get("rtt_ms") or {}
    if not tp or rtt.get("p50") is None:
        return None
    rate_gbps = max(float(tp["up_gbps"]), float(tp["down_gbps"]))
    rtt_ms = float(rtt["p50"])
    window = window_for(bdp_bytes(rate_gbps * 1e9, rtt_ms))
    env: dict[str, str] = {"UCX_TLS": "tcp,self"}
    device = interface_to(peer_host) if peer_host else None
    if device:
        env["UCX_NET_DEVICES"] = device
    sysctl: dict[str, str] = {}
    why: list[str] = []
    if window > KERNEL_MAX_DEFAULT:  # never advise a cap below the kernel's own defaults
        sysctl["net.ipv4.tcp_wmem"] = f"4096 16384 {window}"
        sysctl["net.ipv4.tcp_rmem"] = f"4096 131072 {window}"
        why.append(
            f"tcp_wmem/tcp_rmem max {window} B: twice the path's BDP ({rate_gbps:.3g} Gbit/s x "
            f"{rtt_ms:.3g} ms), so no pull's window is capped (UCX leaves its sockets to the "
            "kernel's autotuning)"
        )
    if device:
        why.append(f"UCX_NET_DEVICES {device}: the interface this host's route to the peer uses")
    loss = report.get("loss") or {}
    loss_pct = max(float(loss.get("up") or 0.0), float(loss.get("down") or 0.0))
    if loss_pct >= BBR_LOSS_PCT or rtt_ms >= LONG_RTT_MS:
        sysctl["net.ipv4.tcp_congestion_control"] = "bbr"
        why.append(
            f"bbr: UCX sets no congestion control, its sockets take the host's default; on a "
            f"{rtt_ms:.3g} ms path ({loss_pct:.3g} % loss measured) a loss-based one (CUBIC) "
            "loses its rate to any random loss"
        )
    else:
        sysctl["net.ipv4.tcp_slow_start_after_idle"] = "0"
        why.append(
            "tcp_slow_start_after_idle=0: NIXL's connections idle between pulls, and under a "
            "loss-based congestion control each pull would start again from the initial window"
        )
    return {"env": env, "sysctl": sysctl, "why": why}


def vllm_block(settings: dict[str, Any]) -> str:
    """The settings as the deploy YAML's ``vllm:`` block and the hosts' sysctl lines."""
    env = ", ".join(f'{k}: "{v}"' for k, v in settings["env"].items())
    sysctl = " ".join(
        f'{k}="{v}"' if " " in v else f"{k}={v}" for k, v in settings["sysctl"].items()
    )
    return (
        f"vllm:\n  env: {{{env}}}\n# both hosts (prefill site and decode site): sysctl -w {sysctl}"
    )
