"""KV a vLLM prefill still holds after its requests ended (the stranded-KV gate for engines).

With ``engine: pdx`` the KV store's audit log says when each object was deleted. A vLLM
prefill keeps a request's KV in its own blocks until decode has pulled them and told it so
(NIXL's notification), or until its lease runs out (``kv_lease_duration``, vLLM's 30 s by
default: ``vllm.kv_lease_s``) — the blocks a failed or abandoned pull leaves behind (vllm
21570 is the same failure with a 120 s, then 480 s, abort timeout). vLLM keeps no per-request
record of it; its ``vllm:kv_cache_usage_perc`` gauge says how much of the cache is in use,
and with no request left, anything above 0 is KV held for requests that are over.

So once a step's load has drained, :func:`watch_prefill_kv` reads each prefill instance's
usage (the gateway re-exposes it with ``pdx_instance``) every ``poll_s`` until every one is
back to 0 or the bound has passed: the seconds from the step's last request end to that moment
are the step's ``kv_stranded_max_s``. It sees the KV held at the step's end (a cut or a kill
late in the step, a lease that never ends), not blocks freed earlier within the step.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pdx.accept.load.metrics import Snapshot, scrape, split_key

USAGE = "vllm:kv_cache_usage_perc"
POLL_S = 0.5
UNREADABLE_AFTER = 4  # scrapes with no prefill series: not measured (prefill down, restarting)


def prefill_usage(snap: Snapshot) -> dict[str, float]:
    """Each prefill instance's KV usage (0..1) in one scrape of the gateway."""
    out: dict[str, float] = {}
    for key, value in snap.samples.items():
        name, labels = split_key(key)
        instance = labels.get("pdx_instance", "")
        if name == USAGE and instance.startswith("prefill"):
            out[instance] = out.get(instance, 0.0) + value
    return out


def last_request_end(rows: list[dict[str, Any]]) -> float | None:
    """When the step's last request ended, on the client's clock (None: no request)."""
    ends = [
        float(r["t_intended_s"]) + float(r.get("elapsed_ms") or 0.0) / 1e3
        for r in rows
        if r.get("t_intended_s") is not None
    ]
    return max(ends, default=None)


def held_facts(
    samples: list[tuple[float, dict[str, float]]], end_s: float, bound_s: float, shipped: int
) -> dict[str, Any]:
    """The gate's facts from the usage samples taken after ``end_s`` (time, usage by instance).

    ``kv_stranded_max_s``: seconds from ``end_s`` to the first sample with every prefill at 0
    (an upper bound: it was freed between that sample and the one before); past the last
    sample when none was, and then ``kv_stranded_still_held`` is 1.
    """
    free_at = next((t for t, u in samples if u and not any(v > 0 for v in u.values())), None)
    last_t, last_u = samples[-1]
    held_s = max(0.0, (free_at if free_at is not None else last_t) - end_s)
    still = free_at is None
    first_u = samples[0][1]
    worst = max(first_u, key=lambda k: first_u[k]) if first_u else None
    return {
        "kv_stranded_source": "prefill_kv_usage",
        "kv_objects": shipped,
        "kv_stranded_max_s": round(held_s, 3),
        "_kv_stranded_holds_s": [held_s],
        "kv_stranded_byte_s": None,
        "kv_stranded_over_bound": int(held_s > bound_s),
        "kv_stranded_still_held": int(still),
        "kv_stranded_bound_s": bound_s,
        "kv_stranded_worst": (
            {
                "instance": worst,
                "kv_usage_after_drain": round(first_u[worst], 6),
                "kv_usage_last": round(last_u.get(worst, 0.0), 6),
                "held_after_end_s": round(held_s, 3),
                "deleted_by": "still held" if still else "released",
            }
            if worst is not None and held_s > 0 and first_u[worst] > 0
            else None
        ),
    }


async def watch_prefill_kv(
    metrics_url: str,
    rows: list[dict[str, Any]],
    bound_s: float,
    shipped: int,
    *,
    poll_s: float = POLL_S,
) -> dict[str, Any] | str:
    """Poll prefill's KV usage until every instance is at 0 or ``bound_s`` + 1 s after the
    step's last request ended; the facts, or why nothing could be measured."""
    end_s = last_request_end(rows)
    if end_s is None:
        return "no request in this step"
    if not shipped:
        return "no request shipped KV from prefill in this step"
    stop = end_s + bound_s + 1.0
    samples: list[tuple[float, dict[str, float]]] = []
    errors: list[str] = []
    while True:
        snap = await scrape(metrics_url)
        usage = prefill_usage(snap) if snap.error is None else {}
        if snap.error is not None:
            errors.append(snap.error)
        samples.append((snap.t_s, usage))
        done = bool(usage) and not any(v > 0 for v in usage.values())
        unreadable = len(samples) >= UNREADABLE_AFTER and not any(u for _, u in samples)
        if done or unreadable or time.time() >= stop:
            break
        await asyncio.sleep(poll_s)
    if not any(u for _, u in samples):
        why = f" ({errors[-1]})" if errors else ""
        return (
            f"no prefill instance's {USAGE} at {metrics_url}{why}: prefill down or restarting, "
            "or a gateway that does not re-expose its engines' series"
        )
    return held_facts([s for s in samples if s[1]], end_s, bound_s, shipped)
