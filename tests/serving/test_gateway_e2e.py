"""End to end through real processes: gateway → prefill → KV transfer (via a fault proxy) → decode.

One deployment (two child processes, mutual TLS, ephemeral ports) serves every test here.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from pdx.serving.deploy_config import load_deploy_config
from pdx.serving.supervisor import Deployment
from tests.serving.inprocess_pair import greedy_reference

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

OVERRIDES = [
    "gateway.port=0",
    "kv.via_proxy=true",
    "kv.kv_transfer_timeout_ms=10000",
    "decode.max_batch=2",
    "decode.max_queue=2",
    "router.local_prefill_max_tokens=32",
    "router.breaker_min_samples=1000",
]
PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def deployment() -> AsyncIterator[Deployment]:
    dep = Deployment(load_deploy_config(dotted=OVERRIDES))
    await dep.start()
    try:
        await complete(dep, **body("disaggregated", 2))  # warm: first TLS handshakes
        yield dep
    finally:
        await dep.stop()


@pytest.fixture(scope="module")
def reference() -> Any:
    """The same model built in this process: what plain local greedy decoding produces."""
    return greedy_reference()


async def complete(dep: Deployment, **body: Any) -> tuple[int, dict[str, Any], Any]:
    url = dep.endpoints().gateway + "/v1/completions"
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, await r.json(), r.headers


async def metric(dep: Deployment, name: str, **labels: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(dep.endpoints().gateway + "/metrics") as r:
        text = await r.text()
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = rf"^{name}(\{{{re.escape(want)}\}})? ([0-9.e+-]+)$" if want else rf"^{name} (\S+)$"
    for line in text.splitlines():
        m = re.match(pattern, line)
        if m:
            return float(m.groups()[-1])
    return 0.0


def body(route: str, n: int = 24, **extra: Any) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": n, "pdx_route": route, "return_token_ids": True,
            "ignore_eos": True, **extra}  # fmt: skip


@pytest.mark.parametrize("codec", ["raw", "zstd", "lz4-planes"])
async def test_disaggregated_greedy_equals_local(
    deployment: Deployment, reference: Any, codec: str
) -> None:
    s1, local, _ = await complete(deployment, **body("local"))
    s2, dis, _ = await complete(deployment, **body("disaggregated", pdx_kv_codec=codec))
    assert (s1, s2) == (200, 200)
    assert dis["pdx"]["route"] == "disaggregated" and not dis["pdx"]["degraded"], dis["pdx"]
    assert dis["pdx"]["kv_bytes"] > 0 and dis["pdx"]["transfer_outcome"] == "ok"
    assert local["pdx"]["route"] == "local" and local["pdx"]["kv_bytes"] == 0
    ids = local["choices"][0]["prompt_token_ids"]
    expected = reference(ids, 24)
    assert local["choices"][0]["token_ids"] == expected
    assert dis["choices"][0]["token_ids"] == expected
    assert dis["choices"][0]["text"] == local["choices"][0]["text"]
    assert dis["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 24,
                            "total_tokens": len(ids) + 24,  # the whole prompt's KV shipped:
                            "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip


@pytest.mark.parametrize("codec", ["int8-g64", "fp8-e4m3"])
async def test_lossy_codec_agreement_is_measured(deployment: Deployment, codec: str) -> None:
    _, local, _ = await complete(deployment, **body("local", 32))
    _, dis, _ = await complete(deployment, **body("disaggregated", 32, pdx_kv_codec=codec))
    _, raw, _ = await complete(deployment, **body("disaggregated", 32, pdx_kv_codec="raw"))
    want, got = local["choices"][0]["token_ids"], dis["choices"][0]["token_ids"]
    agreement = sum(a == b for a, b in zip(want, got, strict=True)) / len(want)
    print(f"{codec}: greedy token agreement with local = {agreement:.3f}")
    assert got[0] == want[0]  # the first token comes from prefill, before any codec
    assert dis["pdx"]["kv_bytes"] < raw["pdx"]["kv_bytes"]  # the codec really compressed


async def test_auto_route_ships_long_prompts_and_keeps_short_ones_local(
    deployment: Deployment,
) -> None:
    _, short, _ = await complete(deployment, prompt="short", max_tokens=2)
    _, long, _ = await complete(deployment, prompt=PROMPT, max_tokens=2)  # 43 tokens >= 32
    assert short["pdx"]["route"] == "local" and short["pdx"]["requested_route"] == "auto"
    assert long["pdx"]["route"] == "disaggregated"


async def read_sse(resp: aiohttp.ClientResponse) -> list[Any]:
    events: list[Any] = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def test_streaming_sse_matches_non_streaming(deployment: Deployment) -> None:
    _, whole, _ = await complete(deployment, **body("disaggregated", 12))
    url = deployment.endpoints().gateway + "/v1/completions"
    request = body("disaggregated", 12, stream=True, stream_options={"include_usage": True})
    async with aiohttp.ClientSession() as s, s.post(url, json=request) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = await read_sse(r)
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    ids = [t for c in chunks for t in c["choices"][0].get("token_ids", [])]
    assert ids == whole["choices"][0]["token_ids"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in chunks)  # as OpenAI: null until the usage chunk
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 12
    assert last["pdx"]["route"] == "disaggregated"


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        (b"{not json", "malformed JSON"),
        (b"[1, 2]", "JSON object"),
        (json.dumps({"max_tokens": 4}).encode(), "prompt"),
        (json.dumps({"prompt": "", "max_tokens": 4}).encode(), "prompt"),
        (json.dumps({"prompt": "hi", "max_tokens": -1}).encode(), "max_tokens"),
        (json.dumps({"prompt": "hi", "max_tokens": "3"}).encode(), "max_tokens"),
        (json.dumps({"prompt": list(range(4, 1104)), "max_tokens": 4}).encode(), "context"),
        (json.dumps({"prompt": [4, 999999], "max_tokens": 4, "pdx_route": "local"}).encode(),
         "vocabulary"),
        (json.dumps({"prompt": "hi", "pdx_route": "sideways"}).encode(), "pdx_route"),
        (json.dumps({"prompt": "hi", "pdx_kv_codec": "gzip"}).encode(), "pdx_kv_codec"),
        (json.dumps({"prompt": "hi", "temperature": -1}).encode(), "temperature"),
        (json.dumps({"prompt": "hi", "n": 0}).encode(), "n"),
        (json.dumps({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}).encode(), "stop"),
        (json.dumps({"prompt": "hi", "suffix": "x"}).encode(), "suffix"),
        (json.dumps({"prompt": "hi", "frobnicate": 1}).encode(), "frobnicate"),
    ],
)  # fmt: skip
async def test_bad_requests_get_400_with_a_message(
    deployment: Deployment, payload: bytes, field: str
) -> None:
    url = deployment.endpoints().gateway + "/v1/completions"
    async with aiohttp.ClientSession() as s, s.post(url, data=payload) as r:
        assert r.status == 400
        err = (await r.json())["error"]
    assert field in err["message"] and err["type"] == "invalid_request_error"
    assert err["code"] is None or isinstance(err["code"], str)
    assert set(err) == {"message", "type", "param", "code"}


async def test_error_responses_are_counted_by_status(deployment: Deployment) -> None:
    """A misbehaving client is visible on /metrics: 400, 404 and 405 each counted."""
    gw = deployment.endpoints().gateway
    before = {s: await metric(deployment, "pdx_gateway_http_errors_total", status=s)
              for s in ("400", "404", "405")}  # fmt: skip
    async with aiohttp.ClientSession() as s:
        async with s.post(gw + "/v1/completions", data=b"{not json") as r:
            assert r.status == 400
        async with s.get(gw + "/v1/nothing-here") as r:
            assert r.status == 404
        async with s.get(gw + "/v1/completions") as r:
            assert r.status == 405
    for status, was in before.items():
        assert await metric(deployment, "pdx_gateway_http_errors_total", status=status) == was + 1


async def test_kv_link_cut_degrades_to_local_counted_and_correct(
    deployment: Deployment,
) -> None:
    proxy = deployment.proxies[0]
    _, local, _ = await complete(deployment, **body("local"))
    before = await metric(deployment, "pdx_gateway_degradations_total",
                          reason="RETRY_BUDGET_EXHAUSTED")  # fmt: skip
    await proxy.link_down(mode="reset")
    try:
        status, dis, _ = await complete(deployment, **body("disaggregated"))
    finally:
        proxy.link_up()
    assert status == 200
    pdx = dis["pdx"]
    assert pdx["degraded"] is True and pdx["route"] == "local"
    assert pdx["degrade_reason"] == "RETRY_BUDGET_EXHAUSTED" and pdx["retries"] == 2
    assert pdx["transfer_ms"] > 0  # the whole fetch: its three failed attempts took time
    assert dis["choices"][0]["token_ids"] == local["choices"][0]["token_ids"]
    after = await metric(deployment, "pdx_gateway_degradations_total",
                         reason="RETRY_BUDGET_EXHAUSTED")  # fmt: skip
    assert after == before + 1
    # Link back up: gRPC reconnects with its own backoff, so poll (bounded) for a clean transfer.
    for _ in range(40):
        _, healed, _ = await complete(deployment, **body("disaggregated", 2))
        if not healed["pdx"]["degraded"]:
            break
        await asyncio.sleep(0.25)
    assert healed["pdx"]["degraded"] is False


async def test_flood_beyond_capacity_gets_429_with_retry_after(deployment: Deployment) -> None:
    # Capacity is max_batch 2 + max_queue 2 = 4; 24 at once must be refused early, not queued.
    before = await metric(deployment, "pdx_gateway_rejections_total", reason="no_decode_capacity")
    decode = deployment.gateway.router.decodes[0]
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, decode.in_flight)
            await asyncio.sleep(0.001)

    watcher = asyncio.create_task(watch())
    results = await asyncio.gather(*(complete(deployment, **body("local", 200)) for _ in range(24)))
    watcher.cancel()
    assert 1 <= peak <= decode.capacity == 4  # admitted work never exceeded capacity
    statuses = [s for s, _, _ in results]
    assert set(statuses) <= {200, 429} and statuses.count(429) >= 10
    for status, data, headers in results:
        if status == 429:
            assert headers["Retry-After"] == "1" and "capacity" in data["error"]["message"]
        else:
            assert len(data["choices"][0]["token_ids"]) == 200
    after = await metric(deployment, "pdx_gateway_rejections_total", reason="no_decode_capacity")
    assert after - before == statuses.count(429)
    assert await metric(deployment, "pdx_gateway_in_flight", instance="decode-0") == 0


async def test_health_ready_models_and_chat(deployment: Deployment) -> None:
    gw = deployment.endpoints().gateway
    async with aiohttp.ClientSession() as s:
        async with s.get(gw + "/healthz") as r:
            assert r.status == 200
        async with s.get(gw + "/readyz") as r:
            assert r.status == 200 and (await r.json())["decode_healthy"] == ["decode-0"]
        async with s.get(gw + "/v1/models") as r:
            assert (await r.json())["data"][0]["max_model_len"] == 1024
        async with s.post(gw + "/v1/chat/completions", json={"messages": []}) as r:
            err = (await r.json())["error"]
            assert r.status == 400 and err["param"] == "messages"


async def test_single_token_request_is_served_by_prefill_alone(deployment: Deployment) -> None:
    status, dis, _ = await complete(deployment, **body("disaggregated", 1))
    _, local, _ = await complete(deployment, **body("local", 1))
    assert status == 200 and dis["usage"]["completion_tokens"] == 1
    assert dis["choices"][0]["token_ids"] == local["choices"][0]["token_ids"]
    assert dis["pdx"]["kv_id"] and dis["pdx"]["kv_bytes"] == 0  # nothing left to fetch
