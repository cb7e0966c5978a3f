"""KV transfer goodput vs iperf3 on loopback, measured in the same run.

For each transport (the store's data plane, and gRPC messages), chunk size
(256 KiB - 8 MiB) and TLS off/on: one iperf3 single-stream TCP run on loopback, then
``kv-bench`` (store in its own process, Put then Get of one object, checksums always
on). Ratio = KV goodput / iperf3 goodput of the same round; the summary quotes medians
over rounds. Goals: >= 0.90x without TLS, >= 0.60x with TLS. Each row also gives
CPU-seconds per GB, both ends together, for iperf3 (its own accounting), Put and Get
(client and store processes, all threads): on a shared machine goodput swings with
other load, CPU per GB much less, and it shows where the gap is.

    python benchmarks/bench_transfer.py [--bytes 256MB] [--rounds 3] [--transport data grpc]
                                        [--streams 1] [--chunk-kb 256 1024 ...] [--json]
    python benchmarks/bench_transfer.py --wan [--rounds 3] [--bytes 256MB] [--json]   (root)

``--wan`` measures across the emulated WAN of ``pdx faults netns`` instead (a store in the
prefill site, ``kv-bench --target`` in the decode site, iperf3 on the same path in the same
round, medians of the rounds): at 10 and 50 ms RTT with a 1 Gbit/s cap, one stream against
one iperf3 stream (goal >= 0.9x) and 4 streams against ``iperf3 -P 4`` (goal >= 0.8x); Get
is compared with iperf3 prefill → decode (the way KV travels), Put with decode → prefill.
With 0.1 % loss, one stream each (goal >= 0.9x).

The rule of the fight: both sides run the same congestion control (pdx's default, BBR;
``iperf3 -C bbr``), on the same path under the same kernel buffer caps (the namespaces'
``tcp_wmem``/``tcp_rmem``), with who goes first alternating from round to round; the label
("meets" / "below") is computed from the ratio, never printed as a given.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

from pdx.netaddr import listen_port
from pdx.transfer.bench import parse_size, run_bench

CHUNK_KB = (256, 1024, 4096, 8192)
GOALS = {False: 0.90, True: 0.60}


def ensure_iperf3() -> str | None:
    """Path of iperf3, installing the Debian package once if it is missing."""
    path = shutil.which("iperf3")
    if path is None and shutil.which("apt-get"):
        for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "iperf3"]):
            try:
                subprocess.run(cmd, check=False, capture_output=True, timeout=300)
            except (OSError, subprocess.TimeoutExpired):
                return None
        path = shutil.which("iperf3")
    return path


def _wait_listening(port: int, timeout_s: float = 5.0) -> None:
    """Poll the kernel's socket table (a probe connection would consume iperf3's test slot)."""
    needle = f":{port:04X} "
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                with open(table) as f:
                    lines = f.read().splitlines()[1:]
            except OSError:
                continue
            if any(needle in ln.split()[1] + " " and ln.split()[3] == "0A" for ln in lines):
                return
        time.sleep(0.02)
    raise RuntimeError("iperf3 server did not start")


def iperf3_run(iperf3: str, seconds: int = 2) -> tuple[float, float]:
    """Single-stream TCP on loopback: (goodput GB/s at the receiver, CPU-s per GB, both ends)."""
    port = listen_port()
    server = subprocess.Popen(
        [iperf3, "-s", "-1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        _wait_listening(port)
        out = subprocess.run(
            [iperf3, "-c", "127.0.0.1", "-p", str(port), "-t", str(seconds), "-J"],
            check=True,
            capture_output=True,
            text=True,
            timeout=seconds + 30,
        )
    finally:
        server.kill()
        server.wait()
    end = json.loads(out.stdout)["end"]
    recv = end["sum_received"]
    cpu = end["cpu_utilization_percent"]
    gb = recv["bytes"] / 1e9
    cpu_s = (cpu["host_total"] + cpu["remote_total"]) / 100 * recv["seconds"]
    return float(recv["bits_per_second"]) / 8e9, cpu_s / gb


def iperf3_gbytes_per_s(iperf3: str, seconds: int = 2) -> float:
    """Single-stream TCP goodput on loopback (receiver side), GB/s."""
    return iperf3_run(iperf3, seconds)[0]


def main() -> None:
    """Run the matrix and print one row per (chunk size, TLS) plus the goal check."""
    if "--wan" in sys.argv:
        wan_main()
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", default="256MB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--connections", type=int, default=1)
    ap.add_argument("--chunk-kb", type=int, nargs="*", default=list(CHUNK_KB))
    ap.add_argument("--transport", nargs="*", default=["data", "grpc"], choices=["data", "grpc"])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    total = parse_size(args.bytes, "--bytes")
    iperf3 = ensure_iperf3()
    rows: list[dict[str, Any]] = []
    combos = [(t, tls, c) for t in args.transport for tls in (False, True) for c in args.chunk_kb]
    for transport, tls, chunk_kb in combos:
        if True:
            rounds, cpus = [], []
            for _ in range(args.rounds):
                ref, ref_cpu = iperf3_run(iperf3) if iperf3 else (None, None)
                r = run_bench(
                    total,
                    chunk_kb=chunk_kb,
                    tls=tls,
                    streams=args.streams,
                    connections=args.connections,
                    transport=transport,
                    repeat=1,
                )
                rounds.append((ref, r.put_gbytes_per_s, r.get_gbytes_per_s))
                cpus.append(
                    (ref_cpu, _cpu_total(r.put_cpu_s_per_gb), _cpu_total(r.get_cpu_s_per_gb))
                )
            rows.append({"transport": transport, **_row(chunk_kb, tls, rounds)})
            rows[-1].update(_cpu_row(cpus))
            if not args.json:
                _print_row(rows[-1], first=len(rows) == 1)
    summary = _summary(rows)
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary, "iperf3": iperf3}, indent=2))
    else:
        if iperf3 is None:
            print("iperf3 not available: ratios skipped")
        for line in summary["lines"]:
            print(line)


def _row(
    chunk_kb: int, tls: bool, rounds: list[tuple[float | None, float, float]]
) -> dict[str, Any]:
    refs = [r for r, _, _ in rounds if r]
    row: dict[str, Any] = {
        "chunk_kb": chunk_kb,
        "tls": tls,
        "checksums": True,
        "iperf3_gbytes_per_s": round(statistics.median(refs), 3) if refs else None,
        "put_gbytes_per_s": round(statistics.median(p for _, p, _ in rounds), 3),
        "get_gbytes_per_s": round(statistics.median(g for _, _, g in rounds), 3),
    }
    if refs:
        row["put_ratio"] = round(statistics.median(p / r for r, p, _ in rounds if r), 3)
        row["get_ratio"] = round(statistics.median(g / r for r, _, g in rounds if r), 3)
    return row


def _cpu_total(per_side: dict[str, float]) -> float | None:
    """Client + store CPU-s per GB, or None if the store's share is unknown."""
    return per_side["client"] + per_side["store"] if "store" in per_side else None


