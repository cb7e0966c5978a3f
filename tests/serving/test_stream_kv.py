"""Streamed KV (kv.streaming): prefill stores each layer as the forward pass produces it,
decode reads the object while it is written; greedy output is unchanged, failures degrade."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from typing import Any

import aiohttp
import grpc
import pytest
from inprocess_pair import inprocess_pair

from pdx._proto import serving_pb2, serving_pb2_grpc
from pdx.serving.backends import BackendConfig, create_backend
from pdx.serving.backends.sampling import pick_token
from pdx.serving.decode import DecodeNode
from pdx.serving.deploy_config import NodeOptions, load_deploy_config
from pdx.transfer.contract import KVStoreConfig
from pdx.transfer.server import create_kv_server

PROMPT = [4 + (i * 37) % 250 for i in range(200)]


def greedy_alone(prompt: list[int], n: int) -> list[int]:
    backend = create_backend(BackendConfig())
    state, logits = backend.prefill(prompt)
    out = [pick_token(logits, 0, 0, 0)]
    while len(out) < n:
        (state,), logits = backend.decode_step([state], [out[-1]])
        out.append(pick_token(logits[0], 0, 0, 0))
    return out


async def complete(session: aiohttp.ClientSession, url: str, route: str, **kw: Any) -> Any:
    prompt = kw.pop("prompt", PROMPT)
    body = {"prompt": prompt, "max_tokens": 12, "ignore_eos": True, "return_token_ids": True,
            "pdx_route": route, **kw}  # fmt: skip
    async with session.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        if not kw.get("stream"):
            return await r.json()
        tokens: list[int] = []
        last: dict[str, Any] = {}
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                last = json.loads(line[6:])
                tokens += last["choices"][0].get("token_ids") or []
        return {"choices": [{"token_ids": tokens}], "pdx": last.get("pdx")}


@pytest.mark.parametrize("codec", ["raw", "zstd-planes", "lz4"])
async def test_streamed_disaggregated_equals_local(codec: str) -> None:
    sets = ["tls.enabled=false", "kv.streaming=true", f"kv.codec={codec}",
            "kv.chunk_size_kb=64", "router.local_prefill_max_tokens=1"]  # fmt: skip
    want = greedy_alone(PROMPT, 12)
    async with inprocess_pair(sets) as (gw, prefill, _):
        url = f"http://127.0.0.1:{gw.port}/v1/completions"
        async with aiohttp.ClientSession() as s:
            dis = await complete(s, url, "disaggregated")
            local = await complete(s, url, "local")
            streamed = await complete(s, url, "disaggregated", stream=True)
        await asyncio.sleep(0.3)  # decode's Release runs after its first decoded token
        assert prefill.kv_server.store.used_bytes == 0  # released, nothing reserved left
    assert dis["choices"][0]["token_ids"] == local["choices"][0]["token_ids"] == want
    assert streamed["choices"][0]["token_ids"] == want and streamed["pdx"]["kv_streamed"]
    pdx = dis["pdx"]
    assert pdx["route"] == "disaggregated" and not pdx["degraded"]
    assert pdx["transfer_outcome"] == "ok" and pdx["kv_streamed"] is True
    assert pdx["kv_bytes"] > 0 and pdx["kv_bytes_while_writing"] >= 0
    assert pdx["kv_put_overlap_ms"] > 0 and pdx["kv_put_overlap_bytes"] >= 0
    assert 0 <= pdx["transfer_hidden_fraction"] <= 1
    assert pdx["first_to_second_token_ms"] > 0
    assert pdx["timings_ms"]["prefill_opened_event"] is not None
    assert local["pdx"]["kv_streamed"] is False


async def test_decode_reads_the_layers_while_prefill_computes() -> None:
    # Synthetic tiny model, 0.25 s of roofline time per layer (2 layers of 150 KiB for 600
    # tokens): decode's Get starts at the opened event and receives the layers as stored.
    sets = ["tls.enabled=false", "kv.streaming=true", "model.backend=synthetic",
            "model.prefill_tflops=0.00024", "kv.chunk_size_kb=64",
            "router.local_prefill_max_tokens=1",
            "prefix_cache.enabled=false"]  # the timed prompt starts with the warm-up's  # fmt: skip
    async with inprocess_pair(sets) as (gw, _, _):
        url = f"http://127.0.0.1:{gw.port}/v1/completions"
        async with aiohttp.ClientSession() as s:
            # A first transfer opens the KV channels, so the measured one does not pay for the
            # connection while its first layer waits to be sent.
            await complete(s, url, "disaggregated", max_tokens=2)
            local = await complete(s, url, "local", max_tokens=5, prompt=PROMPT * 3)
            dis = await complete(s, url, "disaggregated", max_tokens=5, prompt=PROMPT * 3)
    assert dis["choices"][0]["token_ids"] == local["choices"][0]["token_ids"]
    pdx = dis["pdx"]
    prefill_ms = pdx["timings_ms"]["prefill"]
    assert prefill_ms > 400 and pdx["kv_streamed"] and not pdx["degraded"], str(pdx)
    assert pdx["kv_bytes_while_writing"] > pdx["kv_bytes"] // 2  # most arrived as written
    assert pdx["kv_put_overlap_bytes"] > 0  # the first layer was stored mid-prefill
    assert pdx["transfer_hidden_fraction"] > 0.5  # the Get ran mostly during prefill
    assert pdx["kv_get_wait_ms"] > prefill_ms / 4
    # The second token waits for the last layer and one step, not for a whole transfer.
    assert pdx["first_to_second_token_ms"] < prefill_ms / 2


async def test_a_single_token_request_reads_no_streamed_kv() -> None:
    """max_tokens 1: prefill's first token is the answer; decode is not started at the opened
    event, reads nothing, and the object is released (nothing left in the store)."""
    sets = ["tls.enabled=false", "kv.streaming=true", "router.local_prefill_max_tokens=1"]
    async with inprocess_pair(sets) as (gw, prefill, _):
        url = f"http://127.0.0.1:{gw.port}/v1/completions"
        async with aiohttp.ClientSession() as s:
            one = await complete(s, url, "disaggregated", max_tokens=1)
        for _ in range(100):  # the unread object is released (or ended) just after the answer
            if prefill.kv_server.store.used_bytes == 0:
                break
            await asyncio.sleep(0.02)
        assert prefill.kv_server.store.used_bytes == 0
    assert one["choices"][0]["token_ids"] == greedy_alone(PROMPT, 1)
    assert one["pdx"]["kv_id"] and one["pdx"]["kv_bytes"] == 0


async def test_streaming_off_keeps_the_whole_object_path() -> None:
    sets = ["tls.enabled=false", "router.local_prefill_max_tokens=1", "kv.streaming=false"]
    async with inprocess_pair(sets) as (gw, _, _):
        url = f"http://127.0.0.1:{gw.port}/v1/completions"
        async with aiohttp.ClientSession() as s:
            dis = await complete(s, url, "disaggregated")
    assert dis["choices"][0]["token_ids"] == greedy_alone(PROMPT, 12)
    assert dis["pdx"]["kv_streamed"] is False and dis["pdx"]["transfer_outcome"] == "ok"
    assert dis["pdx"]["timings_ms"]["prefill_opened_event"] is None


async def test_prefill_stopped_before_its_first_token_degrades_in_the_gateway() -> None:
    # A slow synthetic prefill (1 s of roofline time per layer), stopped mid-pass: the
    # object is ended, decode's early Generate is cancelled and the gateway prefills locally.
    sets = ["tls.enabled=false", "kv.streaming=true", "model.backend=synthetic",
            "model.prefill_tflops=0.000002", "router.local_prefill_max_tokens=1"]  # fmt: skip
    async with inprocess_pair(sets) as (gw, prefill, _):
        url = f"http://127.0.0.1:{gw.port}/v1/completions"
        async with aiohttp.ClientSession() as s:
            short = PROMPT[:20]  # 2 s of roofline prefill, on either side
            local = await complete(s, url, "local", max_tokens=4, prompt=short)
            going = asyncio.ensure_future(
                complete(s, url, "disaggregated", max_tokens=4, prompt=short)
            )
            store = prefill.kv_server.store
            while not store._writing:
                await asyncio.sleep(0.01)
            assert prefill.server is not None
            await prefill.server.stop(0)  # the Prefill service dies; its store stays up
            dis = await asyncio.wait_for(going, 60)
        assert store.used_bytes == 0  # the partial object's reservation is freed
    assert dis["choices"][0]["token_ids"] == local["choices"][0]["token_ids"]
    assert dis["pdx"]["degraded"] and dis["pdx"]["route"] == "local"


_DYING_PREFILL = """
import asyncio, sys
from pdx.serving.backends import BackendConfig, create_backend
from pdx.transfer.client import KVClient
from pdx.transfer.contract import KVClientConfig, KVLayout
from pdx.kv.codecs import get_codec

