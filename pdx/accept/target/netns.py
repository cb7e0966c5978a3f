"""The deploy placed in a two-site namespace topology, with packet-level conditions per step.

``pdx.faults.netns`` builds ``<prefix>-prefill ── <prefix>-router ── <prefix>-decode``; this
module adds a host link (``10.77.3.1/30`` here ↔ ``10.77.3.2/30`` in the decode site) so the
load generator and the metric scrapes, which run in this namespace, reach the gateway. A step's
``delay_ms``, ``jitter_ms``, ``loss`` and ``bandwidth_mbps`` become packet-level conditions of
the router hop (netem, or pdx's userspace emulator where the kernel has none), changed live
between steps, and the emulator's counters before and after the step show what it did to the
wire packets. Link cuts stay with the deploy's KV fault proxy on the decode side (a TCP-level
fault: reset connections), whose control API listens on the host link. Root only.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import subprocess
import tempfile
from typing import Any

from pdx.accept.playbook import Condition, NetnsTarget
from pdx.errors import PdxError

HOST_ADDR = "10.77.3.1"  # the first host link; a run beside another takes the next free /30
SITE_ADDR = "10.77.3.2"
HOST_NET = "10.77.3"
MIN_RTT_WINDOW_S = 2  # net.ipv4.tcp_min_rtt_wlen of the sites (the kernel's default: 300)


class NetnsUnavailable(PdxError):
    """The namespace topology was asked for but this host cannot build it (exit code 2)."""


def check_available() -> None:
    """Root and ``ip``/``tc``/``nft`` present, else one line saying what is missing."""
    if os.geteuid() != 0:
        raise NetnsUnavailable(
            "target.netns.enabled needs root (CAP_NET_ADMIN) to create network namespaces; "
            "run pdx accept as root, or set target.netns.enabled=false"
        )
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        raise NetnsUnavailable(f"target.netns.enabled needs {', '.join(missing)} (iproute2)")


def _ip(*args: str, check: bool = True) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise NetnsUnavailable(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")


def _free_host_link() -> tuple[str, str]:
    """The first /30 of 10.77.3.0/24 no host interface holds: two runs side by side (another
    prefix) get two host links instead of one address routed two ways."""
    proc = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True,
                          check=False)  # fmt: skip
    used = set(proc.stdout.split()) if proc.returncode == 0 else set()
    for k in range(64):
        host, site = f"{HOST_NET}.{4 * k + 1}", f"{HOST_NET}.{4 * k + 2}"
        if f"{host}/30" not in used:
            return host, site
    raise NetnsUnavailable(f"every /30 of {HOST_NET}.0/24 is in use by another run's host link")


class Topology:
    """Namespaces, host link and per-step kernel shaping for one run; ``down()`` removes all."""

    def __init__(self, opts: NetnsTarget) -> None:
        from pdx.faults.netns import make_config

        self.opts = opts
        self.cfg = make_config(prefix=opts.prefix, rate_mbit=opts.rate_mbit, mtu=opts.mtu)
        self.host_dev = f"{opts.prefix}-h"
        self.host_addr, self.site_addr = _free_host_link()
        self.created = False
        self.cross: Any = None  # the step's CrossTraffic while it runs
        self._tls_root: str | None = None  # this run's certificates (removed by down())

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
        await asyncio.to_thread(self._short_min_rtt_window)
        return {"namespaces": self.cfg.namespaces, "qdiscs": status.get("qdiscs", {})}

    def _host_link(self) -> None:
        _ip("link", "del", self.host_dev, check=False)  # a leftover of an interrupted run
        _ip("link", "add", self.host_dev, "type", "veth", "peer", "name", "eth-host", "netns",
            self.decode_ns)  # fmt: skip
        _ip("addr", "replace", f"{self.host_addr}/30", "dev", self.host_dev)
        _ip("link", "set", "dev", self.host_dev, "up")
        _ip("-n", self.decode_ns, "addr", "replace", f"{self.site_addr}/30", "dev", "eth-host")
        _ip("-n", self.decode_ns, "link", "set", "dev", "eth-host", "up")

    def _short_min_rtt_window(self) -> None:
        """TCP's minimum RTT over the last few seconds, not five minutes (the kernel's
        default), in both sites: a connection that outlives a step (NIXL's, the KV client's)
        then reports the step's own RTT when read at its end (:meth:`tcp_between_sites`)."""
        for ns in (self.prefill_ns, self.decode_ns):
            subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw",
                            f"net.ipv4.tcp_min_rtt_wlen={MIN_RTT_WINDOW_S}"],
                           capture_output=True, check=False)  # fmt: skip

    def certificates(self) -> str:
        """A fresh CA and every service's identity for this run, valid for the sites'
        addresses as well as loopback (``pdx certs init --host``); made once, removed with
        the namespaces. The directory the deploy's services read (the CA's key beside it)."""
        from pdx.faults.netns import SUBNET_DECODE
        from pdx.tls import init_certs

        if self._tls_root is None:
            self._tls_root = tempfile.mkdtemp(prefix=f"{self.opts.prefix}-tls-")
        certs = os.path.join(self._tls_root, "certs")
        if not os.path.exists(os.path.join(certs, "ca.pem")):
            init_certs(certs, hosts=[self.prefill_addr, self.site_addr, f"{SUBNET_DECODE}.1"])
        return certs

    def deploy_overrides(self, *, via_proxy: bool = False, tls: bool = True) -> list[str]:
        """``pdx deploy --set`` items placing prefill in its site and the gateway on the link.

        ``via_proxy``: the deploy's KV fault proxy (decode side, loopback of the decode site)
        with its control API on the host link, where ``pdx accept`` in this namespace reaches it.
        ``tls``: mutual TLS across the sites with :meth:`certificates` (else the deploy's own
        ``tls`` settings stand: a deploy that turned TLS off runs in plaintext).
        """
        items = [
            f"prefill.netns={self.prefill_ns}",
            f"prefill.host={self.prefill_addr}",
            f"gateway.host={self.site_addr}",
        ]
        if tls:
            items.append(f"tls.dir={self.certificates()}")
        if via_proxy:
            items += ["kv.via_proxy=true", f"kv.proxy_control_host={self.site_addr}"]
        return items

    def command_prefix(self) -> list[str]:
        """Run ``pdx deploy`` (router, decode, gateway) in the decode site."""
        return ["ip", "netns", "exec", self.decode_ns]

    async def apply(self, c: Condition) -> dict[str, Any]:
        """Set the router hop's conditions for one step (live); returns what was set."""
        from pdx.faults import netns
        from pdx.faults.wan.conditions import make_conditions

        rate = c.bandwidth_mbps or self.opts.rate_mbit
        both = {"rate_mbit": rate, "delay_ms": c.delay_ms, "jitter_ms": c.jitter_ms,
                "loss": c.loss}  # fmt: skip
        wan = make_conditions(both, source="condition")
        await asyncio.to_thread(netns.up, self.cfg.with_conditions(wan))
        state = await asyncio.to_thread(netns.status, self.cfg)
        w = state.get("wan", {})
        await self.stop_cross_traffic()  # a step that failed before its end left them running
        if c.cross_traffic is not None:
            from pdx.faults.netns import SUBNET_DECODE
            from pdx.faults.wan.cross import CrossTraffic

            ends = {"prefill": (self.prefill_ns, self.prefill_addr),
                    "decode": (self.decode_ns, f"{SUBNET_DECODE}.1")}  # fmt: skip
            self.cross = await asyncio.to_thread(CrossTraffic(c.cross_traffic, ends).start)
        return {
            "cross_traffic": None if c.cross_traffic is None else c.cross_traffic.model_dump(),
            "emulator": w.get("emulator", "none"),
            "conditions": wan.model_dump(mode="json"),
            "summary": wan.summary(),
            "rate_mbit": rate,
            "loss": c.loss,
            "delay_ms": c.delay_ms,
            "jitter_ms": c.jitter_ms,
            "qdiscs": state.get("qdiscs", {}),
        }

    async def run_events(
        self, events: list[Any], start: dict[str, Any], t0: float | None = None
    ) -> list[dict[str, Any]]:
        """Apply a step's ``wan_events`` live (the WAN timeline machinery), each at its time
        from ``t0`` (default now); one fault event per change, as the step's timeline has."""
        import time

        from pdx.faults import netns
        from pdx.faults.wan.conditions import WanConditions
        from pdx.faults.wan.timeline import WanTimeline, run_wan_timeline

        timeline = WanTimeline(events=events)
        begin = WanConditions.model_validate(start)
        offset = time.time() - t0 if t0 is not None else 0.0

        def apply(wan: WanConditions) -> None:
            netns.set_conditions(self.cfg.prefix, wan)

        done = await asyncio.to_thread(run_wan_timeline, timeline, begin, apply)
        return [
            {
                "t_s": round(d["actual_s"] + offset, 3),
                "event": f"router hop: {d['what']}"
                + ("" if d["ok"] else f" (failed: {d['error']})"),
            }
            for d in done
        ]

    async def counters(self) -> dict[str, int]:
        """What the router hop did so far: the emulator's per-direction counters (wire
        packets in/out, lost, tail-dropped, reordered, duplicated), or the tbf's."""
        return await asyncio.to_thread(self._counters)

    def _counters(self) -> dict[str, int]:
        from pdx.faults import netns

        wan = netns.status(self.cfg).get("wan", {})
        out: dict[str, int] = {}
        for d, c in (wan.get("counters") or {}).items():
            for key, value in c.items():
                if isinstance(value, int) and not key.endswith("_max_bytes"):
                    out[f"{d}_{key}"] = value
        for d, drops in (wan.get("queue_drops") or {}).items():
            out.setdefault(f"{d}_dropped_queue", int(drops))
        return out

    async def watch_tcp(self, run: asyncio.Future[Any]) -> list[list[dict[str, Any]]]:
        """Readings of the prefill site's connections to the decode site (``ss -tin``), one
        when called and one every ``MIN_RTT_WINDOW_S`` until ``run`` is done: each reading's
        minimum RTT is TCP's over the window just gone. It ends with ``run`` (the step's
        load, itself bounded in time)."""
        readings = [await asyncio.to_thread(self._sent)]
        while not run.done():
            await asyncio.wait({run}, timeout=MIN_RTT_WINDOW_S)
            readings.append(await asyncio.to_thread(self._sent))
        return readings

    async def tcp_between_sites(
        self, readings: list[list[dict[str, Any]]] | None = None
    ) -> dict[str, Any]:
        """TCP's own view of the connections between the sites (``ss -tin`` in each site):
        the busiest each way (NIXL/UCX's KV connection with vLLM, the KV client's with pdx),
        with the kernel's smoothed RTT (queueing at the router's rate included) and its
        minimum over the last ``MIN_RTT_WINDOW_S``, and every connection's. With the step's
        ``readings`` (:meth:`watch_tcp`), the sender is the connection that moved the most
        bytes during the step, and ``min_rtt_step_ms`` the median over the windows in which it
        moved bytes of TCP's minimum RTT in each: one reading at the end can fall just after a
        cut, when a connection's last few samples carry the cut's retransmissions."""
        return await asyncio.to_thread(self._tcp_between_sites, readings or [])

    def _sent(self) -> list[dict[str, Any]]:
        return tcp_connections(self.prefill_ns, f"src {self.prefill_addr}")

    def _tcp_between_sites(self, readings: list[list[dict[str, Any]]]) -> dict[str, Any]:
        sent = self._sent()
        received = tcp_connections(self.decode_ns, f"dst {self.prefill_addr}")
        return {
            "kv_sender": busiest_during([*readings, sent]),
            "kv_receiver": max(received, key=lambda c: c.get("bytes_received", 0), default=None),
            "decode_side": received,
        }

    async def stop_cross_traffic(self) -> dict[str, Any] | None:
        """Stop the step's cross-traffic; per direction, what its flows achieved (the sink's
        Mbit/s each second, and their median after the first 3 s of ramp-up), or None."""
        if self.cross is None:
            return None
        cross, self.cross = self.cross, None
        result: dict[str, Any] = await asyncio.to_thread(cross.stop)
        for out in result.values():
            series = (out.get("sink") or {}).get("mbit_per_s") or []
            steady = series[3:] or series
            out["median_mbit"] = statistics.median(steady) if steady else None
        return result

    async def down(self) -> None:
        """Delete the namespaces (their veths, the host link included, go with them)."""
        from pdx.faults import netns

        await self.stop_cross_traffic()
        if self.created:
            await asyncio.to_thread(netns.down, self.cfg)
            await asyncio.to_thread(_ip, "link", "del", self.host_dev, check=False)
            self.created = False
        if self._tls_root is not None:
            shutil.rmtree(self._tls_root, ignore_errors=True)
            self._tls_root = None


