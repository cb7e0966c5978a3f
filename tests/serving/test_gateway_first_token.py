"""The first token leaves the gateway before prefill has stored the KV; a failed store degrades.

Prefill, decode and gateway run in this process (real gRPC and HTTP on loopback, real model,
real KV store). Prefill's store Put is held behind a gate the test opens, or the store is
stopped so the Put fails after the first token went out.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from inprocess_pair import inprocess_pair

from pdx.serving.backends.kvwire import EncodedKV
from pdx.serving.gateway import MARKS, Gateway
from pdx.serving.prefill import PrefillNode, StoreSink

# the whole-object path: the KV stored once prefill has computed (kv.streaming off)
SETS = ["router.local_prefill_max_tokens=8", "kv.kv_transfer_timeout_ms=1500",
        "kv.kv_retry_budget=1", "kv.streaming=false"]  # fmt: skip
PROMPT = "a prompt long enough to ship over the link"


class GatedSink:
    """Prefill's real store sink; its Put waits until the test opens the gate."""

    def __init__(self, inner: StoreSink) -> None:
        self.inner, self.endpoint = inner, inner.endpoint
        self.gate = asyncio.Event()

    async def put(self, encoded: EncodedKV, model_version: str, ttl_s: int) -> tuple[str, int]:
        await self.gate.wait()
        return await self.inner.put(encoded, model_version, ttl_s)


@pytest.fixture
async def trio() -> AsyncIterator[tuple[Gateway, PrefillNode]]:
    async with inprocess_pair(SETS) as (gw, prefill, _decode):
        yield gw, prefill


def body(route: str, stream: bool) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": 6, "return_token_ids": True, "stream": stream,
            "pdx_route": route}  # fmt: skip


async def ask(gw: Gateway, route: str) -> dict[str, Any]:
    url = f"http://127.0.0.1:{gw.port}/v1/completions"
    async with aiohttp.ClientSession() as s, s.post(url, json=body(route, False)) as r:
        assert r.status == 200
        data: dict[str, Any] = await r.json()
        return data


async def test_first_token_streams_before_the_put_completes(
    trio: tuple[Gateway, PrefillNode],
) -> None:
    gw, prefill = trio
    assert prefill.servicer is not None and isinstance(prefill.servicer.sink, StoreSink)
    sink = prefill.servicer.sink = GatedSink(prefill.servicer.sink)
    url = f"http://127.0.0.1:{gw.port}/v1/completions"
    events: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as s, s.post(url, json=body("disaggregated", True)) as r:
        lines = aiter(r.content)
        while not events:
            line = (await asyncio.wait_for(anext(lines), timeout=30)).decode().strip()
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
        assert not sink.gate.is_set()  # the first token arrived while the KV was not stored
        sink.gate.set()
        async for raw in lines:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    tokens = [t for e in events for t in e["choices"][0].get("token_ids", [])]
    pdx = events[-1]["pdx"]
    assert pdx["route"] == "disaggregated" and not pdx["degraded"] and pdx["kv_id"]
    assert tokens == (await ask(gw, "local"))["choices"][0]["token_ids"]
    timings = pdx["timings_ms"]
    assert all(timings[k] is not None and timings[k] > 0 for k in MARKS)
    assert timings["prefill_stored_event"] > timings["prefill_first_event"]


async def test_failed_put_after_the_first_token_degrades_to_local() -> None:
    # The object does not fit prefill's store: the Put fails once the first token is out.
    async with inprocess_pair([*SETS, "kv.store_budget_bytes=4096"]) as (gw, _, _):
        got = await ask(gw, "disaggregated")
        pdx = got["pdx"]
        assert pdx["route"] == "local" and pdx["degraded"]
        assert pdx["degrade_reason"] == "kv_store_failed"
        assert pdx["timings_ms"]["prefill_first_event"] is not None
        local = await ask(gw, "local")
        assert got["choices"][0]["token_ids"] == local["choices"][0]["token_ids"]
        metrics = f"http://127.0.0.1:{gw.port}/metrics"
        async with aiohttp.ClientSession() as s, s.get(metrics) as r:
            text = await r.text()
    assert 'pdx_gateway_degradations_total{reason="kv_store_failed"} 1.0' in text
