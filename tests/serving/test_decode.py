"""The decode service over real gRPC: continuous batching, admission, KV errors → local."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from pdx._proto import serving_pb2, serving_pb2_grpc
from pdx.serving.backends import create_backend
from pdx.serving.backends.sampling import pick_token
from pdx.serving.decode import DecodeNode
from pdx.serving.deploy_config import NodeOptions, load_deploy_config
from pdx.transfer.contract import KVStoreConfig
from pdx.transfer.server import create_kv_server


async def start(*sets: str) -> DecodeNode:
    return await DecodeNode.start(load_deploy_config(dotted=list(sets)), NodeOptions())


@pytest.fixture
async def node() -> AsyncIterator[DecodeNode]:
    n = await start("decode.max_batch=4", "decode.max_queue=0")
    yield n
    await n.stop(0.5)


def greedy_alone(prompt: list[int], n: int) -> list[int]:
    backend = create_backend(load_deploy_config().model)
    state, logits = backend.prefill(prompt)
    out = [pick_token(logits, 0, 0, 0)]
    while len(out) < n:
        (state,), logits = backend.decode_step([state], [out[-1]])
        out.append(pick_token(logits[0], 0, 0, 0))
    return out


def gen(prompt: list[int], n: int, **kw: Any) -> serving_pb2.GenerateRequest:
    sp = serving_pb2.SamplingParams(max_tokens=n, ignore_eos=True)
    return serving_pb2.GenerateRequest(request_id="t", prompt_token_ids=prompt, sampling=sp, **kw)


async def collect(stub: Any, req: serving_pb2.GenerateRequest, delay_s: float = 0) -> Any:
    await asyncio.sleep(delay_s)
    tokens, last = [], None
    async for chunk in stub.Generate(req, timeout=60):
        tokens += list(chunk.token_ids)
        last = chunk
    return tokens, last


async def test_sequences_joining_mid_batch_decode_as_if_alone(node: DecodeNode) -> None:
    prompts = [list(range(10, 10 + 5 * (i + 1))) for i in range(4)]
    seen_running: list[int] = []
    going = [asyncio.Event() for _ in prompts]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{node.port}") as ch:
        stub = serving_pb2_grpc.DecodeStub(ch)

        async def watch() -> None:
            while True:
                st = await stub.Status(serving_pb2.DecodeStatusRequest(), timeout=5)
                seen_running.append(st.running)
                await asyncio.sleep(0.005)

        async def run(i: int) -> tuple[list[int], Any]:
            if i:  # join while the previous sequence is mid-generation
                await going[i - 1].wait()
            tokens, last = [], None
            async for chunk in stub.Generate(gen(prompts[i], 60), timeout=60):
                tokens += list(chunk.token_ids)
                last = chunk
                if len(tokens) >= 5:
                    going[i].set()
            going[i].set()
            return tokens, last

        watcher = asyncio.create_task(watch())
        results = await asyncio.gather(*(run(i) for i in range(len(prompts))))
        watcher.cancel()
    for prompt, (tokens, last) in zip(prompts, results, strict=True):
        assert tokens == greedy_alone(prompt, 60)
        assert last.finish_reason == "length" and last.stats.route == "local"
    assert max(seen_running) >= 2  # they really shared forward passes
    assert node.engine is not None and node.engine.admitted == 0


async def test_full_decode_refuses_with_resource_exhausted() -> None:
    n = await start("decode.max_batch=1", "decode.max_queue=0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{n.port}") as ch:
            stub = serving_pb2_grpc.DecodeStub(ch)
            long = asyncio.create_task(collect(stub, gen([5, 6, 7], 300)))
            while n.engine is not None and n.engine.admitted == 0:
                await asyncio.sleep(0.01)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, gen([5, 6, 7], 3))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            long.cancel()
    finally:
        await n.stop(0.5)


async def test_unknown_kv_id_degrades_to_local_prefill_with_the_reason(node: DecodeNode) -> None:
    store, port = await create_kv_server(KVStoreConfig())
    try:
        kv_id = "kv1." + "0" * 32 + ".1700000000000.tiny-llama+x"
        req = gen([9, 8, 7, 6], 6, kv_id=kv_id, kv_endpoint=f"127.0.0.1:{port}",
                  first_token=0, has_first_token=False)  # fmt: skip
        async with grpc.aio.insecure_channel(f"127.0.0.1:{node.port}") as ch:
            tokens, last = await collect(serving_pb2_grpc.DecodeStub(ch), req)
    finally:
        await store.stop(0.2)
    st = last.stats
    assert st.degraded and st.degrade_reason == "KV_NOT_FOUND" and st.route == "local"
    assert tokens == greedy_alone([9, 8, 7, 6], 6)


async def test_cancelled_stream_leaves_the_batch(node: DecodeNode) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{node.port}") as ch:
        call = serving_pb2_grpc.DecodeStub(ch).Generate(gen([1, 2, 3], 500), timeout=60)
        got = 0
        async for _ in call:
            got += 1
            if got == 3:
                break
        call.cancel()
    assert node.engine is not None
    for _ in range(200):
        if node.engine.admitted == 0 and not node.engine.running:
            break
        await asyncio.sleep(0.02)
    assert node.engine.admitted == 0 and not node.engine.running


async def test_kv_from_other_weights_is_never_used(node: DecodeNode) -> None:
    from pdx.serving.backends.kvwire import encode_kv
    from pdx.transfer.client import KVClient
    from pdx.transfer.contract import KVClientConfig, KVLayout

    prompt = [9, 8, 7, 6, 5]
    other = create_backend(load_deploy_config(dotted=["model.seed=1"]).model)
    state, _ = other.prefill(prompt)  # same shapes, different weights
    enc = encode_kv(state, "raw", num_layers=2)
    store, port = await create_kv_server(KVStoreConfig())
    try:
        async with KVClient(f"127.0.0.1:{port}", KVClientConfig(kv_transfer_timeout_ms=5000)) as kv:
            kv_id = await kv.put(enc.payload, KVLayout(**enc.layout),
                                 model_version=other.model_version)  # fmt: skip
        req = gen(prompt, 5, kv_id=kv_id, kv_endpoint=f"127.0.0.1:{port}")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{node.port}") as ch:
            tokens, last = await collect(serving_pb2_grpc.DecodeStub(ch), req)
    finally:
        await store.stop(0.2)
    assert last.stats.degraded and last.stats.degrade_reason == "model_version_mismatch"
    assert tokens == greedy_alone(prompt, 5)


async def test_fetch_waits_while_resident_kv_is_over_budget() -> None:
    from pdx.serving.prefill import PrefillNode

    # the first request's reservation (153 tokens) fits, the second's (33) does not beside it
    per_token = create_backend(load_deploy_config().model).kv_bytes_bound(1)[0]
    budget = f"decode.kv_budget_bytes={per_token * 160}"
    cfg = load_deploy_config(dotted=[budget, "kv.kv_transfer_timeout_ms=5000"])
    prefill = await PrefillNode.start(cfg, NodeOptions())
    decode = await DecodeNode.start(cfg, NodeOptions())
    try:
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as dch,
            grpc.aio.insecure_channel(f"127.0.0.1:{prefill.port}") as pch,
        ):
            stub = serving_pb2_grpc.DecodeStub(dch)
            first = asyncio.create_task(collect(stub, gen([1, 2, 3], 150)))
            while decode.engine is not None and not decode.engine.running:
                await asyncio.sleep(0.005)
            reply = await serving_pb2_grpc.PrefillStub(pch).Prefill(
                serving_pb2.PrefillRequest(token_ids=[7, 8, 9]), timeout=30
            )
            req = gen([7, 8, 9], 30, kv_id=reply.kv_id, kv_endpoint=reply.kv_endpoint,
                      first_token=reply.first_token, has_first_token=True)  # fmt: skip
            second = asyncio.create_task(collect(stub, req))
            engine = decode.engine
            assert engine is not None
            while not first.done():  # never both resident: the fetch waits for room
                assert len(engine.running) + len(engine.joining) <= 1
                await asyncio.sleep(0.002)
            tokens, last = await second
            assert last.stats.route == "disaggregated" and not last.stats.degraded
            assert tokens == greedy_alone([7, 8, 9], 30)
    finally:
        await decode.stop(0.5)
        await prefill.stop(0.5)


async def test_a_long_prompt_waits_for_room_and_resident_kv_never_passes_the_budget() -> None:
    """One request holds 90 % of the budget; a long one arrives and must not join beside it
    (before admission reserved KV, it was prefilled at once: 140 % of the budget resident)."""
    per_token = create_backend(load_deploy_config().model).kv_bytes_bound(1)[0]
    budget = per_token * 100
    node = await start(f"decode.kv_budget_bytes={budget}", "decode.max_batch=4")
    engine = node.engine
    assert engine is not None
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{node.port}") as ch:
            stub = serving_pb2_grpc.DecodeStub(ch)
            first = asyncio.create_task(collect(stub, gen(list(range(1, 11)), 80)))  # 90 tokens
            while not engine.running:
                await asyncio.sleep(0.002)
            st = await stub.Status(serving_pb2.DecodeStatusRequest(), timeout=5)
            assert st.kv_free_bytes == budget - 90 * per_token
            assert st.kv_bytes_per_token == per_token
            long = list(range(20, 60))
            second = asyncio.create_task(collect(stub, gen(long, 10)))  # 50 tokens: waits
            peak = 0
            while not second.done():
                peak = max(peak, engine.resident_bytes)
                if not first.done():
                    assert len(engine.running) + len(engine.joining) <= 1
                await asyncio.sleep(0.001)
            await first
            tokens, last = await second
        assert peak <= budget
        assert tokens == greedy_alone(long, 10) and last.stats.route == "local"
        assert engine.kv.reserved_bytes == 0  # both given back
    finally:
        await node.stop(0.5)


async def test_a_request_larger_than_the_whole_budget_is_refused_naming_both() -> None:
    per_token = create_backend(load_deploy_config().model).kv_bytes_bound(1)[0]
    node = await start(f"decode.kv_budget_bytes={per_token * 20}")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{node.port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(serving_pb2_grpc.DecodeStub(ch), gen([1, 2, 3], 30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == (
            f"the request's KV needs {33 * per_token} bytes (prompt 3 + max_tokens 30 tokens) "
            f"and decode.kv_budget_bytes of decode-0 is {20 * per_token}"
        )
    finally:
        await node.stop(0.5)


async def test_fetched_object_is_released_once_rebuilt() -> None:
    from pdx.serving.prefill import PrefillNode
    from pdx.transfer.client import KVClient
    from pdx.transfer.contract import KVClientConfig, KVError

    cfg = load_deploy_config(dotted=["kv.kv_transfer_timeout_ms=5000"])
    prefill = await PrefillNode.start(cfg, NodeOptions())
    decode = await DecodeNode.start(cfg, NodeOptions())
    try:
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as dch,
            grpc.aio.insecure_channel(f"127.0.0.1:{prefill.port}") as pch,
        ):
            reply = await serving_pb2_grpc.PrefillStub(pch).Prefill(
                serving_pb2.PrefillRequest(token_ids=[7, 8, 9]), timeout=30
            )
            req = gen([7, 8, 9], 4, kv_id=reply.kv_id, kv_endpoint=reply.kv_endpoint,
                      first_token=reply.first_token, has_first_token=True)  # fmt: skip
            tokens, last = await collect(serving_pb2_grpc.DecodeStub(dch), req)
        assert last.stats.route == "disaggregated" and tokens == greedy_alone([7, 8, 9], 4)
        # The acknowledgement runs beside decoding: wait (bounded) for the store to drop it.
        async with KVClient(reply.kv_endpoint, KVClientConfig(kv_transfer_timeout_ms=5000)) as kv:
            for _ in range(200):
                try:
                    await kv.stat(reply.kv_id)
                except KVError as exc:
                    assert exc.code.value == "KV_NOT_FOUND", exc
                    break
                await asyncio.sleep(0.01)
            else:
                pytest.fail("the fetched object was never released")
    finally:
        await decode.stop(0.5)
        await prefill.stop(0.5)