def _cpu_row(cpus: list[tuple[float | None, float | None, float | None]]) -> dict[str, Any]:
    """Median CPU-seconds per GB (both ends together) of iperf3, Put and Get."""
    out: dict[str, Any] = {}
    for k, key in enumerate(("iperf3_cpu_s_per_gb", "put_cpu_s_per_gb", "get_cpu_s_per_gb")):
        vals = [c[k] for c in cpus if c[k] is not None]
        out[key] = round(statistics.median(vals), 3) if vals else None
    return out


def _print_row(row: dict[str, Any], first: bool) -> None:
    if first:
        head = ("transport", "chunk", "tls", "iperf3", "put", "get", "put/iperf", "get/iperf")
        print("{:>9} {:>7} {:>4} {:>8} {:>7} {:>7} {:>9} {:>9}".format(*head), end="")
        print("        CPU-s/GB: iperf3   put   get")
    ref = row["iperf3_gbytes_per_s"]
    nan = float("nan")
    print(
        f"{row['transport']:>9} {row['chunk_kb']:>5}Ki {('on' if row['tls'] else 'off'):>4} "
        f"{(f'{ref:.2f}' if ref else '-'):>8} "
        f"{row['put_gbytes_per_s']:>7.2f} {row['get_gbytes_per_s']:>7.2f} "
        f"{row.get('put_ratio', nan):>9.2f} {row.get('get_ratio', nan):>9.2f}  GB/s"
        f"  {_fmt(row.get('iperf3_cpu_s_per_gb')):>15} {_fmt(row.get('put_cpu_s_per_gb')):>5} "
        f"{_fmt(row.get('get_cpu_s_per_gb')):>5}"
    )
    sys.stdout.flush()


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    lines, best = [], {}
    for transport, tls in [(t, tls) for t in ("data", "grpc") for tls in (False, True)]:
        mine = [r for r in rows if r["tls"] is tls and r["transport"] == transport]
        mine = [r for r in mine if "put_ratio" in r]
        if not mine:
            continue
        top = max(mine, key=lambda r: min(r["put_ratio"], r["get_ratio"]))
        worst = min(top["put_ratio"], top["get_ratio"])
        best[f"{transport}_{'tls' if tls else 'plain'}"] = top
        verdict = "meets" if worst >= GOALS[tls] else "misses"
        lines.append(
            f"{transport:>4}, TLS {'on ' if tls else 'off'}: best chunk {top['chunk_kb']} KiB: "
            f"put {top['put_ratio']:.2f}x, get {top['get_ratio']:.2f}x iperf3 "
            f"-> {verdict} the {GOALS[tls]:.2f}x goal"
        )
    return {"best": best, "lines": lines}


