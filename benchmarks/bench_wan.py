"""What the packet-level WAN emulator can carry, what it costs, and what loss does to TCP.

Builds ``pdx faults netns`` sites with 25 ms each way (50 ms RTT) on the router hop and runs
iperf3 between them (server in the prefill site sending, ``-R``: the way KV travels), in the
same run:

* capacity: 4 streams at a 1000 Mbit/s cap with the userspace emulator, median of ``--runs``
  (goal: >= 0.85 of the cap), and the emulator's CPU seconds per GB moved;
* cost of per-wire-packet fidelity: no loss (aggregates pass whole), 0.5 % loss (aggregates
  split where a packet is lost), and the alternative of sites sending unaggregated frames
  (``gso_max_segs 1``: the emulator then handles every wire packet);
* one CUBIC stream and one BBR stream with 0.5 % loss, side by side.

Root only (skips cleanly otherwise); needs iperf3 (installed from Debian's package when
missing). Every address lives in the namespaces it creates, which are removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

from pdx.faults import netns
from pdx.faults.netns import SUBNET_PREFILL
from pdx.faults.wan import control

PREFIX = f"pdxb{os.getpid() % 10000}"
SERVER = f"{SUBNET_PREFILL}.1"
CAP_MBIT = 1000.0
DELAY_MS = 25.0


def ensure_iperf3() -> bool:
    """iperf3 from Debian's package when missing."""
    if shutil.which("iperf3"):
        return True
    subprocess.run(["apt-get", "install", "-y", "-qq", "iperf3"], capture_output=True,
                   check=False, timeout=300)  # fmt: skip
    return shutil.which("iperf3") is not None


