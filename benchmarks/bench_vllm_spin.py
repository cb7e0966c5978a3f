"""What the idle-spin fixes of the vLLM environment buy: idle CPU, and latency under load.

For each setting (vLLM and NIXL as shipped; pdx's defaults; anything given with --setting)
this starts a real vLLM prefill/decode pair with ``pdx deploy``'s Deployment, measures the
CPU every thread of the pair uses over ``--idle-s`` with no request (from /proc, per thread),
then sends an open-loop Poisson load through the pdx gateway on the disaggregated route
(unique 200-token prompts, 8 tokens out) and reports client-side latency and the CPU used.

    python benchmarks/bench_vllm_spin.py [--idle-s 10] [--load-s 30] [--rps 4] [--json]
        [--setting NAME=key=value,key=value ...]

Needs the vLLM environment (``make vllm``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp

from pdx.serving.deploy_config import load_deploy_config
from pdx.serving.supervisor import Deployment

BASE = ["engine=vllm", "gateway.port=0", "router.local_prefill_max_tokens=8"]
SETTINGS = {
    "as shipped": ["vllm.nixl_progress_delay_us=0", "vllm.shm_busy_loop_s=1"],
    "NIXL fix only": ["vllm.nixl_progress_delay_us=1000", "vllm.shm_busy_loop_s=1"],
    "shm fix only": ["vllm.nixl_progress_delay_us=0", "vllm.shm_busy_loop_s=0.02"],
    "pdx defaults": [],  # nixl_progress_delay_us 1000, shm_busy_loop_s 0.02
}


def _tree(root: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                kids.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += kids.get(pid, [])
    return out


def _ticks(pids: list[int]) -> dict[tuple[int, int], tuple[str, int]]:
    out = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                name = stat[stat.index("(") + 1 : stat.rindex(")")]
                fields = stat.rsplit(")", 1)[1].split()
                out[(pid, int(tid))] = (name, int(fields[11]) + int(fields[12]))
    return out


def cpu_over(pids: list[int], seconds: float) -> dict[str, Any]:
    """CPU of every thread of ``pids`` over ``seconds``: total and the busiest threads."""
    a = _ticks(pids)
    time.sleep(seconds)
    b = _ticks(pids)
    hz = os.sysconf("SC_CLK_TCK")
    used = {k: (b[k][1] - a.get(k, (b[k][0], b[k][1]))[1]) / hz / seconds for k in b}
    top = sorted(used.items(), key=lambda kv: -kv[1])[:3]
    return {"cores": round(sum(used.values()), 3),
            "busiest": [f"{b[k][0]} {v * 100:.0f}%" for k, v in top]}  # fmt: skip


async def _load(gw: str, seconds: float, rps: float, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as s:

        async def one() -> None:
            body = {"prompt": [rng.randint(4, 259) for _ in range(200)], "max_tokens": 8,
                    "ignore_eos": True, "temperature": 0, "pdx_route": "disaggregated"}  # fmt: skip
            t0 = time.perf_counter()
            async with s.post(gw + "/v1/completions", json=body) as r:
                data = await r.json()
            ttft = (data.get("pdx") or {}).get("timings_ms", {}).get("ttft")
            e2e_ms = (time.perf_counter() - t0) * 1e3
            out.append({"e2e_ms": e2e_ms, "ok": r.status == 200, "ttft_ms": ttft})

        tasks, t0 = [], time.monotonic()
        while time.monotonic() - t0 < seconds:
            tasks.append(asyncio.create_task(one()))
            await asyncio.sleep(rng.expovariate(rps))
        await asyncio.gather(*tasks)
    return out


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


@contextlib.contextmanager
def _pair(sets: list[str]) -> Iterator[Deployment]:
    loop = asyncio.new_event_loop()
    dep = Deployment(load_deploy_config(dotted=[*BASE, *sets]))
    pool = ThreadPoolExecutor(1)
    try:
        loop.run_until_complete(dep.start())
        stop = asyncio.Event()
        serving = pool.submit(loop.run_until_complete, stop.wait())
        try:
            yield dep
        finally:
            loop.call_soon_threadsafe(stop.set)
            serving.result(30)
    finally:
        loop.run_until_complete(dep.stop())
        loop.close()
        pool.shutdown()


def run_setting(name: str, sets: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Idle CPU and loaded latency of one setting."""
    with _pair(sets) as dep:
        pids = [p for c in dep.children if c.proc for p in _tree(c.proc.pid)]
        asyncio.run(_load(dep.endpoints().gateway, 3.0, 2.0, 1))  # warm: NIXL handshake
        time.sleep(2.0)  # out of vLLM's own 1 s busy window
        idle = cpu_over(pids, args.idle_s)
        t0 = time.monotonic()
        with ThreadPoolExecutor(1) as sampler:
            loaded = sampler.submit(cpu_over, pids, args.load_s)
            rows = asyncio.run(_load(dep.endpoints().gateway, args.load_s, args.rps, 2))
            busy = loaded.result()
        elapsed = time.monotonic() - t0
    ok = [r for r in rows if r["ok"]]
    e2e = [r["e2e_ms"] for r in ok]
    ttft = [r["ttft_ms"] for r in ok if r["ttft_ms"] is not None]
    return {"setting": name, "overrides": sets, "idle_cores": idle["cores"],
            "idle_busiest": idle["busiest"], "loaded_cores": busy["cores"],
            "requests": len(rows), "failed": len(rows) - len(ok),
            "achieved_rps": round(len(rows) / elapsed, 2), "e2e_p50_ms": _pct(e2e, 0.5),
            "e2e_p99_ms": _pct(e2e, 0.99), "ttft_p50_ms": _pct(ttft, 0.5),
            "ttft_p99_ms": _pct(ttft, 0.99),
            "e2e_mean_ms": round(statistics.fmean(e2e), 1)}  # fmt: skip


