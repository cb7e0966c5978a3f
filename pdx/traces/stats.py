"""What a trace holds: its load, its lengths, its sessions, and how much of it a prefix cache
could serve (``pdx trace stats``).

The *ideal* cached prefix of a request is the leading run of its hash ids that some earlier
request already had (an infinite cache that keeps every block): Mooncake's hash ids are chained
(a block's id depends on every block before it), so a seen id means its whole prefix was seen.
With ``cache_blocks`` the same is computed for one instance whose cache holds that many blocks,
least recently used evicted (blocks of the request being served are its newest). A prefix
counts in tokens: whole blocks, and the request's own length for its last, partial block.

Sessions: the trace's own ``session`` field, else a request whose hash ids start with all of an
earlier request's ids continues that request's session (a later turn of one conversation).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from pdx.traces.formats import Trace, TraceRequest

DEFAULT_THRESHOLDS = (1024, 4096, 16384)


def cached_prefix(req: TraceRequest, block_size: int, cached: Any) -> int:
    """Tokens of ``req``'s prompt whose blocks ``cached`` holds, from the first block on."""
    blocks = 0
    for h in req.hash_ids:
        if h not in cached:
            break
        blocks += 1
    return min(req.input_tokens, blocks * block_size)


def ideal_cached(trace: Trace) -> list[int]:
    """Per request, the prefix an infinite cache would hold (see the module docstring)."""
    seen: set[int] = set()
    out = []
    for r in trace.requests:
        out.append(cached_prefix(r, trace.block_size, seen))
        seen.update(r.hash_ids)
    return out


def lru_cached(trace: Trace, cache_blocks: int) -> list[int]:
    """Per request, the prefix one instance's LRU cache of ``cache_blocks`` blocks holds."""
    cache: OrderedDict[int, None] = OrderedDict()
    out = []
    for r in trace.requests:
        out.append(cached_prefix(r, trace.block_size, cache))
        for h in r.hash_ids:  # served: its blocks are the newest, evicting the oldest
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > cache_blocks:
            cache.popitem(last=False)
    return out


def sessions(trace: Trace) -> list[str]:
    """Per request, its session key (the trace's own, or the chain of requests it extends).

    Hash ids are chained, so an earlier prompt is a prefix of this one exactly when its last
    id sits at the same place in this one: one look-up per block.
    """
    ends: dict[tuple[int, int], str] = {}  # (blocks, last id) of each earlier prompt
    out = []
    for r in trace.requests:
        key = r.session
        if key is None:
            for k in range(len(r.hash_ids) - 1, 0, -1):  # the longest earlier prompt it extends
                key = ends.get((k, r.hash_ids[k - 1]))
                if key is not None:
                    break
        key = key or f"line-{r.line}"
        if r.hash_ids:
            ends.setdefault((len(r.hash_ids), r.hash_ids[-1]), key)
        out.append(key)
    return out


@dataclass
class TraceStats:
    """``pdx trace stats``'s answer (its ``--json``)."""

    source: str
    format: str
    requests: int
    duration_s: float
    rate_rps: float | None
    block_size: int
    input_tokens: dict[str, float]
    output_tokens: dict[str, float]
    has_reuse: bool
    ideal_hit_ratio: float | None
    cache_blocks: int | None
    cache_hit_ratio: float | None
    sessions: int
    turns: dict[str, float]
    uncached_over: dict[str, dict[str, float]]
    notes: list[str]

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        return asdict(self)


def _percentiles(values: list[int]) -> dict[str, float]:
    a = np.asarray(values, dtype=float)
    return {"mean": round(float(a.mean()), 1), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)),
            "max": float(a.max())}  # fmt: skip


def trace_stats(
    trace: Trace,
    *,
    cache_blocks: int | None = None,
    thresholds: tuple[int, ...] = DEFAULT_THRESHOLDS,
) -> TraceStats:
    """Everything :class:`TraceStats` holds, for ``trace``."""
    reqs = trace.requests
    total_in = sum(r.input_tokens for r in reqs)
    ideal = ideal_cached(trace) if trace.has_reuse else [0] * len(reqs)
    lru = lru_cached(trace, cache_blocks) if cache_blocks and trace.has_reuse else None
    keys = sessions(trace)
    turns: dict[str, int] = {}
    for k in keys:
        turns[k] = turns.get(k, 0) + 1
    per_session = list(turns.values())
    over: dict[str, dict[str, float]] = {}
    for t in thresholds:
        # the router's rule: offloaded when the length (or the uncached length) is >= t
        by_length = sum(r.input_tokens >= t for r in reqs)
        by_uncached = sum(r.input_tokens - c >= t for r, c in zip(reqs, ideal, strict=True))
        uncached_bytes = sum(
            r.input_tokens - c for r, c in zip(reqs, ideal, strict=True) if r.input_tokens - c >= t
        )
        length_bytes = sum(r.input_tokens for r in reqs if r.input_tokens >= t)
        over[str(t)] = {
            "length_share": round(by_length / len(reqs), 4),
            "uncached_share": round(by_uncached / len(reqs), 4),
            # tokens whose KV would cross the link: whole prompts (a length rule) or only the
            # uncached suffix (an uncached-length rule), as a share of all prompt tokens
            "length_tokens_share": round(length_bytes / total_in, 4),
            "uncached_tokens_share": round(uncached_bytes / total_in, 4),
        }
    notes = list(trace.notes)
    if not trace.has_reuse:
        notes.append("the trace has no hash ids: no reuse is known, every prompt is its own")
    return TraceStats(
        source=trace.source,
        format=trace.format,
        requests=len(reqs),
        duration_s=round(trace.duration_s, 3),
        rate_rps=round(len(reqs) / trace.duration_s, 4) if trace.duration_s > 0 else None,
        block_size=trace.block_size,
        input_tokens=_percentiles([r.input_tokens for r in reqs]),
        output_tokens=_percentiles([r.output_tokens for r in reqs]),
        has_reuse=trace.has_reuse,
        ideal_hit_ratio=round(sum(ideal) / total_in, 6) if trace.has_reuse else None,
        cache_blocks=cache_blocks,
        cache_hit_ratio=round(sum(lru) / total_in, 6) if lru is not None else None,
        sessions=len(turns),
        turns=_percentiles(per_session),
        uncached_over=over,
        notes=notes,
    )
