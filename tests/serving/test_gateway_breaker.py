"""The circuit breaker end to end: a cut KV link opens it, auto traffic goes local, a probe heals.

Prefill, decode and gateway run in this process (real gRPC and HTTP on loopback); decode's KV
reads pass through a fault proxy the test cuts.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from pdx.faults.proxy import FaultProxy
from pdx.serving.backends.tokenizer import ByteTokenizer
from pdx.serving.decode import DecodeNode
from pdx.serving.deploy_config import NodeOptions, load_deploy_config
from pdx.serving.gateway import Gateway, build_gateway
from pdx.serving.prefill import PrefillNode

SETS = ["router.local_prefill_max_tokens=8", "router.breaker_min_samples=4",
        "router.breaker_window=5", "router.success_rate_threshold=0.9",
        "router.breaker_open_s=0.3", "kv.kv_transfer_timeout_ms=5000",
        "kv.transport=grpc"]  # the proxy fronts the store's gRPC port  # fmt: skip


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Gateway, FaultProxy]]:
    cfg = load_deploy_config(dotted=SETS)
    prefill = await PrefillNode.start(cfg, NodeOptions())
    decode = await DecodeNode.start(cfg, NodeOptions())
    proxy = FaultProxy(("127.0.0.1", 0), ("127.0.0.1", prefill.kv_port))
    await proxy.start()
    gw = build_gateway(
        cfg, [("prefill-0", f"127.0.0.1:{prefill.port}")],
        [("decode-0", f"127.0.0.1:{decode.port}")], tls=None, tokenizer=ByteTokenizer(),
        max_context_tokens=1024, model_name="tiny-llama",
    )  # fmt: skip
    gw.kv_route[f"127.0.0.1:{prefill.kv_port}"] = f"127.0.0.1:{proxy.port}"
    await gw.start("127.0.0.1", 0)
    yield gw, proxy
    await gw.stop()
    await proxy.stop()
    await decode.stop(0.5)
    await prefill.stop(0.5)


async def ask(gw: Gateway) -> dict[str, Any]:
    body = {"prompt": "a prompt long enough to ship", "max_tokens": 4, "return_token_ids": True}
    url = f"http://127.0.0.1:{gw.port}/v1/completions"
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 200
        data: dict[str, Any] = await r.json()
        return data


async def test_cut_link_opens_breaker_then_a_probe_closes_it(
    pair: tuple[Gateway, FaultProxy],
) -> None:
    gw, proxy = pair
    healthy = await ask(gw)
    assert healthy["pdx"]["route"] == "disaggregated"
    expected = healthy["choices"][0]["token_ids"]
    await proxy.link_down(mode="reset")
    failed = [await ask(gw) for _ in range(3)]  # each transfer fails → local, counted
    assert all(f["pdx"]["degrade_reason"] == "RETRY_BUDGET_EXHAUSTED" for f in failed)
    assert gw.router.breaker.state == "open"
    skipped = await ask(gw)  # breaker open: no transfer is even attempted
    assert skipped["pdx"]["degrade_reason"] == "circuit_open:success_rate"
    assert skipped["pdx"]["transfer_outcome"] is None and skipped["pdx"]["kv_id"] is None
    assert all(r["choices"][0]["token_ids"] == expected for r in [*failed, skipped])
    proxy.link_up()
    for _ in range(50):  # half-open probes until one transfer succeeds (gRPC reconnect backoff)
        await asyncio.sleep(0.1)
        await ask(gw)
        if gw.router.breaker.state == "closed":
            break
    assert gw.router.breaker.state == "closed"
    assert (await ask(gw))["pdx"]["route"] == "disaggregated"
    sample = gw.metrics.registry.get_sample_value
    assert sample("pdx_gateway_degradations_total", {"reason": "circuit_open"}) >= 1
    assert sample("pdx_gateway_degradations_total", {"reason": "RETRY_BUDGET_EXHAUSTED"}) >= 3
