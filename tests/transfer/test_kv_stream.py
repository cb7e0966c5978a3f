"""Streamed objects (rpc Open): read while written, ended by a writer that dies or stalls."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from pdx._proto import kv_transfer_pb2 as pb
from pdx.transfer.client import KVClient
from pdx.transfer.contract import KVError, KVErrorCode, KVLayout
from pdx.transfer.wire import encode_chunk

CHUNK = 64 * 1024


async def _write_slowly(writer, data: bytes, pieces: int, pause_s: float) -> None:
    step = -(-len(data) // pieces)
    for a in range(0, len(data), step):
        writer.write(data[a : a + step])
        await asyncio.sleep(pause_s)


async def test_get_streams_an_object_while_it_is_written(kv_server_factory, kv_client_cfg) -> None:
    server, target = await kv_server_factory()
    data = os.urandom(10 * CHUNK + 1234)  # a short last chunk
    reserve = len(data) + 5 * CHUNK  # an upper bound, as a lossless codec declares
    layout = KVLayout(codec="zstd", tensor_bytes=[len(data)])
    async with KVClient(target, kv_client_cfg()) as kv:
        writer = await kv.open(reserve, KVLayout(codec="zstd"), model_version="m1")
        assert server.store.used_bytes == reserve  # reserved up front
        reading = asyncio.ensure_future(kv.get_streamed(writer.kv_id))
        await _write_slowly(writer, data, 10, 0.03)
        writer.mark_overlap()
        info = await writer.close(layout, tail=b"first-token")
        got = await reading
    assert bytes(got.obj.data) == data
    assert info.size_bytes == len(data) and not info.writing
    assert got.obj.info.tail == b"first-token" and list(got.obj.info.layout.tensor_bytes) == [
        len(data)
    ]
    # The Get began before most of the object existed, and waited on the writer.
    assert got.bytes_while_writing > len(data) // 2
    assert got.wait_ms > 100
    assert server.store.used_bytes == len(data)  # the unused reservation was freed
    put = next(r for r in kv.records() if r.op == "put")
    assert put.streamed and put.overlap_bytes is not None and put.overlap_bytes > len(data) // 2
    get = next(r for r in kv.records() if r.op == "get")
    assert get.streamed and get.outcome == "ok" and get.overlap_bytes == got.bytes_while_writing
    events = [e["event"] for e in server.store.audit.records()]
    assert events.index("open") < events.index("put")


async def test_closed_streamed_object_reads_like_any_other(
    kv_server_factory, kv_client_cfg
) -> None:
    _, target = await kv_server_factory()
    data = os.urandom(3 * CHUNK)
    async with KVClient(target, kv_client_cfg()) as kv:
        writer = await kv.open(len(data), model_version="m1")
        writer.write(data)
        await writer.close()
        obj = await kv.get(writer.kv_id)  # both transports, the object is closed
        assert bytes(obj.data) == data
        assert bytes((await kv.get_streamed(writer.kv_id)).obj.data) == data


async def test_data_plane_get_waits_for_the_close(kv_server_factory, kv_client_cfg) -> None:
    _, target = await kv_server_factory()
    data = os.urandom(4 * CHUNK)
    async with KVClient(target, kv_client_cfg(transport="data")) as kv:
        writer = await kv.open(len(data))
        writer.write(data[:CHUNK])
        reading = asyncio.ensure_future(kv.get(writer.kv_id))
        await asyncio.sleep(0.2)
        assert not reading.done()
        writer.write(data[CHUNK:])
        await writer.close()
        assert bytes((await reading).data) == data


async def test_writer_that_stops_ends_the_object_readers_get_kv_incomplete(
    kv_server_factory, kv_client_cfg
) -> None:
    server, target = await kv_server_factory()
    async with KVClient(target, kv_client_cfg(kv_retry_budget=2)) as kv:
        writer = await kv.open(8 * CHUNK)
        writer.write(os.urandom(3 * CHUNK))
        reading = asyncio.ensure_future(kv.get_streamed(writer.kv_id))
        await asyncio.sleep(0.2)
        t0 = time.perf_counter()
        writer.abort()
        with pytest.raises(KVError) as err:
            await reading
        assert err.value.code is KVErrorCode.KV_INCOMPLETE  # not retried, not a hang
        assert time.perf_counter() - t0 < 2.0
        assert server.store.used_bytes == 0  # the partial object's reservation is freed
        with pytest.raises(KVError) as late:
            await kv.get_streamed(writer.kv_id)
        assert late.value.code is KVErrorCode.KV_INCOMPLETE
    abandon = [e for e in server.store.audit.records() if e["event"] == "abandon"]
    assert abandon and abandon[0]["kv_id"] == writer.kv_id


async def test_stalled_writer_reader_times_out_then_store_ends_it(
    kv_server_factory, kv_client_cfg
) -> None:
    server, target = await kv_server_factory(stall_timeout_s=1.5, sweep_interval_s=0.2)
    async with KVClient(target, kv_client_cfg(kv_transfer_timeout_ms=3000)) as writer_kv:
        writer = await writer_kv.open(8 * CHUNK)
        writer.write(os.urandom(2 * CHUNK))  # then nothing: the writer stalls
        cfg = kv_client_cfg(kv_transfer_timeout_ms=600, kv_retry_budget=0)
        async with KVClient(target, cfg) as reader:
            t0 = time.perf_counter()
            with pytest.raises(KVError) as err:
                await reader.get_streamed(writer.kv_id)
            assert err.value.code is KVErrorCode.KV_TIMEOUT
            assert 0.5 < time.perf_counter() - t0 < 2.0  # at its deadline
            await asyncio.sleep(2.5)  # past the store's stall timeout
            assert server.store.used_bytes == 0
            with pytest.raises(KVError) as ended:
                await reader.get_streamed(writer.kv_id)
            assert ended.value.code is KVErrorCode.KV_INCOMPLETE
        writer.abort()


async def test_a_derived_deadline_follows_a_writer_slower_than_it(
    kv_server_factory, kv_client_cfg
) -> None:
    # A warm reader's derived deadline for a small object is ~300 ms; a writer that takes 1.6 s
    # (a long prefill) but keeps storing chunks is waited for. The same writer stalling is
    # ended by the store's sweep: the reader gets KV_INCOMPLETE, not a hang.
    _server, target = await kv_server_factory(stall_timeout_s=1.0, sweep_interval_s=0.2)
    data = os.urandom(4 * CHUNK)
    async with KVClient(target, kv_client_cfg(kv_transfer_timeout_ms=None)) as kv:
        warm = await kv.put(os.urandom(CHUNK))  # the path is now warm: no set-up allowance
        await kv.get(warm)
        writer = await kv.open(len(data))
        reading = asyncio.ensure_future(kv.get_streamed(writer.kv_id))
        await _write_slowly(writer, data, 4, 0.4)
        await writer.close()
        got = await reading
        get = [r for r in kv.records() if r.op == "get"][-1]
        assert get.outcome == "ok" and bytes(got.obj.data) == data
        assert get.deadline_ms is not None and get.deadline_ms < 1000 < got.wait_ms
        stalled = await kv.open(len(data))
        stalled.write(data[: 2 * CHUNK])  # then nothing
        t0 = time.perf_counter()
        with pytest.raises(KVError) as err:
            await kv.get_streamed(stalled.kv_id)
        assert err.value.code is KVErrorCode.KV_INCOMPLETE
        assert time.perf_counter() - t0 < 5
        stalled.abort()


_KILLED_WRITER = """
import asyncio, os, sys, time
from pdx.transfer.client import KVClient
from pdx.transfer.contract import KVClientConfig