# --- across the emulated WAN (root) -----------------------------------------------------

WAN_CAP_MBIT = 1000.0
WAN_GOALS = {1: 0.9, 4: 0.8}


def _iperf3_ns(topo: Any, reverse: bool, streams: int, seconds: int, cc: str | None) -> float:
    """iperf3 decode site → prefill site (``reverse``: prefill → decode), GB/s at the receiver."""
    import os

    port = 5301 + os.getpid() % 200
    server = subprocess.Popen(
        ["ip", "netns", "exec", topo.prefill, "iperf3", "-s", "-1", "-B", STORE, "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        cmd = ["ip", "netns", "exec", topo.decode, "iperf3", "-c", STORE, "-p", str(port), "-t",
               str(seconds), "-O", "1", "-P", str(streams), "-J", *(["-R"] if reverse else []),
               *(["-C", cc] if cc else [])]  # fmt: skip
        for _ in range(50):
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
            doc = json.loads(out.stdout or "{}")
            if "refused" in str(doc.get("error", "")):
                time.sleep(0.1)
                continue
            if "error" in doc:
                raise RuntimeError(f"iperf3: {doc['error']}")
            return float(doc["end"]["sum_received"]["bits_per_second"]) / 8e9
        raise RuntimeError("iperf3 server never came up")
    finally:
        server.kill()
        server.wait()


STORE = "10.77.1.1"


def _kv_bench_ns(topo: Any, port: int, total: int, streams: int, cc: str) -> dict[str, Any]:
    pdx = str(__import__("pathlib").Path(sys.executable).with_name("pdx"))
    out = subprocess.run(
        ["ip", "netns", "exec", topo.decode, pdx, "kv-bench", "--target", f"{STORE}:{port}",
         "--bytes", str(total), "--streams", str(streams), "--connections", str(streams),
         "--repeat", "1", "--congestion-control", cc, "--json"],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    data: dict[str, Any] = json.loads(out.stdout)
    return data


def _wan_case(
    topo: Any, port: int, total: int, rounds: int, streams: int, cc: str = "bbr"
) -> dict[str, Any]:
    rows = []
    for k in range(rounds):
        if k % 2:  # pdx first on odd rounds, iperf3 first on even ones
            kv = _kv_bench_ns(topo, port, total, streams, cc)
        up = _iperf3_ns(topo, False, streams, 5, cc)
        down = _iperf3_ns(topo, True, streams, 5, cc)
        if not k % 2:
            kv = _kv_bench_ns(topo, port, total, streams, cc)
        rows.append((up, down, kv["put_gbytes_per_s"], kv["get_gbytes_per_s"], kv))
    med = statistics.median
    return {
        "streams": streams,
        "iperf3_up_gbytes_per_s": round(med(r[0] for r in rows), 4),
        "iperf3_down_gbytes_per_s": round(med(r[1] for r in rows), 4),
        "put_gbytes_per_s": round(med(r[2] for r in rows), 4),
        "get_gbytes_per_s": round(med(r[3] for r in rows), 4),
        "put_ratio": round(med(r[2] / r[0] for r in rows), 3),
        "get_ratio": round(med(r[3] / r[1] for r in rows), 3),
        "rtt_ms": rows[-1][4]["rtt_ms"],
        "congestion_control": rows[-1][4]["congestion_control"],
        "iperf3_congestion_control": cc,
    }


def _conditions(prefix: str, **kw: Any) -> Any:
    from pdx.faults import netns

    return netns.make_config(prefix=prefix, emulator="userspace", rate_mbit=WAN_CAP_MBIT, seed=5,
                             **kw)  # fmt: skip


def wan_main() -> None:
    """Across ``pdx faults netns``: pdx next to iperf3 on the same path, in the same run."""
    import os

    from pdx.faults import netns

    ap = argparse.ArgumentParser(description="KV transfer across an emulated WAN vs iperf3")
    ap.add_argument("--wan", action="store_true")
    ap.add_argument("--bytes", default="256MB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0 or not ensure_iperf3():
        print("bench_transfer --wan: needs root and iperf3; skipped")
        return
    total = parse_size(args.bytes, "--bytes")
    prefix = f"pdxt{os.getpid() % 10000}"
    topo = netns.make_config(prefix=prefix, emulator="userspace", rate_mbit=WAN_CAP_MBIT, seed=5)
    netns.up(topo)
    pdx = str(__import__("pathlib").Path(sys.executable).with_name("pdx"))
    store = subprocess.Popen(
        ["ip", "netns", "exec", topo.prefill, pdx, "kv-serve", "--host", STORE, "--port", "0",
         "--budget-gb", "8", "--json"], stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    results: dict[str, Any] = {"cap_mbit": WAN_CAP_MBIT, "bytes": total, "rows": []}
    try:
        assert store.stdout is not None
        text = ""
        for line in store.stdout:
            text += line
            if line.startswith("}"):
                break
        port = int(json.loads(text)["port"])
        for rtt in (10, 50):
            netns.up(_conditions(prefix, delay_ms=rtt / 2))
            for streams in (1, 4):
                row = _wan_case(topo, port, total, args.rounds, streams)
                results["rows"].append({"rtt_ms_target": rtt, "loss": 0.0, **row})
                if not args.json:
                    _print_wan(results["rows"][-1])
        netns.up(_conditions(prefix, delay_ms=25, loss=0.001))
        row = _wan_case(topo, port, total, args.rounds, 1)
        results["rows"].append({"rtt_ms_target": 50, "loss": 0.001, **row})
        if not args.json:
            _print_wan(results["rows"][-1])
    finally:
        store.terminate()
        store.wait(timeout=10)
        netns.down(topo)
    if args.json:
        print(json.dumps(results, indent=2))


def _print_wan(r: dict[str, Any]) -> None:
    goal_x = WAN_GOALS[r["streams"]]
    worst = min(r["put_ratio"], r["get_ratio"])
    goal = f"{'meets' if worst >= goal_x else 'below'} the goal {goal_x}x (worst {worst:.2f}x)"
    print(
        f"RTT {r['rtt_ms_target']:>3} ms loss {r['loss'] * 100:g} % {r['streams']} stream(s) "
        f"[pdx {r['congestion_control']}, iperf3 {r['iperf3_congestion_control']}]: "
        f"put {r['put_gbytes_per_s'] * 8:.3f} Gbit/s ({r['put_ratio']:.2f}x iperf3 "
        f"{r['iperf3_up_gbytes_per_s'] * 8:.3f}), get {r['get_gbytes_per_s'] * 8:.3f} Gbit/s "
        f"({r['get_ratio']:.2f}x iperf3 {r['iperf3_down_gbytes_per_s'] * 8:.3f}); {goal}"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