def emulator_cpu_s(cfg: netns.NetnsConfig) -> float:
    """User + system CPU seconds the emulator process has used so far."""
    st = control.supervisor_state(cfg.state_dir) or {}
    pid = st.get("emulator_pid")
    if not pid:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def iperf3(cfg: netns.NetnsConfig, seconds: int, streams: int = 1, cc: str | None = None,
           port: int = 5201) -> dict[str, Any]:  # fmt: skip
    """One iperf3 run, prefill site → decode site; goodput, retransmits, mean RTT."""
    server = subprocess.Popen(["ip", "netns", "exec", cfg.prefill, "iperf3", "-s", "-1", "-B",
                               SERVER, "-p", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        cmd = [
            "ip",
            "netns",
            "exec",
            cfg.decode,
            "iperf3",
            "-c",
            SERVER,
            "-p",
            str(port),
            "-R",
            "-t",
            str(seconds),
            "-O",
            "2",
            "-P",
            str(streams),
            "-J",
            "--get-server-output",
        ]
        if cc:
            cmd += ["-C", cc]
        for _ in range(50):
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
            doc = json.loads(out.stdout or "{}")
            if "refused" in str(doc.get("error", "")):
                time.sleep(0.1)
                continue
            if "error" in doc:
                raise RuntimeError(f"iperf3: {doc['error']}")
            end = doc["end"]
            rtts = [s["sender"].get("mean_rtt") for s in end.get("streams", [])
                    if s.get("sender", {}).get("mean_rtt")]  # fmt: skip
            return {
                "mbit_s": end["sum_received"]["bits_per_second"] / 1e6,
                "bytes": end["sum_received"]["bytes"],
                "retransmits": end["sum_sent"].get("retransmits"),
                "mean_rtt_ms": statistics.mean(rtts) / 1e3 if rtts else None,
            }
        raise RuntimeError("iperf3 server never came up")
    finally:
        server.kill()
        server.wait()


def measured(cfg: netns.NetnsConfig, runs: int, seconds: int, **kw: Any) -> dict[str, Any]:
    """Median of ``runs`` iperf3 runs, with the emulator's CPU seconds per GB."""
    cpu0 = emulator_cpu_s(cfg)
    results = [iperf3(cfg, seconds, port=5201 + i, **kw) for i in range(runs)]
    cpu = emulator_cpu_s(cfg) - cpu0
    moved_gb = sum(r["bytes"] for r in results) / 1e9
    return {
        "mbit_s_median": statistics.median(r["mbit_s"] for r in results),
        "mbit_s": [round(r["mbit_s"], 1) for r in results],
        "retransmits": [r["retransmits"] for r in results],
        "emulator_cpu_s_per_gb": round(cpu / moved_gb, 3) if moved_gb else None,
    }


def conditions(**kw: Any) -> netns.NetnsConfig:
    """The bench topology with these conditions (applied live)."""
    cfg = netns.make_config(prefix=PREFIX, emulator="userspace", rate_mbit=CAP_MBIT,
                            delay_ms=DELAY_MS, seed=1, **kw)  # fmt: skip
    netns.up(cfg)
    return cfg


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seconds", type=int, default=8)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if os.geteuid() != 0 or not os.path.exists("/dev/net/tun"):
        print("bench_wan: needs root and /dev/net/tun; skipped")
        return 0
    if not ensure_iperf3():
        print("bench_wan: iperf3 not available; skipped")
        return 0
    out: dict[str, Any] = {"delay_ms_each_way": DELAY_MS, "cap_mbit": CAP_MBIT}
    cfg = conditions()
    try:
        cap = measured(cfg, args.runs, args.seconds, streams=4)
        cap["ratio_to_cap"] = round(cap["mbit_s_median"] / CAP_MBIT, 3)
        out["capacity_4_streams"] = cap
        conditions(loss=0.005)
        out["cost_loss_0.5pct_4_streams"] = measured(cfg, args.runs, args.seconds, streams=4)
        conditions()
        for site in (cfg.prefill, cfg.decode):  # every frame alone: one read per wire packet
            subprocess.run(["ip", "-n", site, "link", "set", "dev", "eth-router", "gso_max_segs",
                            "1"], check=True)  # fmt: skip
        out["cost_unaggregated_4_streams"] = measured(cfg, args.runs, args.seconds, streams=4)
        for site in (cfg.prefill, cfg.decode):
            subprocess.run(["ip", "-n", site, "link", "set", "dev", "eth-router", "gso_max_segs",
                            "65535"], check=True)  # fmt: skip
        conditions(loss=0.005)
        out["loss_0.5pct_1_stream"] = {
            cc: measured(cfg, args.runs, args.seconds, cc=cc) for cc in ("cubic", "bbr")
        }
        conditions(loss=0.001)
        out["loss_0.1pct_1_stream"] = {
            cc: measured(cfg, args.runs, args.seconds, cc=cc) for cc in ("cubic", "bbr")
        }
    finally:
        netns.down(cfg)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    cap = out["capacity_4_streams"]
    goal = "met" if cap["ratio_to_cap"] >= 0.85 else "NOT met"
    print(f"WAN emulator, {DELAY_MS:g} ms each way, {CAP_MBIT:g} Mbit/s cap, iperf3 -R, medians "
          f"of {args.runs} x {args.seconds} s")  # fmt: skip
    print(f"  4 streams: {cap['mbit_s_median']:.0f} Mbit/s = {cap['ratio_to_cap']:.3f} of the cap "
          f"(goal >= 0.85: {goal}); emulator {cap['emulator_cpu_s_per_gb']} CPU-s/GB")  # fmt: skip
    costs = (("cost_loss_0.5pct_4_streams", "0.5 % loss (aggregates split)"),
             ("cost_unaggregated_4_streams", "no loss, unaggregated frames"))  # fmt: skip
    for key, label in costs:
        r = out[key]
        print(f"  {label}: {r['mbit_s_median']:.0f} Mbit/s, emulator "
              f"{r['emulator_cpu_s_per_gb']} CPU-s/GB")  # fmt: skip
    for key in ("loss_0.5pct_1_stream", "loss_0.1pct_1_stream"):
        r = out[key]
        print(f"  1 stream, {key.split('_')[1]} loss: CUBIC {r['cubic']['mbit_s_median']:.0f} "
              f"Mbit/s, BBR {r['bbr']['mbit_s_median']:.0f} Mbit/s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
