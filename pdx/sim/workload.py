"""Workloads: Poisson arrivals with a prompt-length mix, or a trace to replay (pdx.traces)."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from pathlib import Path

from pdx.sim.config import WorkloadConfig


@dataclass
class Workload:
    """Requests sorted by arrival: parallel lists of arrival time, prompt and output tokens."""

    arrival_s: list[float]
    prompt_tokens: list[int]
    output_tokens: list[int]
    source: str
    hash_ids: list[tuple[int, ...]] | None = None  # per request, its blocks (a trace's reuse)
    block_size: int = 0  # tokens per hash id

    def __len__(self) -> int:
        return len(self.arrival_s)


def poisson_workload(cfg: WorkloadConfig) -> Workload:
    """Draw, per request, an exponential gap then a prompt length (in that order).

    The order of draws matters: it is what makes seed 7 reproduce the published workload.
    """
    rng = random.Random(cfg.seed)
    rate = cfg.rate_per_s
    lengths = cfg.prompt_tokens
    # the cumulative weights choices() would compute on every call: same draws, less work
    cum = list(itertools.accumulate(cfg.prompt_weights))
    expo, choices = rng.expovariate, rng.choices
    t = 0.0
    arrival: list[float] = []
    prompt: list[int] = []
    for _ in range(cfg.requests):
        t += expo(rate)
        arrival.append(t)
        prompt.append(choices(lengths, cum_weights=cum)[0])
    output = [cfg.output_tokens] * cfg.requests
    source = f"poisson(rate={rate}/s, n={cfg.requests}, seed={cfg.seed})"
    return Workload(arrival, prompt, output, source)


def load_trace(path: Path | str, cfg: WorkloadConfig | None = None) -> Workload:
    """A trace (any format :mod:`pdx.traces` reads) as a workload: the window ``cfg`` names,
    its lengths and block size times ``length_scale``, its times times ``time_scale``."""
    from pdx.traces.formats import read_trace
    from pdx.traces.prompts import scaled
    from pdx.traces.schedule import Window, plan

    c = cfg or WorkloadConfig.model_validate({})
    trace = read_trace(path, c.format, block_size=c.block_size, field_name="workload")
    window = Window(c.start_s, c.duration_s, c.max_requests, c.time_scale)
    planned, _ = plan(trace, window)
    t0 = planned[0].request.arrival_s * c.time_scale  # arrivals keep the trace's own offset
    ls = c.length_scale
    return Workload(
        [t0 + p.send_s for p in planned],
        [scaled(p.request.input_tokens, ls) for p in planned],
        [scaled(p.request.output_tokens, ls) for p in planned],
        f"trace {Path(path).name}",
        hash_ids=[p.request.hash_ids for p in planned] if trace.has_reuse else None,
        block_size=scaled(trace.block_size, ls),
    )


def build_workload(cfg: WorkloadConfig) -> Workload:
    """The trace when one is named, else the Poisson workload."""
    return load_trace(cfg.trace, cfg) if cfg.trace else poisson_workload(cfg)
