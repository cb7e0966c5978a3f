"""Fault proxy benchmark: pass-through cost against direct loopback TCP, and fidelity.

Everything runs in this one invocation, so the ratios compare like with like on the same
(possibly busy) machine:

- throughput: one TCP stream of ``--mib`` MiB, client → sink, direct vs through a
  ``pdx faults proxy`` process with no toxic (goal: ratio >= 0.7);
- latency: 64-byte ping-pong, direct vs proxied (goal: added p50 <= 0.2 ms);
- fidelity: ``--latency-ms 25`` (round trip median vs 50 ms) and ``--bandwidth-mbps 400``
  (rate over 40 MB, measured at the receiver, vs 380-420 Mbit/s).

Usage: ``python benchmarks/bench_proxy.py [--mib 256] [--rounds 3] [--pings 2000] [--json]``
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

BLOCK = 1 << 20


def _sink_conn(conn: socket.socket) -> None:
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    total, first, last = 0, 0.0, 0.0
    while n := conn.recv_into(view):
        now = time.perf_counter()
        if total == 0:
            first = now
            first_bytes = n
        total += n
        last = now
    span = last - first
    rate = (total - first_bytes) * 8 / span / 1e6 if span > 0 else 0.0
    conn.sendall(json.dumps({"bytes": total, "mbit_s": rate}).encode())
    conn.close()


def _echo_conn(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := conn.recv(65536):
        conn.sendall(data)
    conn.close()


def _serve(sock: socket.socket, handler: Any) -> None:
    while True:
        conn, _ = sock.accept()
        threading.Thread(target=handler, args=(conn,), daemon=True).start()


def _servers(ports: Any) -> None:
    """Child process: a sink and an echo server on ephemeral ports."""
    sink = socket.create_server(("127.0.0.1", 0))
    echo = socket.create_server(("127.0.0.1", 0))
    ports.put((sink.getsockname()[1], echo.getsockname()[1]))
    threading.Thread(target=_serve, args=(sink, _sink_conn), daemon=True).start()
    _serve(echo, _echo_conn)


def send_stream(port: int, total_bytes: int) -> dict[str, float]:
    """Push ``total_bytes`` to the sink; returns sender-side and receiver-side rates."""
    payload = memoryview(b"\x5a" * BLOCK)
    with socket.create_connection(("127.0.0.1", port)) as conn:
        start = time.perf_counter()
        for _ in range(total_bytes // BLOCK):
            conn.sendall(payload)
        conn.shutdown(socket.SHUT_WR)
        reply = json.loads(conn.recv(4096))
        elapsed = time.perf_counter() - start
    assert reply["bytes"] == total_bytes, reply
    return {"mbit_s": total_bytes * 8 / elapsed / 1e6, "receiver_mbit_s": reply["mbit_s"]}


def ping_pong(port: int, count: int, size: int = 64) -> list[float]:
    """Round trips in ms."""
    payload = b"p" * size
    out = []
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(count):
            start = time.perf_counter()
            conn.sendall(payload)
            got = 0
            while got < size:
                got += len(conn.recv(size - got))
            out.append((time.perf_counter() - start) * 1e3)
    return out


class ProxyProcess:
    """``pdx faults proxy`` as a separate process, as users run it."""

    def __init__(self, upstream_port: int, *extra: str) -> None:
        cmd = [sys.executable, "-c", "from pdx.cli.main import main; main()", "faults", "proxy"]
        cmd += ["--listen", "127.0.0.1:0", "--upstream", f"127.0.0.1:{upstream_port}", *extra]
        self.proc = subprocess.Popen(
            cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
        )
        line = self.proc.stderr.readline()  # type: ignore[union-attr]
        match = re.search(r"listening on [\d.]+:(\d+)", line)
        if match is None:
            self.stop()
            raise RuntimeError(f"proxy did not start: {line}")
        self.port = int(match.group(1))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    servers = ctx.Process(target=_servers, args=(ports,), daemon=True)
    servers.start()
    try:
        sink_port, echo_port = ports.get(timeout=30)
        return _measure(args, sink_port, echo_port, servers.pid or 0)
    finally:
        servers.terminate()
        servers.join(5)


def _measure(
    args: argparse.Namespace, sink_port: int, echo_port: int, server_pid: int
) -> dict[str, Any]:
    total = args.mib * BLOCK
    plain_tp = ProxyProcess(sink_port)
    plain_echo = ProxyProcess(echo_port)
    cpu = {"direct": [0.0, 0.0, 0.0], "proxy": [0.0, 0.0, 0.0]}  # client, server, proxy
    try:
        direct: list[float] = []
        proxied: list[float] = []
        for _ in range(args.rounds):  # interleaved, so both see the same machine load
            for name, port in (("direct", sink_port), ("proxy", plain_tp.port)):
                before = (time.process_time(), cpu_s(server_pid), cpu_s(plain_tp.proc.pid))
                rate = send_stream(port, total)["mbit_s"]
                after = (time.process_time(), cpu_s(server_pid), cpu_s(plain_tp.proc.pid))
                for i in range(3):
                    cpu[name][i] += after[i] - before[i]
                (direct if name == "direct" else proxied).append(rate)
        rtt_direct, rtt_proxy = [], []
        for _ in range(4):
            rtt_direct += ping_pong(echo_port, args.pings // 4)
            rtt_proxy += ping_pong(plain_echo.port, args.pings // 4)
    finally:
        plain_tp.stop()
        plain_echo.stop()
    fidelity = _fidelity(sink_port, echo_port)
    direct_mbit, proxy_mbit = statistics.median(direct), statistics.median(proxied)
    return {
        "throughput": {
            "bytes_per_run": total,
            "runs": args.rounds,
            "direct_mbit_s": round(direct_mbit, 1),
            "proxy_mbit_s": round(proxy_mbit, 1),
            "ratio": round(proxy_mbit / direct_mbit, 3),
            "goal_ratio": 0.7,
            "cpu_s_per_gib": {
                name: dict(
                    zip(
                        ("client", "server", "proxy"),
                        (round(x * (1 << 30) / (total * args.rounds), 3) for x in vals),
                        strict=True,
                    )
                )
                for name, vals in cpu.items()
            },
        },
        "latency": {
            "pings": len(rtt_direct),
            "direct_p50_ms": round(statistics.median(rtt_direct), 4),
            "proxy_p50_ms": round(statistics.median(rtt_proxy), 4),
            "added_p50_ms": round(statistics.median(rtt_proxy) - statistics.median(rtt_direct), 4),
            "direct_p99_ms": round(percentile(rtt_direct, 0.99), 4),
            "proxy_p99_ms": round(percentile(rtt_proxy, 0.99), 4),
            "goal_added_p50_ms": 0.2,
        },
        "fidelity": fidelity,
        "load_average": list(os.getloadavg()),
        "cpus": os.cpu_count(),
    }


def _fidelity(sink_port: int, echo_port: int) -> dict[str, Any]:
    delayed = ProxyProcess(echo_port, "--latency-ms", "25")
    try:
        rtts = ping_pong(delayed.port, 60)
    finally:
        delayed.stop()
    shaped = ProxyProcess(sink_port, "--bandwidth-mbps", "400", "--direction", "upstream")
    try:
        rate = send_stream(shaped.port, 40 * BLOCK)
    finally:
        shaped.stop()
    return {
        "latency_25ms_each_way": {
            "rtt_p50_ms": round(statistics.median(rtts), 3),
            "rtt_min_ms": round(min(rtts), 3),
            "rtt_p90_ms": round(percentile(rtts, 0.9), 3),
            "target_ms": "50 ± 1",
        },
        "bandwidth_400mbit": {
            "receiver_mbit_s": round(rate["receiver_mbit_s"], 1),
            "target_mbit_s": "380-420",
        },
    }


def render(result: dict[str, Any]) -> str:
    tp, lat, fid = result["throughput"], result["latency"], result["fidelity"]
    lines = [
        f"pass-through throughput  direct {tp['direct_mbit_s']:>9.1f} Mbit/s   "
        f"proxy {tp['proxy_mbit_s']:>9.1f} Mbit/s   ratio {tp['ratio']:.3f} (goal >= 0.7)",
        f"pass-through latency     direct p50 {lat['direct_p50_ms']:.4f} ms   "
        f"proxy p50 {lat['proxy_p50_ms']:.4f} ms   "
        f"added {lat['added_p50_ms']:.4f} ms (goal <= 0.2)",
        "CPU seconds per GiB      direct: client {client} + server {server}".format(
            **tp["cpu_s_per_gib"]["direct"]
        )
        + "   proxied: client {client} + server {server} + proxy {proxy}".format(
            **tp["cpu_s_per_gib"]["proxy"]
        ),
        f"latency 25 ms each way   RTT p50 {fid['latency_25ms_each_way']['rtt_p50_ms']} ms "
        f"(min {fid['latency_25ms_each_way']['rtt_min_ms']}, p90 "
        f"{fid['latency_25ms_each_way']['rtt_p90_ms']}; target 50 ± 1)",
        f"bandwidth 400 Mbit/s     measured {fid['bandwidth_400mbit']['receiver_mbit_s']} Mbit/s "
        "over 40 MiB (target 380-420)",
        "load average "
        + ", ".join(f"{x:.2f}" for x in result["load_average"])
        + f" on {result['cpus']} CPUs",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB per throughput run")
    parser.add_argument("--rounds", type=int, default=3, help="throughput runs per path")
    parser.add_argument("--pings", type=int, default=2000, help="round trips per path")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else render(result))


if __name__ == "__main__":
    main()
