"""How close does ``pdx probe-link`` come to iperf3 and ping on a link with known properties?

Builds three network namespaces A - R - B joined by veth pairs, with R forwarding, a ``tbf``
shaper on both of R's egress interfaces (the bottleneck sits on the forwarding hop, so
UDP senders see real drops rather than back-pressure), an nft ``numgen random`` rule on R
dropping a known fraction of UDP probes from A to B, and a 1400-byte MTU on the R - B link.
Then it runs iperf3, ping and pdx over the same path in the same run and prints:

* pdx / iperf3 goodput ratio per shaper rate and direction      (goal 0.95 - 1.05)
* configured UDP loss A->B vs pdx's measured upstream loss        (goal: inside the 95 % interval)
* pdx RTT p50 vs ping p50                                         (goal: within 0.1 ms or 10 %)
* pdx path MTU vs the configured 1400 bytes

Root only (skips cleanly otherwise). Uses only addresses inside the namespaces it creates
and deletes them on the way out, even on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

PDX = str(Path(sys.executable).parent / "pdx")
ADDR_A, ADDR_RA, ADDR_RB, ADDR_B = "10.201.1.2", "10.201.1.1", "10.201.2.1", "10.201.2.2"
PDX_PORT, IPERF_PORT = 5301, 5201
MTU_RB = 1400


def sh(*cmd: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run a command, bounded in time."""
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=timeout)


