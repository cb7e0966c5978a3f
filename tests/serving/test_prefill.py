"""The prefill service over real gRPC: KV really stored, bounded admission, mutual TLS."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from pdx._proto import serving_pb2, serving_pb2_grpc
from pdx.serving.backends import create_backend
from pdx.serving.backends.kvwire import EncodedKV, decode_kv
from pdx.serving.deploy_config import NodeOptions, load_deploy_config
from pdx.serving.prefill import PrefillNode, StoreSink
from pdx.tls import init_certs
from pdx.transfer.client import KVClient
from pdx.transfer.contract import KVClientConfig

PROMPT = list(range(40, 72))


async def start(tmp: Path | None = None, *sets: str) -> PrefillNode:
    cfg = load_deploy_config(dotted=list(sets))
    return await PrefillNode.start(cfg, NodeOptions(cert_dir=tmp))


@pytest.fixture
async def node() -> AsyncIterator[PrefillNode]:
    n = await start(None)
    yield n
    await n.stop(0.5)


@pytest.fixture
async def whole_node() -> AsyncIterator[PrefillNode]:
    """A prefill that stores each object whole once it has computed (kv.streaming off)."""
    n = await start(None, "kv.streaming=false")
    yield n
    await n.stop(0.5)


def request(ids: list[int], codec: str = "") -> serving_pb2.PrefillRequest:
    return serving_pb2.PrefillRequest(
        request_id="t", token_ids=ids, codec=codec, sampling=serving_pb2.SamplingParams()
    )


async def test_prefill_stores_the_real_kv_and_returns_the_first_token(node: PrefillNode) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{node.port}") as ch:
        reply = await serving_pb2_grpc.PrefillStub(ch).Prefill(request(PROMPT), timeout=30)
    backend = create_backend(load_deploy_config().model)
    state, logits = backend.prefill(PROMPT)
    assert reply.first_token == int(logits.argmax())
    assert reply.kv_raw_bytes == state.nbytes and reply.kv_bytes >= state.nbytes
    assert reply.kv_endpoint == f"127.0.0.1:{node.kv_port}"
    assert reply.model_version == backend.model_version and reply.kv_id.startswith("kv1.")
    async with KVClient(
        reply.kv_endpoint, KVClientConfig(kv_transfer_timeout_ms=5000, client_id="decode")
    ) as kv:
        obj = await kv.get(reply.kv_id)
        layout = {"codec": obj.layout.codec, "shapes": obj.layout.shapes,
                  "tensor_bytes": obj.layout.tensor_bytes}  # fmt: skip
        rebuilt = decode_kv(obj.data, layout, backend, len(PROMPT))
        await kv.release(reply.kv_id)
    for a, b in zip(state.tensors, rebuilt.tensors, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("ids", "needle"), [([], "empty"), ([4, 5, 100000], "vocabulary")])
async def test_bad_prompts_are_invalid_argument(
    node: PrefillNode, ids: list[int], needle: str
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{node.port}") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await serving_pb2_grpc.PrefillStub(ch).Prefill(request(ids), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in err.value.details()


async def test_rate_limit_refuses_instead_of_queueing() -> None:
    n = await start(None, "prefill.rate_limit_qps=2")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{n.port}") as ch:
            stub = serving_pb2_grpc.PrefillStub(ch)
            results = await asyncio.gather(
                *(stub.Prefill(request(PROMPT), timeout=30) for _ in range(6)),
                return_exceptions=True,
            )
    finally:
        await n.stop(0.5)
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(refused) >= 3
    assert all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused)
    assert "rate limit" in refused[0].details()


async def test_client_without_certificate_is_rejected(tmp_path: Path) -> None:
    init_certs(tmp_path, ("kv-store", "prefill", "decode", "gateway"))
    n = await start(tmp_path)
    try:
        creds = grpc.ssl_channel_credentials((tmp_path / "ca.pem").read_bytes())
        async with grpc.aio.secure_channel(f"127.0.0.1:{n.port}", creds) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await serving_pb2_grpc.PrefillStub(ch).Prefill(request(PROMPT), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        from pdx.serving.rpc import channel
        from pdx.tls import tls_for

        async with channel(f"127.0.0.1:{n.port}", tls_for(tmp_path, "gateway")) as ch:
            reply = await serving_pb2_grpc.PrefillStub(ch).Prefill(request(PROMPT), timeout=30)
        assert reply.kv_id
    finally:
        await n.stop(0.5)


class GatedSink:
    """The node's real store sink, whose Put waits until the test opens the gate."""

    def __init__(self, inner: StoreSink) -> None:
        self.inner, self.endpoint = inner, inner.endpoint
        self.gate, self.puts = asyncio.Event(), 0

    async def put(self, encoded: EncodedKV, model_version: str, ttl_s: int) -> tuple[str, int]:
        await self.gate.wait()
        self.puts += 1
        return await self.inner.put(encoded, model_version, ttl_s)


