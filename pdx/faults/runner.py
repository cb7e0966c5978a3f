"""Running a proxy as a service: proxy + optional control API + optional timeline, until stopped."""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdx.errors import InputError
from pdx.faults import toxics as tx
from pdx.faults.proxy import FaultProxy
from pdx.faults.timeline import Timeline, run_timeline


@dataclass
class ProxyOptions:
    """What ``pdx faults proxy`` was asked for, before validation into toxics."""

    listen: tuple[str, int]
    upstream: tuple[str, int]
    udp: bool = False
    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    jitter_dist: str = "uniform"
    bandwidth_mbps: float | None = None
    loss: float = 0.0
    direction: str = "both"
    api: tuple[str, int] | None = None
    api_token: str | None = None
    seed: int | None = None
    stall_ms: float = 200.0
    extra: list[dict[str, Any]] = field(default_factory=list)


def _number(name: str, value: float, *, low: float = 0.0, high: float = math.inf) -> None:
    if not (math.isfinite(value) and low <= value <= high):
        upper = "" if high == math.inf else f" and <= {high:g}"
        raise InputError(name, value, f"a finite number >= {low:g}{upper}")


def toxics_from_options(opts: ProxyOptions) -> list[tx.Toxic]:
    """Turn command-line shortcuts into toxics; bad numbers fail with the option's name."""
    _number("--latency-ms", opts.latency_ms)
    _number("--jitter-ms", opts.jitter_ms)
    _number("--loss", opts.loss, high=1.0)
    if opts.bandwidth_mbps is not None and not (
        math.isfinite(opts.bandwidth_mbps) and opts.bandwidth_mbps > 0
    ):
        raise InputError("--bandwidth-mbps", opts.bandwidth_mbps, "a finite number > 0")
    if opts.direction not in ("both", "upstream", "downstream"):
        raise InputError("--direction", opts.direction, "both, upstream or downstream")
    if opts.jitter_dist not in ("uniform", "normal"):
        raise InputError("--jitter-dist", opts.jitter_dist, "uniform or normal")
    out: list[dict[str, Any]] = []
    d = opts.direction
    if opts.latency_ms or opts.jitter_ms:
        out.append(
            {
                "type": "latency",
                "direction": d,
                "latency_ms": opts.latency_ms,
                "jitter_ms": opts.jitter_ms,
                "jitter_dist": opts.jitter_dist,
            }
        )
    if opts.bandwidth_mbps is not None:
        out.append({"type": "bandwidth", "direction": d, "rate_mbps": opts.bandwidth_mbps})
    if opts.loss > 0:
        if opts.udp:
            out.append({"type": "loss", "direction": d, "probability": opts.loss})
        else:  # TCP never loses bytes; a lost segment shows up as a retransmission stall
            out.append(
                {
                    "type": "stall",
                    "direction": d,
                    "probability": opts.loss,
                    "duration_ms": opts.stall_ms,
                }
            )
    return [tx.parse_toxic(t) for t in out + opts.extra]


async def serve(
    opts: ProxyOptions,
    *,
    timeline: Timeline | None = None,
    duration_s: float | None = None,
    on_ready: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run until ``duration_s`` passes, SIGINT/SIGTERM, or forever; returns final stats."""
    toxics = toxics_from_options(opts)
    proxy = FaultProxy(
        opts.listen, opts.upstream, udp=opts.udp, toxics=toxics, seed=opts.seed, check_upstream=True
    )
    await proxy.start()
    control = None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    timeline_task = None
    records: list[dict[str, Any]] = []
    try:
        if opts.api is not None:
            from pdx.faults.api import ControlServer

            control = ControlServer(proxy, *opts.api, token=opts.api_token)
            await control.start()
        if on_ready is not None:
            on_ready({"listen": list(proxy.address), "api": control.url if control else None})
        if timeline is not None:
            timeline_task = asyncio.create_task(run_timeline(proxy, timeline, records))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), duration_s)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)
        await _finish(timeline_task)
        if control is not None:
            await control.stop()
        stats = proxy.stats()
        await proxy.stop()
    stats["timeline"] = records if timeline is not None else None
    return stats


async def _finish(task: asyncio.Task[list[dict[str, Any]]] | None) -> None:
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
