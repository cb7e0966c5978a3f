"""The streaming client's SSE framing, metric formulas and prompt/length sources."""

from __future__ import annotations

import json
import random

import pytest
import requests
from hypothesis import given
from hypothesis import strategies as st

from pdx.accept.load.traffic.llm_stream import (
    LengthSpec,
    PromptSource,
    RequestRecord,
    build_body,
    finish_record,
    load_lengths_file,
    sse_events,
    stream_completion,
)


@given(
    payloads=st.lists(st.text(alphabet="abc {}:\"'01", min_size=1, max_size=20), max_size=8),
    cuts=st.lists(st.integers(min_value=1, max_value=7), max_size=30),
)
def test_sse_events_survive_any_chunking(payloads: list[str], cuts: list[int]) -> None:
    wire = b"".join(f"data: {p}\r\n\r\n".encode() for p in payloads) + b": keepalive\n\n"
    chunks, pos = [], 0
    for cut in cuts:
        chunks.append(wire[pos : pos + cut])
        pos += cut
    chunks.append(wire[pos:])
    assert list(sse_events(chunks)) == payloads


def test_formulas_follow_the_stated_definitions() -> None:
    rec = RequestRecord(t_intended_s=0.0, mode="open", input_len=4, output_len_requested=5)
    rec.output_tokens, rec.usage_source = 5, "server"
    t0 = 10.0
    finish_record(rec, t0, [10.1, 10.12, 10.15, 10.16, 10.2], t_end=10.25)
    assert rec.ttft_ms == pytest.approx(100.0)
    assert rec.e2e_ms == pytest.approx(250.0)
    assert rec.tpot_ms == pytest.approx((250.0 - 100.0) / 4)
    assert rec.itl_ms == pytest.approx([20.0, 30.0, 10.0, 40.0])
    single = RequestRecord(t_intended_s=0.0, mode="closed", input_len=4, output_len_requested=1)
    finish_record(single, 0.0, [0.05], t_end=0.06)
    assert single.output_tokens == 1 and single.usage_source == "chunks"
    assert single.tpot_ms is None  # undefined for one token


def test_length_specs_and_files(tmp_path) -> None:
    assert LengthSpec.parse("128") == LengthSpec(128, 128)
    spec = LengthSpec.parse("4:9")
    rng = random.Random(1)
    assert {spec.sample(rng) for _ in range(400)} == set(range(4, 10))
    for bad in ("0", "9:4", "x", "1:y"):
        with pytest.raises(ValueError, match="expected"):
            LengthSpec.parse(bad)
    f = tmp_path / "lens.txt"
    f.write_text('# comment\n12,3\n{"prompt": [5, 6, 7], "output_len": 2}\n')
    rows = load_lengths_file(f)
    src = PromptSource(LengthSpec(1, 1), LengthSpec(1, 1), rows=rows, seed=3)
    seen = {(s.input_len, s.output_len) for s in (src.next() for _ in range(50))}
    assert seen == {(12, 3), (3, 2)}
    f.write_text("12;3\n")
    with pytest.raises(ValueError, match=r"lens.txt:1"):
        load_lengths_file(f)


def test_stream_against_real_server(sse_server) -> None:
    sample = PromptSource(LengthSpec(7, 7), LengthSpec(6, 6), seed=0).next()
    body = build_body(sample, None, {"ignore_eos": True})
    rec = RequestRecord(t_intended_s=0.0, mode="closed", input_len=7, output_len_requested=6)
    import time

    with requests.Session() as s:
        stream_completion(s, sse_server.url + "/v1/completions", body, rec, time.perf_counter(), 10)
    assert rec.ok, rec.error
    assert rec.output_tokens == 6 and rec.prompt_tokens == 7 and rec.usage_source == "server"
    assert len(rec.itl_ms) == 5
    assert rec.ttft_ms is not None and rec.ttft_ms >= 20.0  # the server waits 20 ms
    assert sse_server.stats.bodies[-1]["ignore_eos"] is True
    assert json.loads(rec.to_json())["pdx"] == {"route": "local", "retries": 0}


def test_http_errors_are_failures_with_cause(sse_server) -> None:
    sse_server.cfg.fail_every = 1
    rec = RequestRecord(t_intended_s=0.0, mode="closed", input_len=1, output_len_requested=1)
    body = build_body(PromptSource(LengthSpec(1, 1), LengthSpec(1, 1)).next(), None, {})
    with requests.Session() as s:
        stream_completion(s, sse_server.url + "/v1/completions", body, rec, 0.0, 10)
    assert not rec.ok and rec.http_status == 500 and "injected failure" in (rec.error or "")
    assert rec.ttft_ms is None
