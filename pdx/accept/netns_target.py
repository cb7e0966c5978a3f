"""The deploy placed in a two-site namespace topology, with kernel conditions per step.

``pdx.faults.netns`` builds ``<prefix>-prefill ── <prefix>-router ── <prefix>-decode``; this
module adds a host link (``10.77.3.1/30`` here ↔ ``10.77.3.2/30`` in the decode site) so the
load generator and the metric scrapes, which run in this namespace, reach the gateway. A step's
``bandwidth_mbps`` / ``loss`` are applied with :func:`pdx.faults.netns.up` (idempotent: it
reconfigures the router's ``tbf`` and nft rule in place), and the router's counters before
and after the step show what the kernel did. Delay, jitter and link cuts go to the deploy's KV
fault proxy on the decode side, whose control API listens on the host link. Root only.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
from typing import Any

from pdx.accept.playbook import Condition, NetnsTarget
from pdx.errors import PdxError

HOST_ADDR = "10.77.3.1"
SITE_ADDR = "10.77.3.2"
_TBF_STATS = re.compile(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+)")
_NFT_COUNTER = re.compile(r"counter packets (\d+) bytes (\d+) drop")


class NetnsUnavailable(PdxError):
    """The namespace topology was asked for but this host cannot build it (exit code 2)."""


def check_available() -> None:
    """Root and ``ip``/``tc``/``nft`` present, else one line saying what is missing."""
    if os.geteuid() != 0:
        raise NetnsUnavailable(
            "target.netns.enabled needs root (CAP_NET_ADMIN) to create network namespaces; "
            "run pdx accept as root, or set target.netns.enabled=false"
        )
    missing = [t for t in ("ip", "tc", "nft") if shutil.which(t) is None]
    if missing:
        raise NetnsUnavailable(
            f"target.netns.enabled needs {', '.join(missing)} (iproute2, nftables)"
        )


def _ip(*args: str, check: bool = True) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise NetnsUnavailable(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")


class Topology:
    """Namespaces, host link and per-step kernel shaping for one run; ``down()`` removes all."""

    def __init__(self, opts: NetnsTarget) -> None:
        from pdx.faults.netns import make_config

        self.opts = opts
        self.cfg = make_config(prefix=opts.prefix, rate_mbit=opts.rate_mbit, mtu=opts.mtu)
        self.host_dev = f"{opts.prefix}-h"
        self.created = False

    @property
    def prefill_ns(self) -> str:
        """Namespace of the prefill site (KV store)."""
        return str(self.cfg.prefill)

    @property
    def decode_ns(self) -> str:
        """Namespace of the decode site (decode, gateway, KV-link client end)."""
        return str(self.cfg.decode)

    @property
    def prefill_addr(self) -> str:
        """Prefill site address (where the KV store listens)."""
        from pdx.faults.netns import SUBNET_PREFILL

        return f"{SUBNET_PREFILL}.1"

    async def up(self) -> dict[str, Any]:
        """Build the topology (shaping at ``rate_mbit``, no loss) and the host link."""
        from pdx.faults import netns

        self.created = True
        status = await asyncio.to_thread(netns.up, self.cfg)
        await asyncio.to_thread(self._host_link)
        return {"namespaces": self.cfg.namespaces, "qdiscs": status.get("qdiscs", {})}

    def _host_link(self) -> None:
        _ip("link", "del", self.host_dev, check=False)  # a leftover of an interrupted run
        _ip("link", "add", self.host_dev, "type", "veth", "peer", "name", "eth-host", "netns",
            self.decode_ns)  # fmt: skip
        _ip("addr", "replace", f"{HOST_ADDR}/30", "dev", self.host_dev)
        _ip("link", "set", "dev", self.host_dev, "up")
        _ip("-n", self.decode_ns, "addr", "replace", f"{SITE_ADDR}/30", "dev", "eth-host")
        _ip("-n", self.decode_ns, "link", "set", "dev", "eth-host", "up")

    def deploy_overrides(self, *, via_proxy: bool = False) -> list[str]:
        """``pdx deploy --set`` items placing prefill in its site and the gateway on the link.

        ``via_proxy``: the deploy's KV fault proxy (decode side, loopback of the decode site)
        with its control API on the host link, where ``pdx accept`` in this namespace reaches it.
        """
        items = [
            f"prefill.netns={self.prefill_ns}",
            f"prefill.host={self.prefill_addr}",
            f"gateway.host={SITE_ADDR}",
            "tls.enabled=false",
        ]
        if via_proxy:
            items += ["kv.via_proxy=true", f"kv.proxy_control_host={SITE_ADDR}"]
        return items

    def command_prefix(self) -> list[str]:
        """Run ``pdx deploy`` (router, decode, gateway) in the decode site."""
        return ["ip", "netns", "exec", self.decode_ns]

    async def apply(self, c: Condition) -> dict[str, Any]:
        """Set the router's rate cap and loss for one step; returns what was set."""
        from pdx.faults import netns

        rate = c.bandwidth_mbps or self.opts.rate_mbit
        cfg = self.cfg.model_copy(update={"rate_mbit": rate, "loss": c.loss})
        status = await asyncio.to_thread(netns.up, cfg)
        return {
            "rate_mbit": rate,
            "loss": c.loss,
            "qdiscs": status.get("qdiscs", {}),
            "nft": status.get("nft"),
        }

    async def counters(self) -> dict[str, int]:
        """Router counters: tbf bytes/packets/drops on both hops and nft loss drops."""
        return await asyncio.to_thread(self._counters)

    def _counters(self) -> dict[str, int]:
        out = {"tbf_bytes": 0, "tbf_packets": 0, "tbf_dropped": 0, "tbf_overlimits": 0}
        for dev in ("eth-prefill", "eth-decode"):
            text = subprocess.run(
                ["tc", "-s", "-n", self.cfg.router, "qdisc", "show", "dev", dev],
                capture_output=True, text=True, check=False,
            ).stdout  # fmt: skip
            m = _TBF_STATS.search(text)
            if m:
                for key, value in zip(out, m.groups(), strict=True):
                    out[key] += int(value)
        nft = subprocess.run(
            ["ip", "netns", "exec", self.cfg.router, "nft", "list", "table", "inet", "pdx_faults"],
            capture_output=True, text=True, check=False,
        ).stdout  # fmt: skip
        m = _NFT_COUNTER.search(nft)
        out["loss_dropped_packets"] = int(m.group(1)) if m else 0
        return out

    async def down(self) -> None:
        """Delete the namespaces (their veths, the host link included, go with them)."""
        from pdx.faults import netns

        if self.created:
            await asyncio.to_thread(netns.down, self.cfg)
            await asyncio.to_thread(_ip, "link", "del", self.host_dev, check=False)
            self.created = False


def counters_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """What the router did during one step (both read after the step's condition was set)."""
    return {k: after[k] - before.get(k, 0) for k in after}