def main() -> None:
    """Every setting in turn; one line each (or JSON)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--load-s", type=float, default=30.0)
    ap.add_argument("--rps", type=float, default=4.0)
    ap.add_argument("--setting", action="append", default=[], help="NAME=k=v,k=v")
    ap.add_argument("--only", action="append", default=[], help="run only these settings")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not _engine_available():
        return
    # SIGTERM (timeout, CI) unwinds like Ctrl-C, so the pair's processes are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    settings = dict(SETTINGS)
    for item in args.setting:
        name, _, sets = item.partition("=")
        settings[name] = [s for s in sets.split(",") if s]
    if args.only:
        settings = {k: v for k, v in settings.items() if k in args.only}
    results = []
    for name, sets in settings.items():
        res = run_setting(name, sets, args)
        results.append(res)
        if not args.json:
            busiest = ", ".join(res["idle_busiest"])
            print(f"{name:>14}: idle {res['idle_cores']:.3f} cores ({busiest}); "
                  f"{args.rps:g} req/s: e2e p50 {res['e2e_p50_ms']} p99 {res['e2e_p99_ms']} ms, "
                  f"TTFT p50 {res['ttft_p50_ms']} p99 {res['ttft_p99_ms']} ms, "
                  f"pair CPU {res['loaded_cores']:.2f} cores, "
                  f"{res['failed']} failed of {res['requests']}", flush=True)  # fmt: skip
    if args.json:
        json.dump(results, sys.stdout, indent=2)


def _engine_available() -> bool:
    """False, with the reason on stderr, where this machine has no vLLM environment (make vllm)."""
    from pdx.serving.engines.env import EngineUnavailable, discover

    try:
        discover()
    except EngineUnavailable as exc:
        print(f"skipped: vLLM environment unavailable: {exc}", file=sys.stderr)
        return False
    return True


if __name__ == "__main__":
    main()