async def test_stream_answers_the_first_token_before_the_put_completes(
    whole_node: PrefillNode,
) -> None:
    node = whole_node
    assert node.servicer is not None and isinstance(node.servicer.sink, StoreSink)
    sink = node.servicer.sink = GatedSink(node.servicer.sink)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{node.port}") as ch:
        call = serving_pb2_grpc.PrefillStub(ch).PrefillStream(request(PROMPT), timeout=30)
        first = await call.read()
        assert first.HasField("first") and sink.puts == 0  # the Put has not even begun
        sink.gate.set()
        stored = (await call.read()).stored
        assert await call.read() is grpc.aio.EOF
    backend = create_backend(load_deploy_config().model)
    state, logits = backend.prefill(PROMPT)
    assert first.first.first_token == stored.first_token == int(logits.argmax())
    assert first.first.prefill_ms > 0 and first.first.model_version == backend.model_version
    assert stored.kv_id.startswith("kv1.") and stored.store_ms > 0
    async with KVClient(
        stored.kv_endpoint, KVClientConfig(kv_transfer_timeout_ms=5000, client_id="decode")
    ) as kv:
        obj = await kv.get(stored.kv_id)
        await kv.release(stored.kv_id)
    assert obj.info.size_bytes == stored.kv_bytes and stored.kv_raw_bytes == state.nbytes


async def test_whole_objects_are_written_in_process_by_the_streamed_objects_writer(
    node: PrefillNode,
) -> None:
    # Both kv.streaming modes store through one writer (LocalWriter), not a loopback Put.
    async with grpc.aio.insecure_channel(f"127.0.0.1:{node.port}") as ch:
        reply = await serving_pb2_grpc.PrefillStub(ch).Prefill(request(PROMPT), timeout=30)
    assert not reply.kv_streamed
    puts = node.kv_server.service.audit.records(event="put", kv_id=reply.kv_id)
    assert [(p["transport"], p["outcome"], p["bytes"]) for p in puts] == [
        ("local", "ok", reply.kv_bytes)
    ]
    assert node.client.records() == []  # the KV client sent nothing
    assert node.kv_server.store.used_bytes == reply.kv_bytes  # no reservation left over


async def _first_token_then_error(n: Any) -> tuple[Any, Any]:
    """Stream one prompt from prefill ``n`` (then stop it): its first chunk, then the error."""
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{n.port}") as ch:
            call = serving_pb2_grpc.PrefillStub(ch).PrefillStream(request(PROMPT), timeout=30)
            first = await call.read()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
    finally:
        await n.stop(0.5)
    return first, err


async def test_stream_reports_a_failed_put_after_the_first_token() -> None:
    n = await start(None, "kv.store_budget_bytes=4096", "kv.streaming=false")  # cannot fit
    first, err = await _first_token_then_error(n)
    assert first.HasField("first")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "KV store put" in (err.value.details() or "")
    assert "above budget" in (err.value.details() or "")


async def test_stream_reports_a_failed_client_put_after_the_first_token() -> None:
    # A sink without the store in its process Puts through the KV client, here to a stopped
    # store: the Put cannot succeed.
    n = await start(
        None, "kv.kv_transfer_timeout_ms=1500", "kv.kv_retry_budget=1", "kv.streaming=false"
    )
    try:
        assert n.servicer is not None
        n.servicer.sink = StoreSink(n.client, n.servicer.sink.endpoint)
        await n.kv_server.stop(0)
    except BaseException:
        await n.stop(0.5)
        raise
    first, err = await _first_token_then_error(n)
    assert first.HasField("first")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "KV store put" in (err.value.details() or "")
