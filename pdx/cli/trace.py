"""``pdx trace stats`` and ``pdx trace make``: what a request trace holds, and traces of known
reuse: thin commands over :mod:`pdx.traces`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from pdx.cli.output import emit
from pdx.errors import InputError

trace_app = typer.Typer(
    help="Request traces (Mooncake JSONL, BurstGPT CSV, pdx JSONL): their load and reuse.",
    no_args_is_help=True,
)

FORMAT_HELP = "mooncake, burstgpt, pdx, or auto (from the extension and the first line)"


def register(app: typer.Typer) -> None:
    """Attach ``pdx trace``."""
    trace_app.command("stats")(stats_cmd)
    trace_app.command("make")(make_cmd)
    app.add_typer(trace_app, name="trace")


def stats_cmd(
    path: Path = typer.Argument(..., help="The trace file."),
    fmt: str = typer.Option("auto", "--format", help=FORMAT_HELP),
    block_size: int | None = typer.Option(
        None, "--block-size", help="Tokens per hash id (default: 512, Mooncake's)."
    ),
    cache_blocks: int | None = typer.Option(
        None,
        "--cache-blocks",
        help="Also the hit ratio of one instance whose prefix cache holds this many blocks (LRU).",
    ),
    threshold: list[int] = typer.Option(
        [],
        "--threshold",
        help="Prompt lengths (tokens) to count requests over, by length and by uncached "
        "length (repeatable; default 1024, 4096, 16384).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the stats as JSON."),
) -> None:
    """Requests, duration, rate, length percentiles, sessions and turns, the prefix a cache
    could serve (ideal, and at a cache size), and who would be offloaded by length or by
    uncached length."""
    from pdx.traces.formats import read_trace
    from pdx.traces.stats import DEFAULT_THRESHOLDS, trace_stats

    if cache_blocks is not None and cache_blocks < 1:
        raise InputError("--cache-blocks", cache_blocks, "an integer >= 1")
    if any(t < 1 for t in threshold):
        raise InputError("--threshold", threshold, "token counts >= 1")
    trace = read_trace(path, fmt, block_size=block_size)
    stats = trace_stats(trace, cache_blocks=cache_blocks,
                        thresholds=tuple(threshold) or DEFAULT_THRESHOLDS)  # fmt: skip
    emit(stats.to_dict(), as_json=as_json, render=_render_stats)


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.2f} %"


def _render_stats(con: Any, s: dict[str, Any]) -> None:
    from rich.table import Table

    rate = f"{s['rate_rps']:.3f} req/s" if s["rate_rps"] else "—"
    con.print(f"{s['source']} ({s['format']}): {s['requests']:,} requests over "
              f"{s['duration_s']:,.1f} s, {rate}; blocks of {s['block_size']} tokens",
              markup=False)  # fmt: skip
    lengths = Table("tokens", "mean", "p50", "p90", "p99", "max")
    for name in ("input_tokens", "output_tokens"):
        v = s[name]
        lengths.add_row(
            name.split("_")[0], *(f"{v[k]:,.0f}" for k in ("mean", "p50", "p90", "p99", "max"))
        )
    con.print(lengths)
    con.print(f"sessions {s['sessions']:,}; turns per session p50 {s['turns']['p50']:g}, "
              f"max {s['turns']['max']:g}", markup=False)  # fmt: skip
    con.print(f"prefix hit ratio: ideal (infinite cache) {_pct(s['ideal_hit_ratio'])}"
              + (f"; one instance with {s['cache_blocks']:,} blocks (LRU) "
                 f"{_pct(s['cache_hit_ratio'])}" if s["cache_blocks"] else ""),
              markup=False)  # fmt: skip
    over = Table("threshold (tokens)", "requests at or over it: length", "uncached length",
                 "prompt tokens shipped: length rule", "uncached rule",
                 title="offloaded by a threshold rule (ideal cache)")  # fmt: skip
    for t, v in s["uncached_over"].items():
        over.add_row(f"{int(t):,}", _pct(v["length_share"]), _pct(v["uncached_share"]),
                     _pct(v["length_tokens_share"]), _pct(v["uncached_tokens_share"]))  # fmt: skip
    con.print(over)
    for note in s["notes"]:
        con.print(f"note: {note}", markup=False)


def make_cmd(
    out: Path = typer.Argument(..., help="Where to write the trace (Mooncake JSONL)."),
    sessions: int = typer.Option(40, "--sessions", help="Conversations."),
    turns: int = typer.Option(4, "--turns", help="Turns per conversation."),
    system_blocks: int = typer.Option(
        2, "--system-blocks", help="Blocks of the shared system prompt."
    ),
    turn_blocks: int = typer.Option(2, "--turn-blocks", help="New blocks each turn adds."),
    block_size: int = typer.Option(512, "--block-size", help="Tokens per block."),
    output_tokens: int = typer.Option(128, "--output-tokens", help="Output tokens per request."),
    rate: float = typer.Option(1.0, "--rate", help="Conversations started per second (Poisson)."),
    think_s: float = typer.Option(
        10.0, "--think-s", help="Seconds between a conversation's turns."
    ),
    seed: int = typer.Option(0, "--seed", help="Random seed of the start times."),
    as_json: bool = typer.Option(False, "--json", help="Print what was written as JSON."),
) -> None:
    """Write a Mooncake-format trace of chat sessions whose prefix reuse is known exactly."""
    from pdx.traces.synth import Conversations, known_ideal_hit_ratio, make_trace, write_trace

    shape = Conversations(sessions, turns, system_blocks, turn_blocks, block_size,
                          output_tokens, rate, think_s, seed)  # fmt: skip
    rows = make_trace(shape)
    write_trace(rows, out)
    data = {"path": str(out), "requests": len(rows),
            "known_ideal_hit_ratio": round(known_ideal_hit_ratio(shape), 6)}  # fmt: skip

    def render(con: Any, d: dict[str, Any]) -> None:
        ratio = _pct(d["known_ideal_hit_ratio"])
        con.print(f"wrote {d['path']}: {d['requests']} requests; ideal prefix hit ratio "
                  f"{ratio} (known from its shape)", markup=False)  # fmt: skip

    emit(data, as_json=as_json, render=render)
