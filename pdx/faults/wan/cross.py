"""Cross-traffic: bulk TCP flows that share the emulated link with KV, as replication, backups
or a second tenant share a real one between datacenters.

A *sink* in the receiving site counts what arrives per second; a *sender* in the other site
opens ``flows`` connections with the congestion control asked (CUBIC by default: what most
bulk traffic uses) and writes as fast as TCP lets it until stopped, for at most
``max_seconds`` (every flow stops by itself). Both run as processes inside the namespaces
(``python -m pdx.faults.wan.cross sink|send``), so the flows cross the router hop and its
conditions exactly as KV does. Written here rather than with iperf3 because the sink's
per-second counts are what a report puts beside KV's rate, and iperf3 is not on every host.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pdx.tcp import set_congestion_control

BLOCK = 256 * 1024
MAX_SECONDS = 3600.0


class CrossTrafficSpec(BaseModel):
    """``cross_traffic`` of a network condition: who sends, how many flows, which CC."""

    model_config = ConfigDict(extra="forbid")
    flows: int = Field(2, ge=1, le=64, description="bulk TCP flows per direction")
    cc: Literal["cubic", "bbr", "reno", "system"] = Field(
        "cubic", description="their congestion control (system: the host's default)"
    )
    direction: Literal["down", "up", "both"] = Field(
        "down", description="down: prefill site → decode site (the way KV travels)"
    )
    max_seconds: float = Field(600.0, gt=0, le=MAX_SECONDS, description="each flow's bound")


@dataclass
class SinkCounts:
    """Bytes received per whole second since the first byte, over all flows."""

    per_second: dict[int, int] = field(default_factory=dict)
    first: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, n: int) -> None:
        now = time.monotonic()
        with self.lock:
            if self.first is None:
                self.first = now
            second = int(now - self.first)
            self.per_second[second] = self.per_second.get(second, 0) + n

    def report(self) -> dict[str, Any]:
        with self.lock:
            last = max(self.per_second, default=-1)
            mbit = [self.per_second.get(i, 0) * 8 / 1e6 for i in range(last + 1)]
        return {"bytes": int(sum(mbit) * 1e6 / 8), "mbit_per_s": [round(x, 1) for x in mbit]}


def run_sink(bind: str, port: int, max_flows: int, max_seconds: float) -> None:
    """Accept up to ``max_flows`` connections, count what they send; on SIGTERM, after
    ``max_seconds`` or when every flow ended, print the counts as one JSON line."""
    counts = SinkCounts()
    done = threading.Event()
    listener = socket.create_server((bind, port))
    print(json.dumps({"port": listener.getsockname()[1]}), flush=True)
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    threads: list[threading.Thread] = []

    def drain(conn: socket.socket) -> None:
        buf = bytearray(BLOCK)
        with conn, contextlib.suppress(OSError):
            while not done.is_set() and (n := conn.recv_into(buf)):
                counts.add(n)

    def accept() -> None:
        listener.settimeout(0.5)
        while not done.is_set() and len(threads) < max_flows:
            with contextlib.suppress(TimeoutError):
                conn, _ = listener.accept()
                t = threading.Thread(target=drain, args=(conn,), daemon=True)
                t.start()
                threads.append(t)

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    end = time.monotonic() + max_seconds
    while not done.wait(0.2) and time.monotonic() < end:
        if len(threads) == max_flows and not any(t.is_alive() for t in threads):
            break
    done.set()
    listener.close()
    print(json.dumps(counts.report()), flush=True)


def run_sender(host: str, port: int, flows: int, cc: str, max_seconds: float) -> None:
    """Open ``flows`` connections and write until SIGTERM or ``max_seconds``; print the
    bytes each sent as one JSON line."""
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    sent = [0] * flows
    block = memoryview(bytes(BLOCK))

    def flow(i: int) -> None:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        with sock, contextlib.suppress(OSError):
            if cc != "system":
                set_congestion_control(sock, cc)
            sock.connect((host, port))
            sock.settimeout(0.5)
            while not done.is_set():
                with contextlib.suppress(TimeoutError):
                    sent[i] += sock.send(block)

    threads = [threading.Thread(target=flow, args=(i,), daemon=True) for i in range(flows)]
    for t in threads:
        t.start()
    done.wait(max_seconds)
    done.set()
    for t in threads:
        t.join(5)
    print(json.dumps({"flows": flows, "cc": cc, "sent_bytes": sent}), flush=True)


class CrossTraffic:
    """The flows of one spec between two namespaces' addresses, started and stopped with a
    step (``with CrossTraffic(...) as ct: ...; ct.result``)."""

    def __init__(self, spec: CrossTrafficSpec, ends: dict[str, tuple[str, str]]) -> None:
        """``ends``: per site name ("prefill", "decode"), its (namespace, address)."""
        self.spec = spec
        self.ends = ends
        self.procs: list[tuple[str, subprocess.Popen[str], subprocess.Popen[str]]] = []
        self.result: dict[str, Any] = {}

    def _pairs(self) -> list[tuple[str, str, str]]:
        """(direction, sending site, receiving site) for the spec's direction."""
        both = [("down", "prefill", "decode"), ("up", "decode", "prefill")]
        return [p for p in both if self.spec.direction in (p[0], "both")]

    def start(self) -> CrossTraffic:
        py = sys.executable
        for direction, src, dst in self._pairs():
            (dst_ns, dst_addr), (src_ns, _) = self.ends[dst], self.ends[src]
            sink = subprocess.Popen(
                ["ip", "netns", "exec", dst_ns, py, "-m", "pdx.faults.wan.cross", "sink",
                 "--bind", dst_addr, "--flows", str(self.spec.flows),
                 "--max-seconds", str(self.spec.max_seconds + 5)],
                stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            assert sink.stdout is not None
            port = json.loads(sink.stdout.readline())["port"]
            sender = subprocess.Popen(
                ["ip", "netns", "exec", src_ns, py, "-m", "pdx.faults.wan.cross", "send",
                 "--to", f"{dst_addr}:{port}", "--flows", str(self.spec.flows),
                 "--cc", self.spec.cc, "--max-seconds", str(self.spec.max_seconds)],
                stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            self.procs.append((direction, sink, sender))
        return self

    def stop(self) -> dict[str, Any]:
        """Stop every flow; per direction, the sink's Mbit/s per second and the bytes sent."""
        for direction, sink, sender in self.procs:
            out: dict[str, Any] = {"flows": self.spec.flows, "cc": self.spec.cc}
            for name, proc in (("sender", sender), ("sink", sink)):
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                try:
                    text, _ = proc.communicate(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    text, _ = proc.communicate()
                lines = [ln for ln in (text or "").splitlines() if ln.startswith("{")]
                if lines:
                    out[name] = json.loads(lines[-1])
            self.result[direction] = out
        self.procs = []
        return self.result

    def __enter__(self) -> CrossTraffic:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    """``python -m pdx.faults.wan.cross sink|send``: one end of the cross-traffic."""
    parser = argparse.ArgumentParser(prog="pdx.faults.wan.cross")
    sub = parser.add_subparsers(dest="role", required=True)
    sink = sub.add_parser("sink")
    sink.add_argument("--bind", required=True)
    sink.add_argument("--port", type=int, default=0)
    sink.add_argument("--flows", type=int, required=True)
    sink.add_argument("--max-seconds", type=float, default=600.0)
    send = sub.add_parser("send")
    send.add_argument("--to", required=True)
    send.add_argument("--flows", type=int, required=True)
    send.add_argument("--cc", default="cubic")
    send.add_argument("--max-seconds", type=float, default=600.0)
    args = parser.parse_args(argv)
    seconds = min(args.max_seconds, MAX_SECONDS + 5)
    if args.role == "sink":
        run_sink(args.bind, args.port, args.flows, seconds)
    else:
        host, _, port = args.to.rpartition(":")
        run_sender(host.strip("[]"), int(port), args.flows, args.cc, seconds)


if __name__ == "__main__":
    main()
