"""The object digest sent last (PutTrailer): checked like a header digest, never skipped."""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator

import grpc
import pytest
import xxhash

from pdx._proto import kv_transfer_pb2 as pb
from pdx.transfer.client import KVClient
from pdx.transfer.contract import KVError, KVErrorCode
from pdx.transfer.rpc import map_rpc_error
from pdx.transfer.wire import encode_chunk

CHUNK = 64 * 1024


def _header(data: bytes, **kw: object) -> bytes:
    head = pb.PutHeader(
        model_version="m",
        size_bytes=len(data),
        chunk_size_bytes=CHUNK,
        upload_token=secrets.token_bytes(16),
        **kw,  # type: ignore[arg-type]
    )
    return pb.PutRequest(header=head).SerializeToString()


def _chunks(data: bytes) -> list[bytes]:
    return [encode_chunk(i, data[a : a + CHUNK]) for i, a in enumerate(range(0, len(data), CHUNK))]


def _trailer(digest: int) -> bytes:
    return pb.PutRequest(trailer=pb.PutTrailer(object_digest=digest)).SerializeToString()


async def _raw_put(target: str, kv_client_cfg, messages: list[bytes]) -> KVError:
    """Send hand-made Put messages; return the contract error the store answered with."""
    async with KVClient(target, kv_client_cfg()) as c:
        call = c._rpc(0, "stream_unary", "Put")

        async def stream() -> AsyncIterator[bytes]:
            for m in messages:
                yield m

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(stream(), timeout=5)
    return map_rpc_error(err.value)


async def test_client_put_sends_digest_last_and_store_checks_it(
    kv_server_factory, kv_client_cfg
) -> None:
    _, target = await kv_server_factory()
    data = os.urandom(300_000)
    async with KVClient(target, kv_client_cfg(streams=1)) as kv:
        kv_id = await kv.put(data)
        obj = await kv.get(kv_id)
    assert obj.data == data
    assert obj.info.object_digest == xxhash.xxh3_64_intdigest(data)


async def test_wrong_trailer_digest_is_kv_corrupt_and_object_never_readable(
    kv_server_factory, kv_client_cfg
) -> None:
    server, target = await kv_server_factory()
    data = os.urandom(200_000)
    bad = xxhash.xxh3_64_intdigest(data) ^ 1
    msgs = [_header(data, digest_in_trailer=True), *_chunks(data), _trailer(bad)]
    err = await _raw_put(target, kv_client_cfg, msgs)
    assert err.code is KVErrorCode.KV_CORRUPT and "object digest" in err.message
    assert server.store.used_bytes == 0
    assert server.audit.records(event="put", outcome="KV_CORRUPT")


async def test_announced_trailer_missing_is_rejected(kv_server_factory, kv_client_cfg) -> None:
    server, target = await kv_server_factory()
    data = os.urandom(200_000)
    err = await _raw_put(
        target, kv_client_cfg, [_header(data, digest_in_trailer=True), *_chunks(data)]
    )
    assert err.code is KVErrorCode.KV_INVALID and "trailer" in err.message
    assert server.store.used_bytes == 0


async def test_unannounced_or_misplaced_trailer_is_rejected(
    kv_server_factory, kv_client_cfg
) -> None:
    _, target = await kv_server_factory()
    data = os.urandom(200_000)
    digest = xxhash.xxh3_64_intdigest(data)
    chunks = _chunks(data)
    unannounced = [_header(data, object_digest=digest), *chunks, _trailer(digest)]
    err = await _raw_put(target, kv_client_cfg, unannounced)
    assert err.code is KVErrorCode.KV_CORRUPT
    garbled = [_header(data, digest_in_trailer=True), chunks[0], b"\xff" * 40]
    err = await _raw_put(target, kv_client_cfg, garbled)
    assert err.code is KVErrorCode.KV_CORRUPT and err.resume_chunk == 1
    early = [_header(data, digest_in_trailer=True), chunks[0], _trailer(digest), *chunks[1:]]
    err = await _raw_put(target, kv_client_cfg, early)
    assert err.code is KVErrorCode.KV_CORRUPT and err.resume_chunk == 1


async def test_trailer_header_must_start_at_zero_without_digest(
    kv_server_factory, kv_client_cfg
) -> None:
    _, target = await kv_server_factory()
    data = os.urandom(100_000)
    msgs = [_header(data, digest_in_trailer=True, object_digest=5), *_chunks(data)]
    err = await _raw_put(target, kv_client_cfg, msgs)
    assert err.code is KVErrorCode.KV_INVALID and "digest_in_trailer" in err.message


def test_a_status_lost_to_a_failed_write_is_retryable() -> None:
    """grpc.aio reports its own failed write (INTERNAL) when the server ended the stream first
    (a refused Put): the server's answer is lost, so it maps to a retryable KV_UNAVAILABLE;
    a real INTERNAL from the server stays KV_INTERNAL."""
    empty = grpc.aio.Metadata()
    write = 'Failed "execute_batch": (<grpc._cython.cygrpc.SendMessageOperation object>,)'
    lost = grpc.aio.AioRpcError(
        grpc.StatusCode.INTERNAL, empty, empty, "Internal error from Core", write
    )
    assert map_rpc_error(lost).code is KVErrorCode.KV_UNAVAILABLE and map_rpc_error(lost).retryable
    real = grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, empty, empty, "disk on fire", "")
    assert map_rpc_error(real).code is KVErrorCode.KV_INTERNAL
