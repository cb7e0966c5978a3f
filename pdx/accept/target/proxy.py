"""Network conditions on the KV link, applied through an in-process fault proxy.

The proxy sits between decode and prefill's KV store (``pdx deploy`` routes KV reads to it);
each step's condition becomes toxics (latency, stalls for loss, bandwidth) plus an optional
timed link cut, and the proxy's counters before/after the step show the fault really fired.
Under ``target.netns`` the router's kernel applies loss and bandwidth (nft, tbf), so the proxy
gets only what the kernel cannot do here (no netem): latency, jitter and link cuts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from pdx.accept.playbook import Condition


def proxy_acts(c: Condition, *, kernel_shaping: bool = False) -> bool:
    """Whether the proxy has anything to do for ``c`` (``kernel_shaping``: under target.netns)."""
    if kernel_shaping:  # delay, jitter, loss and rate are packet-level on the router hop
        return c.link_down_at_s is not None
    return c.is_fault


def condition_toxics(c: Condition, *, kernel_shaping: bool = False) -> list[dict[str, Any]]:
    """The faults-proxy toxics for one condition (empty = normal).

    With ``kernel_shaping`` (target.netns) there are none: the router hop applies them.
    """
    toxics: list[dict[str, Any]] = []
    if kernel_shaping:  # the router hop applies delay, jitter, loss and rate, never twice
        return toxics
    if c.delay_ms or c.jitter_ms:
        toxics.append(
            {"type": "latency", "name": "delay", "latency_ms": c.delay_ms, "jitter_ms": c.jitter_ms}
        )
    if c.loss:
        toxics.append(
            {
                "type": "stall",
                "name": "loss",
                "probability": c.loss,
                "duration_ms": c.loss_stall_ms,
            }
        )
    if c.bandwidth_mbps:
        toxics.append({"type": "bandwidth", "name": "bandwidth", "rate_mbps": c.bandwidth_mbps})
    return toxics


def counters(stats: dict[str, Any]) -> dict[str, Any]:
    """Flatten a proxy ``stats()`` into the numbers a step compares."""
    toxic_bytes = sum(int(t.get("bytes", 0)) for t in stats.get("toxics", []))
    toxic_events = sum(int(t.get("packets", 0)) for t in stats.get("toxics", []))
    return {
        "bytes_total": sum(int(v) for v in (stats.get("bytes_in") or {}).values()),
        "connections": int(stats.get("connections_total", 0)),
        "connections_refused": int(stats.get("connections_refused", 0)),
        "link_down_events": int(stats.get("link_down_events", 0)),
        "toxic_bytes": toxic_bytes,
        "toxic_events": toxic_events,
        "per_toxic": _per_toxic(stats.get("toxics", [])),
    }


def _per_toxic(rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Bytes and chunks per toxic name, both directions summed (the proxy counts each apart)."""
    out: dict[str, dict[str, int]] = {}
    for t in rows:
        row = out.setdefault(str(t["name"]), {"bytes": 0, "chunks": 0})
        row["bytes"] += int(t.get("bytes", 0))
        row["chunks"] += int(t.get("packets", 0))
    return out


def counters_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the proxy did during one step."""
    out: dict[str, Any] = {}
    for key, value in after.items():
        if key == "per_toxic":
            prev = before.get("per_toxic", {})
            out[key] = {
                name: {k: v - prev.get(name, {}).get(k, 0) for k, v in row.items()}
                for name, row in value.items()
            }
        else:
            out[key] = value - before.get(key, 0)
    return out


class ProxyLink:
    """Drives the deploy's KV-link fault proxy through its control API, one condition per step.

    ``client`` is a :class:`pdx.faults.client.ControlClient` (blocking, stdlib HTTP): every call
    runs in a worker thread so the event loop keeps timing the step. ``kernel_shaping``: delay,
    jitter, loss and bandwidth are the router hop's job (target.netns); the proxy only cuts.
    """

    def __init__(self, client: Any, *, kernel_shaping: bool = False) -> None:
        self.client = client
        self.kernel_shaping = kernel_shaping
        self.events: list[dict[str, Any]] = []
        self._t0 = time.time()
        self._down_task: asyncio.Task[None] | None = None

    async def _call(self, method: str, *args: Any, **kw: Any) -> Any:
        return await asyncio.to_thread(getattr(self.client, method), *args, **kw)

    async def stats(self) -> dict[str, Any]:
        """Current flattened counters."""
        return counters(await self._call("stats"))

    async def apply(self, c: Condition, t0_wall_s: float) -> None:
        """Install the condition's toxics and schedule its link cut (relative to ``t0_wall_s``)."""
        self.events = []
        self._t0 = t0_wall_s
        await self._call("clear_toxics")
        for toxic in condition_toxics(c, kernel_shaping=self.kernel_shaping):
            await self._call("add_toxic", toxic)
            self._event(f"toxic {toxic['name']} added: {toxic}")
        if c.link_down_at_s is not None and c.link_down_for_s is not None:
            self._down_task = asyncio.create_task(self._cut(c.link_down_at_s, c.link_down_for_s))

    async def _cut(self, at_s: float, for_s: float) -> None:
        await asyncio.sleep(max(0.0, self._t0 + at_s - time.time()))
        await self._call("link_down", None, "reset")
        self._event(f"link down (connections reset, new ones refused) for {for_s:g} s")
        await asyncio.sleep(max(0.0, self._t0 + at_s + for_s - time.time()))
        await self._call("link_up")
        self._event("link up")

    def _event(self, text: str) -> None:
        self.events.append({"t_s": round(time.time() - self._t0, 3), "event": text})

    async def clear(self) -> None:
        """Cancel a pending cut, bring the link up and remove every toxic."""
        if self._down_task is not None:
            if not self._down_task.done():
                self._down_task.cancel()
                self._event("link cut cancelled (step ended)")
            with contextlib.suppress(asyncio.CancelledError):
                await self._down_task
            self._down_task = None
        await self._call("link_up")
        await self._call("clear_toxics")
