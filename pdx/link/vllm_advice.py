"""What to set for vLLM's NIXL (UCX over TCP) on a probed link: a ``vllm:`` block to paste.

vLLM's NixlConnector moves KV with UCX; without RDMA UCX runs over TCP and takes the host's
defaults for everything pdx's own transfer tunes itself (measured in
``benchmarks/bench_nixl.py``, the same emulated link, iperf3 beside it):

- **socket buffers**: UCX sizes its TCP sockets from ``UCX_TCP_SNDBUF``/``UCX_TCP_RCVBUF``
  (``auto``: the kernel's autotuning under ``tcp_wmem``/``tcp_rmem``); a window smaller than
  the path's bandwidth-delay product caps every pull. Set them to twice the BDP, and the
  host-wide ``net.core.wmem_max``/``rmem_max`` that an explicit size is capped by;
- **slow start after idle**: a pull on a connection that idled longer than its RTO starts again
  from the initial window (``net.ipv4.tcp_slow_start_after_idle=1``, the kernel's default);
  between requests NIXL's connections idle, so every pull pays slow start;
- **congestion control**: UCX sets none, so its sockets get the host's default (CUBIC on most
  distributions), which a lossy long path holds to a few tens of Mbit/s (Mathis); BBR, which
  pdx's own KV transfer uses, keeps its rate through random loss;
- **the interface**: UCX offers its peer every interface it has; ``UCX_NET_DEVICES`` keeps the
  KV on the one that faces the other site.
"""

from __future__ import annotations

import subprocess
from typing import Any

from pdx.tcp import bdp_bytes, window_for

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
    hosts, from the probe's goodput and RTT (None without them)."""
    tp, rtt = report.get("throughput"), report.get("rtt_ms") or {}
    if not tp or rtt.get("p50") is None:
        return None
    rate_gbps = max(float(tp["up_gbps"]), float(tp["down_gbps"]))
    rtt_ms = float(rtt["p50"])
    buf = window_for(bdp_bytes(rate_gbps * 1e9, rtt_ms))
    env: dict[str, str] = {"UCX_TLS": "tcp,self"}
    device = interface_to(peer_host) if peer_host else None
    if device:
        env["UCX_NET_DEVICES"] = device
    env["UCX_TCP_SNDBUF"] = env["UCX_TCP_RCVBUF"] = str(buf)
    sysctl = {"net.core.wmem_max": str(buf), "net.core.rmem_max": str(buf),
              "net.ipv4.tcp_slow_start_after_idle": "0"}  # fmt: skip
    why = [
        f"UCX_TCP_SNDBUF/RCVBUF {buf} B: twice the path's BDP ({rate_gbps:.3g} Gbit/s x "
        f"{rtt_ms:.3g} ms), so a pull's window never caps it; net.core.wmem_max/rmem_max let "
        "UCX set that size",
        "tcp_slow_start_after_idle=0: NIXL's connections idle between pulls, and each pull "
        "would otherwise start again from the initial window",
    ]
    loss = report.get("loss") or {}
    loss_pct = max(float(loss.get("up") or 0.0), float(loss.get("down") or 0.0))
    if loss_pct >= BBR_LOSS_PCT or rtt_ms >= LONG_RTT_MS:
        sysctl["net.ipv4.tcp_congestion_control"] = "bbr"
        why.append(
            f"bbr: UCX sets no congestion control, its sockets take the host's default; on a "
            f"{rtt_ms:.3g} ms path with {loss_pct:.3g} % loss measured a loss-based one "
            "(CUBIC) loses its rate to any random loss"
        )
    return {"env": env, "sysctl": sysctl, "why": why}


def vllm_block(settings: dict[str, Any]) -> str:
    """The settings as the deploy YAML's ``vllm:`` block and the hosts' sysctl lines."""
    env = ", ".join(f'{k}: "{v}"' for k, v in settings["env"].items())
    sysctl = " ".join(f"{k}={v}" for k, v in settings["sysctl"].items())
    return (
        f"vllm:\n  env: {{{env}}}\n# both hosts (prefill site and decode site): sysctl -w {sysctl}"
    )