async def main():
    backend = create_backend(BackendConfig())
    prompt = [int(t) for t in sys.argv[2].split(",")]
    state, _ = backend.prefill(prompt)
    kv = KVClient(sys.argv[1], KVClientConfig(chunk_size_kb=64, client_id="prefill"))
    w = await kv.open(4 * state.nbytes, KVLayout(codec="raw"), model_version=backend.model_version)
    print(w.kv_id, flush=True)
    w.write(get_codec("raw").encode(state.tensors[0], "key"))  # the first layer's key only
    await asyncio.sleep(3600)  # killed here, mid-Put

asyncio.run(main())
"""


async def test_prefill_killed_mid_put_decode_gets_kv_incomplete_and_prefills_locally() -> None:
    store, port = await create_kv_server(KVStoreConfig(readers=["*"]))
    cfg = load_deploy_config(dotted=["kv.kv_transfer_timeout_ms=20000"])
    node = await DecodeNode.start(cfg, NodeOptions())
    proc = subprocess.Popen(
        [sys.executable, "-c", _DYING_PREFILL, f"127.0.0.1:{port}", ",".join(map(str, PROMPT))],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        kv_id = (await asyncio.to_thread(proc.stdout.readline)).strip()
        sp = serving_pb2.SamplingParams(max_tokens=6, ignore_eos=True)
        req = serving_pb2.GenerateRequest(
            request_id="t", prompt_token_ids=PROMPT, sampling=sp, kv_id=kv_id,
            kv_endpoint=f"127.0.0.1:{port}", first_token_in_kv=True,
        )  # fmt: skip
        async with grpc.aio.insecure_channel(f"127.0.0.1:{node.port}") as ch:
            call = serving_pb2_grpc.DecodeStub(ch).Generate(req, timeout=60)
            collected = asyncio.ensure_future(_collect(call))
            await asyncio.sleep(0.5)
            assert not collected.done()  # decode waits on the object being written
            proc.kill()
            t0 = time.perf_counter()
            tokens, last = await asyncio.wait_for(collected, 30)
        elapsed = time.perf_counter() - t0
        assert store.store.used_bytes == 0  # the partial object's budget is freed
    finally:
        proc.kill()
        proc.wait()
        await node.stop(0.5)
        await store.stop(0.2)
    st = last.stats
    assert st.degraded and st.degrade_reason == "KV_INCOMPLETE" and st.route == "local"
    assert st.transfer_outcome == "KV_INCOMPLETE" and st.local_prefill_ms > 0
    assert elapsed < 10  # well within the 20 s deadline: the dead writer ends the object
    assert tokens == greedy_alone(PROMPT, 6)


async def _collect(call: Any) -> tuple[list[int], Any]:
    tokens, last = [], None
    async for chunk in call:
        tokens += list(chunk.token_ids)
        last = chunk
    return tokens, last