async def main():
    kv = KVClient(sys.argv[1], KVClientConfig(chunk_size_kb=64, kv_transfer_timeout_ms=30000))
    w = await kv.open(64 * 65536)
    print(w.kv_id, flush=True)
    while True:
        w.write(os.urandom(65536))
        await asyncio.sleep(0.05)

asyncio.run(main())
"""


async def test_writer_process_killed_mid_put_is_kv_incomplete(
    kv_server_factory, kv_client_cfg
) -> None:
    server, target = await kv_server_factory()
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, target], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        kv_id = (await asyncio.to_thread(proc.stdout.readline)).strip()
        cfg = kv_client_cfg(kv_transfer_timeout_ms=20000)
        async with KVClient(target, cfg) as reader:
            reading = asyncio.ensure_future(reader.get_streamed(kv_id))
            await asyncio.sleep(0.5)
            assert not reading.done()
            proc.kill()
            t0 = time.perf_counter()
            with pytest.raises(KVError) as err:
                await reading
    finally:
        proc.kill()
        proc.wait()
    assert err.value.code is KVErrorCode.KV_INCOMPLETE
    assert time.perf_counter() - t0 < 5.0  # the broken stream ends it, not the deadline
    assert server.store.used_bytes == 0


async def test_open_reserves_the_declared_size_against_the_budget(
    kv_server_factory, kv_client_cfg
) -> None:
    server, target = await kv_server_factory(
        budget_bytes=10 * CHUNK, max_open_bytes_per_peer=9 * CHUNK
    )
    async with KVClient(target, kv_client_cfg(kv_retry_budget=0)) as kv:
        first = await kv.open(7 * CHUNK)
        with pytest.raises(KVError) as full:
            await kv.open(7 * CHUNK)
        assert full.value.code is KVErrorCode.KV_STORE_FULL
        with pytest.raises(KVError) as big:
            await kv.open(11 * CHUNK)
        assert big.value.code is KVErrorCode.KV_INVALID
        first.abort()
        await asyncio.sleep(0.2)
        assert server.store.used_bytes == 0
        second = await kv.open(7 * CHUNK)  # the freed reservation fits again
        second.write(b"x" * 100)
        await second.close()


async def test_hostile_writers_are_refused(kv_server_factory, kv_client_cfg) -> None:
    server, target = await kv_server_factory()
    async with KVClient(target, kv_client_cfg(kv_retry_budget=0)) as kv:
        w = await kv.open(2 * CHUNK)
        with pytest.raises(KVError) as over:
            w.write(b"x" * (3 * CHUNK))  # more than it reserved
        assert over.value.code is KVErrorCode.KV_INVALID
        w.write(b"x" * 100)
        with pytest.raises(KVError) as tail:
            await w.close(tail=b"t" * 5000)  # a tail above 4096 bytes
        assert tail.value.code is KVErrorCode.KV_INVALID
        assert server.store.used_bytes == 0
        # A raw Put stream that sends a chunk past a short (last) chunk.
        w2 = await kv.open(4 * CHUNK)
        hdr = _fresh(w2.header)  # a fresh object, written by hand
        await kv._unary(kv._begin("put"), "Open", pb.OpenRequest(header=hdr), pb.OpenResponse)
        call = kv._rpc(0, "stream_unary", "Put", response_deserializer=pb.PutResponse.FromString)

        async def messages():
            yield pb.PutRequest(header=hdr).SerializeToString()
            yield encode_chunk(0, b"a" * 100)
            yield encode_chunk(1, b"b" * 100)

        with pytest.raises(Exception) as bad:
            await call(messages(), timeout=5)
        assert "KV_CORRUPT" in str(bad.value)
        await asyncio.sleep(0.1)
        assert server.store.used_bytes == w2.reserve  # only w2's reservation is left
        w2.write(b"y" * 10)
        await w2.close()
    assert json.dumps(server.store.audit.records()[-1])  # audited, JSON-ready


def _fresh(header: pb.PutHeader) -> pb.PutHeader:
    h = pb.PutHeader()
    h.CopyFrom(header)
    h.upload_token = os.urandom(16)
    return h


async def test_one_peer_cannot_reserve_the_whole_budget_in_open_objects(
    kv_server_factory, kv_client_cfg
) -> None:
    # 10 chunks per peer; a writer cancelled before the store saw its stream is ended by
    # the stall sweep
    server, target = await kv_server_factory(
        budget_bytes=20 * CHUNK, stall_timeout_s=0.5, sweep_interval_s=0.1
    )
    async with KVClient(target, kv_client_cfg(kv_retry_budget=0)) as kv:
        held = [await kv.open(4 * CHUNK), await kv.open(4 * CHUNK)]
        with pytest.raises(KVError) as err:
            await kv.open(4 * CHUNK)  # 12 of 10 chunks: refused, though the budget has room
        assert err.value.code is KVErrorCode.KV_STORE_FULL
        assert "max_open_bytes_per_peer" in err.value.message
        held[0].write(os.urandom(CHUNK))
        await held[0].close()  # closed: no longer counted against the peer
        again = await kv.open(4 * CHUNK)
        for w in (held[1], again):
            w.abort()
        await asyncio.sleep(1.0)
    assert server.store.used_bytes == CHUNK and not server.store._open_bytes
