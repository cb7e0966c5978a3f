"""The stranded-KV gate for vLLM engines: prefill's KV usage after the step's requests ended,
read from a real metrics endpoint whose gauge falls as a prefill's lease would free blocks."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from pdx.accept.judge import criteria as judge
from pdx.accept.judge.engine_kv import held_facts, last_request_end, watch_prefill_kv
from pdx.accept.playbook import Criteria


def _exposition(prefill: float, decode: float = 0.5) -> str:
    return (
        "# HELP vllm:kv_cache_usage_perc KV-cache usage.\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{engine="0",pdx_instance="prefill-0"}} {prefill}\n'
        f'vllm:kv_cache_usage_perc{{engine="0",pdx_instance="decode-0"}} {decode}\n'
    )


async def _metrics_server(
    free_at: float | None, text: str | None = None
) -> tuple[web.AppRunner, str]:
    """/metrics: prefill holds 3 % of its cache until ``free_at`` (wall time), then 0 (or
    always ``text``)."""

    async def metrics(_: web.Request) -> web.Response:
        held = free_at is None or time.time() < free_at
        return web.Response(text=text or _exposition(0.03 if held else 0.0))

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}/metrics"


def _rows(end_s: float) -> list[dict[str, Any]]:
    return [
        {"t_intended_s": end_s - 2.0, "elapsed_ms": 500.0, "pdx": {"route": "disaggregated"}},
        {"t_intended_s": end_s - 1.0, "elapsed_ms": 1000.0, "pdx": {"route": "disaggregated"}},
    ]


def test_last_request_end_is_the_latest_end() -> None:
    assert last_request_end(_rows(100.0)) == 100.0
    assert last_request_end([]) is None


async def test_kv_freed_after_the_requests_is_measured_and_judged() -> None:
    end = time.time()
    runner, url = await _metrics_server(free_at=end + 1.5)
    try:
        facts = await watch_prefill_kv(url, _rows(end), bound_s=5.0, shipped=2, poll_s=0.1)
    finally:
        await runner.cleanup()
    assert isinstance(facts, dict), facts
    assert 1.5 <= facts["kv_stranded_max_s"] < 3.0 and not facts["kv_stranded_still_held"]
    assert facts["kv_stranded_worst"]["instance"] == "prefill-0"
    step = _step()
    crit = Criteria.model_validate({"kv_stranded_max_s": "auto"})
    (ok,) = [
        c
        for c in judge.judge_step(step, facts, crit, confidence=0.95)
        if c.name == "kv_stranded_max_s"
    ]
    assert ok.result == "pass" and "back to 0 within" in ok.note
    tight = Criteria.model_validate({"kv_stranded_max_s": 1.0})
    (bad,) = [
        c
        for c in judge.judge_step(step, facts, tight, confidence=0.95)
        if c.name == "kv_stranded_max_s"
    ]
    assert bad.result == "fail"


async def test_kv_never_freed_stops_at_the_bound_and_fails() -> None:
    end = time.time()
    runner, url = await _metrics_server(free_at=None)
    try:
        facts = await watch_prefill_kv(url, _rows(end), bound_s=1.0, shipped=2, poll_s=0.1)
    finally:
        await runner.cleanup()
    assert isinstance(facts, dict)
    assert facts["kv_stranded_still_held"] == 1 and facts["kv_stranded_max_s"] > 1.0
    crit = Criteria.model_validate({"kv_stranded_max_s": "auto"})
    (c,) = [
        c
        for c in judge.judge_step(_step(), facts, crit, confidence=0.95)
        if c.name == "kv_stranded_max_s"
    ]
    assert c.result == "fail" and "still above 0" in c.note


async def test_no_prefill_series_is_not_measured_with_the_reason() -> None:
    no_engine = "# TYPE pdx_requests_total counter\npdx_requests_total 1\n"
    runner, url = await _metrics_server(None, no_engine)
    try:
        why = await watch_prefill_kv(url, _rows(time.time()), bound_s=0.3, shipped=2, poll_s=0.1)
    finally:
        await runner.cleanup()
    assert isinstance(why, str) and "vllm:kv_cache_usage_perc" in why
    assert await watch_prefill_kv(url, _rows(time.time()), 1.0, shipped=0) == (
        "no request shipped KV from prefill in this step"
    )


def test_held_facts_take_the_first_sample_with_every_prefill_free() -> None:
    samples = [(10.5, {"prefill-0": 0.02, "prefill-1": 0.0}), (11.0, {"prefill-0": 0.0,
               "prefill-1": 0.0})]  # fmt: skip
    f = held_facts(samples, end_s=10.0, bound_s=30.0, shipped=5)
    assert f["kv_stranded_max_s"] == 1.0 and f["kv_objects"] == 5
    assert f["kv_stranded_worst"]["kv_usage_after_drain"] == 0.02
    clean = held_facts([(10.2, {"prefill-0": 0.0})], end_s=10.0, bound_s=30.0, shipped=5)
    assert clean["kv_stranded_max_s"] == 0.2 and clean["kv_stranded_worst"] is None


def _step() -> Any:
    from pdx.accept.steps import Step

    return Step(0, 48, 8, 1, None, "normal", 10.0)
