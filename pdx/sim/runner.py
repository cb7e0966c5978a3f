"""Run the configured modes over one workload and collect the report."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pdx.errors import InputError
from pdx.sim.config import SimConfig
from pdx.sim.engine import run_mode
from pdx.sim.metrics import PERCENTILE_METHOD, ModeResult, summarize
from pdx.sim.workload import Workload, build_workload


@dataclass
class SimReport:
    """The result of ``pdx simulate``: one :class:`ModeResult` per mode, plus provenance."""

    workload: str
    requests: int
    compat: str
    percentile_method: str
    wall_s: float
    events_per_s: float
    colocated: ModeResult | None = None
    disaggregated: ModeResult | None = None
    config: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] | None = None


def check_fits(cfg: SimConfig, workload: Workload) -> None:
    """A request whose KV can never fit the decode budget would wait forever: say so now."""
    if cfg.decode_kv_budget_bytes is None:
        return
    largest = max(
        p + o for p, o in zip(workload.prompt_tokens, workload.output_tokens, strict=True)
    )
    need = largest * cfg.kv_bytes_per_token
    if need > cfg.decode_kv_budget_bytes:
        raise InputError(
            "decode_kv_budget_bytes",
            cfg.decode_kv_budget_bytes,
            f"at least {need:.4g} (the largest request holds {largest} tokens of KV)",
        )


def simulate(cfg: SimConfig, workload: Workload | None = None) -> SimReport:
    """Simulate every mode in ``cfg.modes`` over ``workload`` (built from the config if None)."""
    wl = workload if workload is not None else build_workload(cfg.workload)
    check_fits(cfg, wl)
    start = time.perf_counter()
    results: dict[str, ModeResult] = {}
    events = 0
    for mode in cfg.modes:
        results[mode] = summarize(run_mode(cfg, wl, mode), cfg)
        events += results[mode].events
    wall = time.perf_counter() - start
    return SimReport(
        workload=wl.source,
        requests=len(wl),
        compat=cfg.compat,
        percentile_method=PERCENTILE_METHOD,
        wall_s=wall,
        events_per_s=events / wall if wall > 0 else 0.0,
        colocated=results.get("colocated"),
        disaggregated=results.get("disaggregated"),
        config=cfg.model_dump(mode="json"),
    )
