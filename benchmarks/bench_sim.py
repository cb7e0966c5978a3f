"""Simulator speed: one million requests, and the segment engine against a per-step loop.

Prints wall time and events/s for a 1,000,000-request cluster run (goal: under 60 s on a
2-core machine), and the speed-up of the engine over a literal per-step loop measured in
the same run on the same small workload. Usage: python benchmarks/bench_sim.py [N]
"""

from __future__ import annotations

import statistics
import sys
import time

from pdx.sim.config import PUBLISHED_ILLUSTRATION, SimConfig
from pdx.sim.engine import run_mode
from pdx.sim.runner import simulate
from pdx.sim.workload import Workload, poisson_workload

GOAL_S = 60.0


def cluster_config(requests: int) -> SimConfig:
    """The illustration's model and prompt mix at cluster scale: 8 req/s over many instances."""
    return SimConfig.model_validate(
        {
            **PUBLISHED_ILLUSTRATION,
            "prefill_instances": 16,
            "decode_instances": 24,
            "colocated_instances": 40,
            "workload": {
                **PUBLISHED_ILLUSTRATION["workload"],
                "requests": requests,
                "rate_per_s": 8.0,
            },
        }
    )


def per_step_loop(cfg: SimConfig, wl: Workload) -> int:
    """The obvious implementation: one iteration per decode step (disaggregated, 1P + 1D)."""
    free, ready = 0.0, []
    for a, p in zip(wl.arrival_s, wl.prompt_tokens, strict=True):
        free = max(a, free) + 2 * p * cfg.model_params / cfg.prefill_flops
        ready.append(free + p * cfg.kv_bytes_per_token / cfg.link_bytes_per_s)
    t, j, left, steps, n = 0.0, 0, {}, 0, len(wl)
    while j < n or left:
        if not left and ready[j] > t:
            t = ready[j]
        while j < n and ready[j] <= t:
            left[j] = wl.output_tokens[j]
            j += 1
        biggest = max(wl.prompt_tokens[i] for i in left)
        t += (
            len(left)
            * (cfg.weight_bytes + biggest * cfg.kv_bytes_per_token)
            / (cfg.decode_hbm_bytes_per_s)
        )
        steps += 1
        for i in list(left):
            left[i] -= 1
            if not left[i]:
                del left[i]
    return steps


def compare_small(repeats: int = 3) -> None:
    cfg = SimConfig.model_validate(
        {
            **PUBLISHED_ILLUSTRATION,
            "workload": {**PUBLISHED_ILLUSTRATION["workload"], "requests": 400},
        }
    )
    wl = poisson_workload(cfg.workload)
    loop_s, engine_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        steps = per_step_loop(cfg, wl)
        t1 = time.perf_counter()
        tr = run_mode(cfg, wl, "disaggregated")
        t2 = time.perf_counter()
        loop_s.append(t1 - t0)
        engine_s.append(t2 - t1)
    assert steps == sum(tr.step_count), "engine and per-step loop disagree on step count"
    loop, eng = statistics.median(loop_s), statistics.median(engine_s)
    print(f"400 requests, 1P+1D, {steps} decode steps (median of {repeats}):")
    print(f"  per-step loop {loop * 1e3:8.1f} ms   segment engine {eng * 1e3:8.1f} ms")
    print(f"  speed-up: {loop / eng:.1f}x")


def big_run(requests: int) -> None:
    cfg = cluster_config(requests)
    t0, c0 = time.perf_counter(), time.process_time()
    wl = poisson_workload(cfg.workload)
    gen_s = time.perf_counter() - t0
    report = simulate(cfg, wl)
    total, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(f"{requests:,} requests, 16 prefill + 24 decode vs 40 colocated, 8 req/s:")
    print(f"  workload generation {gen_s:6.2f} s")
    for mode in ("colocated", "disaggregated"):
        r = getattr(report, mode)
        print(
            f"  {mode:13s} events {r.events:>10,}  decode steps {r.decode_steps:>13,}  "
            f"TTFT p99 {r.ttft_p99_s:7.3f} s  ITL mean {r.itl_mean_s:.4f} s"
        )
    print(f"  simulate wall {report.wall_s:6.2f} s, {report.events_per_s:,.0f} events/s")
    print(f"  CPU time {cpu:.2f} s of {total:.2f} s wall (a lower share means a busy machine)")
    print(
        f"  total {total:.2f} s vs goal {GOAL_S:.0f} s: ratio {total / GOAL_S:.2f} "
        f"({'met' if total < GOAL_S else 'NOT met'})"
    )


def main() -> None:
    requests = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    compare_small()
    big_run(requests)


if __name__ == "__main__":
    main()