def counters_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """What the router did during one step (both read after the step's condition was set;
    a counter that went backwards means the emulator restarted: its value after counts)."""
    return {k: v - before.get(k, 0) if v >= before.get(k, 0) else v for k, v in after.items()}


def busiest_during(readings: list[list[dict[str, Any]]]) -> dict[str, Any] | None:
    """The connection of the last reading that moved the most bytes since the first (acked
    bytes; one first seen later counts from zero), with ``bytes_acked_step``, the minimum RTT of
    every reading after which it had moved bytes (``min_rtt_windows_ms``) and their median
    (``min_rtt_step_ms``, None when it never moved any)."""
    if not readings or not readings[-1]:
        return None
    first = {(c["local"], c["peer"]): c.get("bytes_acked", 0) for c in readings[0]}

    def moved(c: dict[str, Any]) -> int:
        return int(c.get("bytes_acked", 0) - first.get((c["local"], c["peer"]), 0))

    last = max(readings[-1], key=moved)
    key = (last["local"], last["peer"])
    acked, windows = first.get(key, 0), list[float]()
    for reading in readings[1:]:
        now = next((c for c in reading if (c["local"], c["peer"]) == key), None)
        if now is None:
            continue
        if now.get("bytes_acked", 0) > acked and now.get("min_rtt_ms") is not None:
            windows.append(float(now["min_rtt_ms"]))
        acked = now.get("bytes_acked", 0)
    return {
        **last,
        "bytes_acked_step": moved(last),
        "min_rtt_windows_ms": windows,
        "min_rtt_step_ms": statistics.median(windows) if windows else None,
    }