def ns(name: str, *cmd: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run a command inside a namespace."""
    return sh("ip", "netns", "exec", name, *cmd, **kw)


class Topology:
    """A - R - B with veths, forwarding on R, shaping and loss on R. Deleted on exit."""

    def __init__(self) -> None:
        tag = str(os.getpid())
        self.a, self.r, self.b = f"pdxA{tag}", f"pdxR{tag}", f"pdxB{tag}"
        self.created: list[str] = []

    def __enter__(self) -> Topology:
        for name in (self.a, self.r, self.b):
            sh("ip", "netns", "add", name)
            self.created.append(name)
            ns(name, "ip", "link", "set", "lo", "up")
        sh(
            "ip",
            "link",
            "add",
            "a0",
            "netns",
            self.a,
            "type",
            "veth",
            "peer",
            "ra",
            "netns",
            self.r,
        )
        sh(
            "ip",
            "link",
            "add",
            "b0",
            "netns",
            self.b,
            "type",
            "veth",
            "peer",
            "rb",
            "netns",
            self.r,
        )
        for space, dev, addr in (
            (self.a, "a0", ADDR_A),
            (self.r, "ra", ADDR_RA),
            (self.r, "rb", ADDR_RB),
            (self.b, "b0", ADDR_B),
        ):
            ns(space, "ip", "addr", "add", f"{addr}/24", "dev", dev)
            ns(space, "ip", "link", "set", dev, "up")
        for space, dev in ((self.r, "rb"), (self.b, "b0")):
            ns(space, "ip", "link", "set", dev, "mtu", str(MTU_RB))
        ns(self.a, "ip", "route", "add", "default", "via", ADDR_RA)
        ns(self.b, "ip", "route", "add", "default", "via", ADDR_RB)
        ns(self.r, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        return self

    def shape(self, rate_mbit: int) -> None:
        """tbf on both of R's egress interfaces (the forwarding hop is the bottleneck)."""
        burst_kb = max(32, rate_mbit // 2)  # >= rate x 4 ms, so the timer never starves it
        for dev in ("ra", "rb"):
            ns(self.r, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
               f"{rate_mbit}mbit", "burst", f"{burst_kb}kb", "latency", "20ms")  # fmt: skip

    def drop_udp(self, per_mille: int) -> None:
        """Drop ``per_mille``/1000 of UDP to the probe port from A to B, at random, on R."""
        rules = (
            "table inet pdxbench {\n chain probe_drop {\n  type filter hook forward priority 0;\n"
            f"  ip saddr {ADDR_A} ip daddr {ADDR_B} udp dport {PDX_PORT} "
            f"numgen random mod 1000 < {per_mille} drop\n }}\n}}\n"
        )
        subprocess.run(
            ["ip", "netns", "exec", self.r, "nft", "-f", "-"],
            input=rules,
            check=True,
            text=True,
            timeout=30,
        )

    def __exit__(self, *exc: object) -> None:
        for name in reversed(self.created):
            sh("ip", "netns", "del", name, check=False)


class Background:
    """A server process inside a namespace, stopped by handle."""

    def __init__(self, space: str, *cmd: str) -> None:
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", space, *cmd],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )

    def readline(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def ensure_iperf3() -> bool:
    """iperf3 from Debian's package when missing; False (ratio skipped) if it cannot be had."""
    if shutil.which("iperf3"):
        return True
    try:
        sh("apt-get", "update", "-qq", check=False, timeout=300)
        sh("apt-get", "install", "-y", "-qq", "iperf3", check=False, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return shutil.which("iperf3") is not None


def iperf3_bps(topo: Topology, seconds: int, reverse: bool) -> float:
    """Receiver-side goodput of one iperf3 TCP stream A->B (or B->A with -R)."""
    server = Background(topo.b, "iperf3", "-s", "-1", "-B", ADDR_B, "-p", str(IPERF_PORT))
    try:
        cmd = ["iperf3", "-c", ADDR_B, "-p", str(IPERF_PORT), "-t", str(seconds), "-J"]
        for _ in range(50):  # poll until the one-off server accepts
            out = ns(topo.a, *cmd, *(["-R"] if reverse else []), check=False, timeout=60)
            try:
                doc = json.loads(out.stdout)
            except json.JSONDecodeError:
                doc = {"error": out.stderr.strip() or out.stdout[-300:]}
            error = str(doc.get("error", ""))
            if "refused" in error:
                subprocess.run(["sleep", "0.1"], check=True)
                continue
            if error or "sum_received" not in doc.get("end", {}):
                raise RuntimeError(f"iperf3 failed: {error}")
            return float(doc["end"]["sum_received"]["bits_per_second"])
        raise RuntimeError("iperf3 server never came up")
    finally:
        server.stop()


def ping_p50_ms(topo: Topology, count: int) -> float:
    """Median RTT of ``count`` pings A->B, 10 ms apart."""
    out = ns(topo.a, "ping", "-n", "-c", str(count), "-i", "0.01", ADDR_B, timeout=120)
    times = [float(m) for m in re.findall(r"time=([0-9.]+) ms", out.stdout)]
    return statistics.median(times)


def pdx_probe(topo: Topology, *args: str) -> dict[str, Any]:
    """Run ``pdx probe-link`` in A against the server in B; the JSON report."""
    cmd = [PDX, "probe-link", f"{ADDR_B}:{PDX_PORT}", "--json", *args]
    out = ns(topo.a, *cmd, check=False, timeout=300)
    if out.returncode not in (0, 1):
        raise RuntimeError(f"pdx probe-link failed: {out.stderr.strip()}")
    return dict(json.loads(out.stdout))


def goal(ok: bool) -> str:
    return "meets goal" if ok else "MISSES goal"


def throughput_rows(topo: Topology, rates: list[int], seconds: int, have_iperf: bool) -> None:
    for rate in rates:
        topo.shape(rate)
        report = pdx_probe(
            topo, "--phases", "throughput,loaded", "--streams", "1", "--duration", str(seconds)
        )
        tp = report["throughput"]
        loaded = report["rtt_under_load_ms"]["by_direction"]
        print(
            f"tbf {rate:5d} Mbit RTT under load (pdx): up p50 {loaded['up']['p50']:.2f} ms "
            f"p99 {loaded['up']['p99']:.2f} ms, down p50 {loaded['down']['p50']:.2f} ms "
            f"p99 {loaded['down']['p99']:.2f} ms",
            flush=True,
        )
        for direction, reverse in (("up", False), ("down", True)):
            pdx_bps = tp[f"{direction}_gbps"] * 1e9
            ci = next(r["ci95_pct"] for r in tp["runs"] if r["direction"] == direction)
            line = f"tbf {rate:5d} Mbit {direction:4s}: pdx {pdx_bps / 1e6:8.2f} Mbit/s ±{ci:.1f} %"
            if have_iperf:
                ref = iperf3_bps(topo, seconds + 1, reverse)
                ratio = pdx_bps / ref
                line += f"  iperf3 {ref / 1e6:8.2f} Mbit/s  ratio {ratio:.3f}  "
                line += goal(0.95 <= ratio <= 1.05)
            print(line, flush=True)


def latency_rows(topo: Topology, per_mille: int, seconds: int) -> None:
    report = pdx_probe(
        topo, "--phases", "latency,mtu", "--duration", str(seconds), "--interval-ms", "2"
    )
    loss = report["loss"]
    lo, hi = loss["up_ci95"]
    configured = per_mille / 10
    print(
        f"UDP loss A->B: configured {configured:.2f} %, pdx upstream {loss['up']:.2f} % "
        f"({loss['up_count']}/{loss['probes']}, 95 % interval {lo:.2f}-{hi:.2f} %), "
        f"downstream {loss['down']:.2f} %, bursts {loss['bursts']} longest "
        f"{loss['max_burst']}  {goal(lo <= configured <= hi)}",
        flush=True,
    )
    ping = ping_p50_ms(topo, 500)
    pdx_p50 = report["rtt_ms"]["p50"]
    diff = abs(pdx_p50 - ping)
    print(
        f"RTT p50: pdx {pdx_p50:.3f} ms  ping {ping:.3f} ms  diff {diff:.3f} ms "
        f"({100 * diff / ping:.1f} %)  {goal(diff <= 0.1 or diff <= 0.1 * ping)}",
        flush=True,
    )
    print(
        f"path MTU: pdx {report['mtu']}  configured {MTU_RB}  {goal(report['mtu'] == MTU_RB)}",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="200,1000", help="tbf rates in Mbit/s")
    parser.add_argument("--loss-per-mille", type=int, default=20, help="UDP drop, per 1000")
    parser.add_argument("--seconds", type=int, default=5, help="seconds per measurement")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("skipped: needs root to create network namespaces")
        return 0
    missing = [tool for tool in ("ip", "tc", "nft", "ping") if not shutil.which(tool)]
    if missing:
        print(f"skipped: missing {', '.join(missing)}")
        return 0
    have_iperf = ensure_iperf3()
    if not have_iperf:
        print("iperf3 unavailable: throughput ratios skipped")
    # SIGTERM should unwind through the finally blocks like Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with Topology() as topo:
        server = Background(topo.b, PDX, "probe-server", "--bind", ADDR_B, "--port", str(PDX_PORT))
        try:
            if "listening" not in server.readline():
                raise RuntimeError("pdx probe-server did not start in namespace B")
            topo.drop_udp(args.loss_per_mille)
            topo.shape(1000)
            latency_rows(topo, args.loss_per_mille, args.seconds)
            rates = [int(r) for r in args.rates.split(",")]
            throughput_rows(topo, rates, args.seconds, have_iperf)
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
