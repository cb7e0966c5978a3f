"""A trace replayed by the Locust user (``--pdx-mode trace``): what to send and when.

The window's requests (:mod:`pdx.traces.schedule`) are sent at their scaled times from the
step's start, open loop (a late answer never delays the next send), each with a prompt that
shares exactly the blocks its trace line shares (:mod:`pdx.traces.prompts`), its session as
the OpenAI ``user`` key (so a router's stickiness can act), and, in its record, its trace line,
its session and the prefix an ideal cache would hold for it within the replayed window (so the
report can put the trace's ideal hit ratio beside what the engine reported). No gevent here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdx.traces.formats import read_trace
from pdx.traces.prompts import prompt_ids, scaled, words
from pdx.traces.schedule import Window, plan
from pdx.traces.stats import ideal_cached, sessions


@dataclass(frozen=True)
class TraceSend:
    """One request of the replay."""

    send_s: float  # after the replay's start
    prompt: list[int] | str
    input_len: int
    output_len: int
    line: int
    session: str
    ideal_cached_tokens: int


def trace_sends(opts: Any) -> list[TraceSend]:
    """Every request the replay sends, in order, from the Locust ``--pdx-trace*`` options."""
    trace = read_trace(opts.pdx_trace, opts.pdx_trace_format,
                       block_size=opts.pdx_trace_block_size or None)  # fmt: skip
    window = Window(
        start_s=opts.pdx_trace_start_s,
        duration_s=opts.pdx_trace_duration_s or None,
        max_requests=opts.pdx_trace_max_requests or None,
        time_scale=opts.pdx_time_scale,
    )
    planned, _ = plan(trace, window)
    # the ideal prefix within the window: what an engine that started empty could hit
    window_trace = type(trace)([p.request for p in planned], trace.block_size, trace.format,
                               trace.source)  # fmt: skip
    ideal = ideal_cached(window_trace)
    keys = sessions(window_trace)
    ls = opts.pdx_length_scale
    out = []
    for p, hit, key in zip(planned, ideal, keys, strict=True):
        ids = prompt_ids(p.request, trace.block_size, length_scale=ls, salt=opts.pdx_trace_salt,
                         token_id_max=opts.pdx_token_id_max)  # fmt: skip
        n = len(ids)
        out.append(TraceSend(
            send_s=p.send_s,
            prompt=ids if opts.pdx_prompt_kind == "ids" else words(ids),
            input_len=n,
            output_len=scaled(p.request.output_tokens, ls),
            line=p.request.line,
            session=key,
            ideal_cached_tokens=_scaled_hit(p.request, hit, trace.block_size, n, ls),
        ))  # fmt: skip
    return out


def _scaled_hit(req: Any, hit: int, block: int, n: int, ls: float) -> int:
    """An ideal prefix of ``hit`` trace tokens in the scaled prompt's tokens (whole blocks)."""
    if not hit:
        return 0
    blocks = len(req.hash_ids) if hit == req.input_tokens else hit // block
    return min(n, blocks * scaled(block, ls))


def add_options(parser: Any) -> None:
    """The ``--pdx-trace*`` options of the Locust user."""
    parser.add_argument("--pdx-trace", default="", help="trace mode: the trace file")
    parser.add_argument("--pdx-trace-format", default="auto")
    parser.add_argument("--pdx-trace-block-size", type=int, default=0)
    parser.add_argument("--pdx-length-scale", type=float, default=1.0)
    parser.add_argument("--pdx-time-scale", type=float, default=1.0)
    parser.add_argument("--pdx-trace-start-s", type=float, default=0.0)
    parser.add_argument("--pdx-trace-duration-s", type=float, default=0.0)
    parser.add_argument("--pdx-trace-max-requests", type=int, default=0)
    parser.add_argument("--pdx-trace-salt", type=int, default=0)
