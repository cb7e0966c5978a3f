"""Traces pdx makes itself, in Mooncake's format, with a reuse known exactly (``pdx trace make``).

Conversations: ``sessions`` of ``turns`` each, every prompt opening with one shared system
prompt of ``system_blocks`` blocks, each turn adding ``turn_blocks`` new blocks to its
session's history (the previous turns stay in the prompt, as a chat client resends them).
Sessions start at Poisson times (``rate`` sessions/s), a session's turns ``think_s`` apart.
Hash ids are chained (a block's id stands for it and everything before it), and every prompt
is whole blocks, so an infinite cache holds, of turn k (from 1) of a session, its system
prompt and its k-1 earlier turns, except for the trace's very first request, which finds
nothing: :func:`known_ideal_hit_ratio` says the ratio without reading the trace.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import orjson

from pdx.errors import InputError


@dataclass(frozen=True)
class Conversations:
    """The shape of a made trace (see the module docstring)."""

    sessions: int = 40
    turns: int = 4
    system_blocks: int = 2
    turn_blocks: int = 2
    block_size: int = 512
    output_tokens: int = 128
    rate: float = 1.0  # sessions started per second
    think_s: float = 10.0
    seed: int = 0

    def check(self) -> None:
        """Each count positive (system_blocks may be 0), each time > 0."""
        for name in ("sessions", "turns", "turn_blocks", "block_size", "output_tokens"):
            if getattr(self, name) < 1:
                raise InputError(
                    f"--{name.replace('_', '-')}", getattr(self, name), "an integer >= 1"
                )
        if self.system_blocks < 0:
            raise InputError("--system-blocks", self.system_blocks, "an integer >= 0")
        for name in ("rate", "think_s"):
            if not getattr(self, name) > 0:
                raise InputError(f"--{name.replace('_', '-')}", getattr(self, name), "a number > 0")


def make_trace(c: Conversations) -> list[dict[str, object]]:
    """The trace's lines (Mooncake fields, plus ``session``), sorted by timestamp."""
    c.check()
    rng = random.Random(c.seed)
    next_id = 0

    def new_id() -> int:
        nonlocal next_id
        next_id += 1
        return next_id

    system = [new_id() for _ in range(c.system_blocks)]
    rows: list[tuple[float, int, dict[str, object]]] = []
    start = 0.0
    for s in range(c.sessions):
        start += rng.expovariate(c.rate)
        history = list(system)
        for k in range(c.turns):
            history += [new_id() for _ in range(c.turn_blocks)]
            t = start + k * c.think_s
            row = {
                "timestamp": round(t * 1000),
                "input_length": len(history) * c.block_size,
                "output_length": c.output_tokens,
                "hash_ids": list(history),
                "session": f"s{s}",
            }
            rows.append((t, len(rows), row))
    rows.sort(key=lambda r: (r[0], r[1]))
    return [r[2] for r in rows]


def known_ideal_hit_ratio(c: Conversations) -> float:
    """Cached prompt tokens / prompt tokens under an infinite cache, from the shape alone."""
    per_session_in = sum(c.system_blocks + k * c.turn_blocks for k in range(1, c.turns + 1))
    per_session_hit = sum(c.system_blocks + (k - 1) * c.turn_blocks for k in range(1, c.turns + 1))
    total_in = c.sessions * per_session_in
    total_hit = c.sessions * per_session_hit - c.system_blocks  # the first request finds nothing
    return total_hit / total_in


def write_trace(rows: list[dict[str, object]], path: Path) -> None:
    """One JSON object per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
