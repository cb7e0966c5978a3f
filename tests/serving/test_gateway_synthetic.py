"""A synthetic Llama-3.1-8B pair in this process: real KV volume through a real gRPC hop."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from pdx.serving.backends.tokenizer import ByteTokenizer
from pdx.serving.decode import DecodeNode
from pdx.serving.deploy_config import NodeOptions, load_deploy_config
from pdx.serving.gateway import Gateway, build_gateway
from pdx.serving.prefill import PrefillNode

SETS = ["model.backend=synthetic", "model.preset=llama-3.1-8b", "kv.kv_transfer_timeout_ms=10000",
        "router.local_prefill_max_tokens=16"]  # fmt: skip
KV_BYTES_PER_TOKEN = 131_072  # Llama-3.1-8B, bf16: 2 x 32 layers x 8 KV heads x 128 x 2 B


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    cfg = load_deploy_config(dotted=SETS)
    prefill = await PrefillNode.start(cfg, NodeOptions())
    decode = await DecodeNode.start(cfg, NodeOptions())
    gw = build_gateway(
        cfg, [("prefill-0", f"127.0.0.1:{prefill.port}")],
        [("decode-0", f"127.0.0.1:{decode.port}")], tls=None, tokenizer=ByteTokenizer(),
        max_context_tokens=4096, model_name="llama-3.1-8b", synthetic=True,
    )  # fmt: skip
    await gw.start("127.0.0.1", 0)
    yield gw
    await gw.stop()
    await decode.stop(0.5)
    await prefill.stop(0.5)


async def post(gw: Gateway, **body: Any) -> dict[str, Any]:
    url = f"http://127.0.0.1:{gw.port}/v1/completions"
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        data: dict[str, Any] = await r.json()
        return data


async def test_synthetic_8b_kv_crosses_the_link_at_full_size(gateway: Gateway) -> None:
    prompt = list(range(4, 68))  # 64 tokens
    req = {"prompt": prompt, "max_tokens": 6, "return_token_ids": True}
    dis = await post(gateway, **req)  # auto: 64 >= 16 tokens, shipped
    local = await post(gateway, **req, pdx_route="local")
    pdx = dis["pdx"]
    assert pdx["route"] == "disaggregated" and not pdx["degraded"]
    assert pdx["synthetic"] is True and local["pdx"]["synthetic"] is True
    raw = 64 * KV_BYTES_PER_TOKEN
    assert raw <= pdx["kv_bytes"] < raw * 1.001  # + small per-tensor codec headers
    assert dis["choices"][0]["token_ids"] == local["choices"][0]["token_ids"]
    models = f"http://127.0.0.1:{gateway.port}/v1/models"
    async with aiohttp.ClientSession() as s, s.get(models) as r:
        assert (await r.json())["data"][0]["synthetic"] is True
