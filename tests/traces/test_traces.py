"""pdx.traces: reading every format (and its errors), prompts that share what the trace shares,
the ideal and LRU hit ratios, sessions, windows, and made traces of known reuse."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdx.errors import ConfigError, InputError
from pdx.traces.formats import read_trace
from pdx.traces.prompts import prompt_ids, words
from pdx.traces.schedule import Window, plan
from pdx.traces.stats import ideal_cached, lru_cached, sessions, trace_stats
from pdx.traces.synth import Conversations, known_ideal_hit_ratio, make_trace, write_trace


def mooncake(tmp_path: Path, rows: list[dict], name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [  # two sessions; the second request extends the first, the third shares its first block
    {"timestamp": 1000, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]},
    {"timestamp": 3000, "input_length": 1600, "output_length": 20, "hash_ids": [1, 2, 3, 4]},
    {"timestamp": 2000, "input_length": 700, "output_length": 5, "hash_ids": [1, 9]},
]


def test_mooncake_is_read_sorted_with_its_blocks(tmp_path: Path) -> None:
    trace = read_trace(mooncake(tmp_path, ROWS))
    assert trace.format == "mooncake" and trace.block_size == 512 and trace.has_reuse
    assert [r.line for r in trace.requests] == [1, 3, 2]
    assert [r.arrival_s for r in trace.requests] == [1.0, 2.0, 3.0]
    assert trace.requests[2].hash_ids == (1, 2, 3, 4)
    # ideal: nothing; block 1 (512 of 700); blocks 1-2 of 4 (1024 of 1600)
    assert ideal_cached(trace) == [0, 512, 1024]
    assert sessions(trace) == ["line-1", "line-3", "line-1"]  # line 2 extends line 1
    assert trace_stats(trace).ideal_hit_ratio == round(1536 / 3324, 6)


def test_every_bad_line_names_its_number_and_field(tmp_path: Path) -> None:
    path = mooncake(tmp_path, [ROWS[0]])
    path.write_text(path.read_text() + "{oops\n" + json.dumps({"timestamp": -1, "output_length": 1})
                    + "\n" + json.dumps({**ROWS[0], "hash_ids": [1]}) + "\n")  # fmt: skip
    with pytest.raises(ConfigError) as err:
        read_trace(path, "mooncake")
    problems = err.value.problems
    assert problems[0].startswith("line 2: not JSON")
    assert problems[1] == "line 3: timestamp: got -1, expected a number >= 0"
    assert problems[2] == "line 3: input_length: Field required"
    with pytest.raises(ConfigError) as err:
        read_trace(mooncake(tmp_path, [{**ROWS[0], "hash_ids": [1]}], "b.jsonl"))
    assert err.value.problems == [
        "line 1: hash_ids: got 1 ids for input of 1024 tokens, expected 2 (blocks of 512 "
        "tokens; set block_size if the trace uses others)"
    ]
    with pytest.raises(InputError, match="existing JSONL trace"):
        read_trace(tmp_path / "none.jsonl")


def test_burstgpt_and_pdx_formats(tmp_path: Path) -> None:
    csv = tmp_path / "b.csv"
    csv.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                   "5,ChatGPT,100,20,120,Conversation log\n"
                   "1,GPT-4,300,0,300,Conversation log\n"  # a failed request: no response
                   "2,GPT-4,50,x,50,API log\n")  # fmt: skip
    with pytest.raises(ConfigError) as err:
        read_trace(csv)
    assert err.value.problems == ["line 4: Response tokens: got 'x', expected an integer"]
    csv.write_text(csv.read_text().replace(",x,", ",7,"))
    trace = read_trace(csv)
    assert trace.format == "burstgpt" and not trace.has_reuse
    assert [(r.arrival_s, r.input_tokens, r.output_tokens) for r in trace.requests] == [
        (2.0, 50, 7), (5.0, 100, 20)
    ]  # fmt: skip
    pdx = tmp_path / "p.jsonl"
    row = {"arrival_s": 0.5, "prompt_tokens": 40, "output_tokens": 3, "session": "a",
           "hash_ids": [7, 8], "block_size": 32}  # fmt: skip
    pdx.write_text(json.dumps(row) + "\n")
    p = read_trace(pdx)
    assert p.format == "pdx" and p.block_size == 32 and p.requests[0].session == "a"


def test_a_100k_line_trace_loads_well_under_a_second_per_10k_lines(tmp_path: Path) -> None:
    rows = [{"timestamp": i, "input_length": 1000 + i % 3000, "output_length": 100,
             "hash_ids": list(range(i, i + (1000 + i % 3000 + 511) // 512))}
            for i in range(100_000)]  # fmt: skip
    path = mooncake(tmp_path, rows)
    t0 = time.perf_counter()
    trace = read_trace(path)
    took = time.perf_counter() - t0
    assert len(trace.requests) == 100_000
    assert took < 10.0, f"{took:.1f} s for 100k lines"  # the bound: 1 s per 10k lines


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 50), min_size=1, max_size=8),
    st.lists(st.integers(0, 50), min_size=1, max_size=8),
    st.sampled_from([1.0, 0.5, 0.03125]),
)
def test_prompts_share_exactly_the_blocks_their_ids_share(
    a: list[int], b: list[int], scale: float
) -> None:
    from pdx.traces.formats import TraceRequest

    ra = TraceRequest(1, 0.0, 512 * len(a), 1, tuple(a))
    rb = TraceRequest(2, 0.0, 512 * len(b), 1, tuple(b))
    pa, pb = prompt_ids(ra, 512, length_scale=scale), prompt_ids(rb, 512, length_scale=scale)
    block = max(1, round(512 * scale))
    shared = 0
    while shared < min(len(a), len(b)) and a[shared] == b[shared]:
        shared += 1
    common = 0
    while common < min(len(pa), len(pb)) and pa[common] == pb[common]:
        common += 1
    assert pa[: shared * block] == pb[: shared * block]  # every shared block is the same tokens
    if shared < min(len(a), len(b)):  # the first block they do not share differs (almost surely)
        assert common < (shared + 1) * block
    assert len(pa) == max(1, round(512 * len(a) * scale))
    assert words(pa[:block]) == words(pb[:block]) or not shared


def test_lru_holds_less_than_the_ideal_and_windows_scale_time(tmp_path: Path) -> None:
    shape = Conversations(sessions=20, turns=3, system_blocks=1, turn_blocks=2, rate=2.0)
    path = tmp_path / "c.jsonl"
    write_trace(make_trace(shape), path)
    trace = read_trace(path)
    assert trace_stats(trace).ideal_hit_ratio == round(known_ideal_hit_ratio(shape), 6)
    small = lru_cached(trace, 4)
    assert sum(small) < sum(ideal_cached(trace)) and sum(lru_cached(trace, 10**6)) == sum(
        ideal_cached(trace)
    )
    planned, scale = plan(trace, Window(time_scale=0.1))
    assert scale == 0.1 and planned[0].send_s == 0.0
    assert planned[-1].send_s == pytest.approx(0.1 * trace.duration_s)
    at_rate, scale = plan(trace, Window(rate_rps=30.0))
    assert (len(at_rate) - 1) / at_rate[-1].send_s == pytest.approx(30.0)
    first = plan(trace, Window(start_s=5.0, duration_s=10.0, max_requests=7))[0]
    assert len(first) == 7 and all(5 <= p.request.arrival_s - trace.requests[0].arrival_s < 15
                                   for p in first)  # fmt: skip
    with pytest.raises(InputError, match="a window holding requests"):
        plan(trace, Window(start_s=10_000.0))


@pytest.mark.parametrize("shape", [
    Conversations(), Conversations(sessions=7, turns=1, system_blocks=0, turn_blocks=3),
    Conversations(sessions=3, turns=9, system_blocks=5, turn_blocks=1, block_size=16),
])  # fmt: skip
def test_a_made_trace_says_its_ideal_ratio_exactly(tmp_path: Path, shape: Conversations) -> None:
    path = tmp_path / "m.jsonl"
    write_trace(make_trace(shape), path)
    stats = trace_stats(read_trace(path, block_size=shape.block_size))
    assert stats.ideal_hit_ratio == round(known_ideal_hit_ratio(shape), 6)
    assert stats.sessions == shape.sessions and stats.turns["max"] == shape.turns
