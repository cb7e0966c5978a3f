"""Programs run inside the test topology's namespaces, each bounded in time and count.

Every helper starts a small Python program with ``ip netns exec`` (a server in the prefill
site, a client in the decode site or the other way round), reads one JSON line from it, and
kills what it started. Addresses are the topology's own (10.77.1.1 / 10.77.2.1).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

PREFILL_ADDR = "10.77.1.1"
DECODE_ADDR = "10.77.2.1"

_ECHO_SERVER = r"""
import json, socket, sys
l = socket.socket(); l.bind((sys.argv[1], 0)); l.listen(4); l.settimeout(60)
print(json.dumps({"port": l.getsockname()[1]}), flush=True)
c, _ = l.accept(); c.settimeout(60)
while True:
    d = c.recv(65536)
    if not d:
        break
    c.sendall(d)
"""

_RTT_CLIENT = r"""
import json, socket, sys, time
from pdx.tcp import tcp_info
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
n, pause, marker = int(sys.argv[3]), float(sys.argv[4]), sys.argv[5] if len(sys.argv) > 5 else ""
rtts = []
for i in range(n):
    if marker and i == n // 2:
        print(json.dumps({"half": True}), flush=True)
        sys.stdin.readline()  # the test changes the link here
    t0 = time.perf_counter(); s.sendall(b"x" * 64); got = 0
    while got < 64:
        got += len(s.recv(64 - got))
    rtts.append((time.perf_counter() - t0) * 1e3)
    time.sleep(pause)
print(json.dumps({"rtts": rtts, "tcp_info": tcp_info(s).as_dict()}), flush=True)
"""

_UDP_SINK = r"""
import json, socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((sys.argv[1], 0))
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
print(json.dumps({"port": s.getsockname()[1]}), flush=True)
seqs = []; s.settimeout(30)
try:
    while True:
        d = s.recv(2048)
        if d[:4] == b"DONE":
            s.settimeout(1.0)  # stragglers still in the delay line
            continue
        seqs.append(int.from_bytes(d[:4], "big"))
except socket.timeout:
    pass
print(json.dumps({"seqs": seqs}), flush=True)
"""

_UDP_SENDER = r"""
import socket, sys, time
addr = (sys.argv[1], int(sys.argv[2]))
n, size, pps = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
t0 = time.perf_counter()
for i in range(n):
    s.sendto(i.to_bytes(4, "big") + b"." * (size - 4), addr)
    ahead = t0 + (i + 1) / pps - time.perf_counter()
    if ahead > 0:
        time.sleep(ahead)
for _ in range(3):
    s.sendto(b"DONE", addr)
"""

_BULK_SINK = r"""
import hashlib, json, socket, sys
l = socket.socket(); l.bind((sys.argv[1], 0)); l.listen(1); l.settimeout(60)
print(json.dumps({"port": l.getsockname()[1]}), flush=True)
c, _ = l.accept(); c.settimeout(60); h = hashlib.sha256(); n = 0
while True:
    d = c.recv(1 << 20)
    if not d:
        break
    h.update(d); n += len(d)
print(json.dumps({"bytes": n, "sha256": h.hexdigest()}), flush=True)
"""

_BULK_SENDER = r"""
import hashlib, json, random, socket, sys, time
from pdx.tcp import tcp_info
data = random.Random(7).randbytes(int(sys.argv[3]))
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
t0 = time.perf_counter(); s.sendall(data); s.shutdown(socket.SHUT_WR)
s.settimeout(60); s.recv(1)  # the sink closes once it has everything
info = tcp_info(s)
print(json.dumps({"seconds": time.perf_counter() - t0, "sha256": hashlib.sha256(data).hexdigest(),
                  "tcp_info": info.as_dict()}), flush=True)
"""


def start(ns: str, code: str, *args: object) -> subprocess.Popen[str]:
    """``code`` under this interpreter inside namespace ``ns`` (stdin/stdout as pipes)."""
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-c", code, *map(str, args)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def first_line(proc: subprocess.Popen[str], timeout_s: float = 30.0) -> dict[str, Any]:
    """The next JSON line a helper program prints (or its stderr in the failure)."""
    import select

    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        err = proc.stderr.read() if proc.stderr else ""
        raise AssertionError(f"helper program printed nothing: {err[-800:]}")
    data: dict[str, Any] = json.loads(line)
    return data


def finish(*procs: subprocess.Popen[str]) -> None:
    """Kill whatever is still running."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


def ping(ns: str, addr: str, count: int, interval_s: float = 0.05) -> list[float]:
    """Per-packet RTTs (ms) of ``ping`` from ``ns``; lost ones are absent."""
    out = subprocess.run(
        ["ip", "netns", "exec", ns, "ping", "-n", "-c", str(count), "-i", str(interval_s),
         "-W", "2", addr],
        capture_output=True, text=True, timeout=count * interval_s + 30, check=False,
    ).stdout  # fmt: skip
    return [float(m) for m in re.findall(r"time=([0-9.]+) ms", out)]


def tcp_rtts(prefill_ns: str, decode_ns: str, n: int, pause_s: float = 0.02) -> dict[str, Any]:
    """``n`` small request/response round trips decode → prefill: app RTTs and TCP's own."""
    server = start(prefill_ns, _ECHO_SERVER, PREFILL_ADDR)
    try:
        port = first_line(server)["port"]
        client = start(decode_ns, _RTT_CLIENT, PREFILL_ADDR, port, n, pause_s)
        try:
            return first_line(client, timeout_s=60 + n * (pause_s + 1))
        finally:
            finish(client)
    finally:
        finish(server)


def udp_stream(sender_ns: str, sink_ns: str, sink_addr: str, n: int, *, size: int = 100,
               pps: float = 5000.0) -> list[int]:  # fmt: skip
    """Send ``n`` numbered datagrams at ``pps``; the sequence numbers that arrived, in order."""
    sink = start(sink_ns, _UDP_SINK, sink_addr)
    try:
        port = first_line(sink)["port"]
        sender = start(sender_ns, _UDP_SENDER, sink_addr, port, n, size, pps)
        sender.wait(timeout=n / pps + 30)
        seqs: list[int] = first_line(sink, timeout_s=60)["seqs"]
        return seqs
    finally:
        finish(sink)


def bulk(sender_ns: str, sink_ns: str, sink_addr: str, nbytes: int) -> dict[str, Any]:
    """One TCP transfer of ``nbytes``: the sender's TCP_INFO and both ends' SHA-256."""
    sink = start(sink_ns, _BULK_SINK, sink_addr)
    try:
        port = first_line(sink)["port"]
        sender = start(sender_ns, _BULK_SENDER, sink_addr, port, nbytes)
        try:
            sent = first_line(sender, timeout_s=120)
        finally:
            finish(sender)
        got = first_line(sink, timeout_s=30)
        return {**sent, "received": got}
    finally:
        finish(sink)