_SS_NUMBERS = ("bytes_acked", "bytes_received", "bytes_sent", "retrans", "lost")


def tcp_connections(ns: str, selector: str) -> list[dict[str, Any]]:
    """Established TCP connections of namespace ``ns`` matching an ``ss`` filter (``dst
    10.77.1.1``): local and peer address, RTT (``rtt_ms``: the kernel's smoothed, ``min_rtt_ms``)
    and byte counts, as ``ss -tin`` reports them."""
    argv = ["ip", "netns", "exec", ns, "ss", "-tinH", "state", "established", *selector.split()]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return []
    out: list[dict[str, Any]] = []
    for line in proc.stdout.splitlines():
        fields = line.split()
        if not fields:
            continue
        if not line[0].isspace() and len(fields) >= 4:  # Recv-Q Send-Q Local Peer
            out.append({"local": fields[-2], "peer": fields[-1]})
            continue
        if out:
            out[-1].update(_ss_info(fields))
    return out


def _ss_info(fields: list[str]) -> dict[str, Any]:
    info: dict[str, Any] = {}
    for f in fields:
        key, _, value = f.partition(":")
        try:
            if key == "rtt":
                srtt, _, var = value.partition("/")
                info["rtt_ms"], info["rttvar_ms"] = float(srtt), float(var or 0)
            elif key == "minrtt":
                info["min_rtt_ms"] = float(value)
            elif key in _SS_NUMBERS:
                info[key] = int(value.split("/")[-1])  # retrans: now/total: the total
        except ValueError:
            continue
    return info
