"""Get: whole objects in striped, resumable ranges, and objects still being written.

Every chunk and the object digest are verified (:mod:`pdx.transfer.objects`); a corrupt
chunk is re-fetched from that chunk, not from zero. A streamed Get (:class:`StreamedGet`)
travels on gRPC and receives chunks as the writer stores them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pdx._proto import kv_transfer_pb2 as pb
from pdx.transfer.client.attempts import Attempts, Request, split
from pdx.transfer.client.grpc_transport import GrpcTransport
from pdx.transfer.client.transport import GrpcOnly, KVTransport, TransportPolicy
from pdx.transfer.contract import KVError, KVErrorCode
from pdx.transfer.metrics import TransferRecord
from pdx.transfer.objects import Assembly, KVObject, StreamAssembly
from pdx.transfer.path import WRITER_IDLE_S


@dataclass
class StreamedGet:
    """What :meth:`KVClient.get_streamed` fetched, and how much of it streamed while written."""

    obj: KVObject
    record: TransferRecord
    bytes_while_writing: int  # stored only after the Get began
    wait_ms: float  # from the first info to the closed object's info


async def get(
    attempts: Attempts,
    route: TransportPolicy,
    grpc: GrpcTransport,
    kv_id: str,
    *,
    size_hint: int | None,
) -> KVObject:
    """Fetch and verify a whole object; ``size_hint`` sizes a derived deadline."""
    req = attempts.begin("get", kv_id, size_bytes=size_hint)
    try:
        obj = await _get_object(attempts, route, grpc, req, kv_id)
    except KVError as exc:
        attempts.finish(req, 0, 0, exc.code.value)
        raise
    attempts.finish(req, obj.info.size_bytes, obj.info.num_chunks, "ok")
    return obj


async def _get_object(
    attempts: Attempts, route: TransportPolicy, grpc: GrpcTransport, req: Request, kv_id: str
) -> KVObject:
    got = Assembly(kv_id)
    await route.endpoint(req)  # a transport that cannot work fails here, not retried
    ranges = [(0, 0)]
    streams = attempts.cfg.streams
    if streams > 1:
        stat = await grpc.unary(req, "Stat", pb.StatRequest(kv_id=kv_id), pb.StatResponse)
        got.accept_info(stat.info)
        ranges = split(stat.info.num_chunks, streams)
    await asyncio.gather(
        *(_get_range(attempts, route, req, k, got, a, b) for k, (a, b) in enumerate(ranges))
    )
    return got.finish()


async def _get_range(
    attempts: Attempts,
    route: TransportPolicy,
    req: Request,
    k: int,
    got: Assembly,
    start: int,
    end: int,
) -> None:
    state = {"next": start}

    async def once(timeout_s: float) -> None:
        def move(t: KVTransport) -> Awaitable[None]:
            return t.get_range(req, k, got, state, end, timeout_s)

        await route.run(req, move)

    while True:
        epoch = req.epoch
        try:
            await attempts.attempt(req, once)
            return
        except KVError as exc:
            if exc.code is KVErrorCode.KV_CORRUPT:
                attempts.metrics.corrupt.labels(side="client").inc()
            if exc.code is KVErrorCode.KV_TIMEOUT and req.epoch != epoch:
                # The ranges of one Get share its deadline: a sibling's timeout already granted
                # the new one (and spent the retry), so this range resumes under it.
                req.resumed_chunks += state["next"] - start
                continue
            if exc.code is KVErrorCode.KV_TIMEOUT:
                attempts.timed_out(req, got.received_bytes())
            await attempts.before_retry(req, exc)
            if exc.code in (KVErrorCode.KV_CORRUPT, KVErrorCode.KV_TIMEOUT):
                req.resumed_chunks += state["next"] - start


async def get_streamed(
    attempts: Attempts,
    grpc: GrpcTransport,
    kv_id: str,
    *,
    size_hint: int | None,
    on_chunk: Callable[[pb.ObjectInfo, memoryview], None] | None,
) -> StreamedGet:
    """Fetch an object that may still be written, chunks as they are stored (gRPC)."""
    req = attempts.begin("get", kv_id, size_bytes=size_hint)
    req.transport = "grpc"
    got = StreamAssembly(kv_id, on_chunk)
    try:
        if req.deadline is not None and req.deadline.source == "derived":
            await _follow_writer(attempts, grpc, req, got)
        else:  # an explicit kv_transfer_timeout_ms bounds the whole Get, writer included
            await _get_range(attempts, GrpcOnly(grpc), req, 0, got, 0, 0)
        obj = got.finish()
    except KVError as exc:
        attempts.finish(req, 0, 0, exc.code.value)
        raise
    chunk = obj.info.chunk_size_bytes
    late = max(0, int(obj.info.size_bytes) - got.stored_at_start * chunk)
    wait_ms = (got.closed_s - got.first_s) * 1e3 if got.closed_s and got.first_s else 0.0
    n = obj.info.num_chunks
    rec = attempts.finish(
        req, obj.info.size_bytes, n, "ok", streamed=True, overlap_bytes=late,
        overlap_ms=round(wait_ms, 3),
    )  # fmt: skip
    return StreamedGet(obj, rec, late, wait_ms)


async def _follow_writer(
    attempts: Attempts, grpc: GrpcTransport, req: Request, got: StreamAssembly
) -> None:
    """A streamed Get on a derived deadline: while the object is written the deadline
    follows the writer (``WRITER_IDLE_S`` plus the derived deadline past its last chunk);
    from the close on, the derived deadline bounds the rest."""
    assert req.deadline is not None
    state = {"next": 0}
    idle_s = WRITER_IDLE_S + req.deadline.ms / 1000

    async def once(_timeout_s: float) -> None:
        await grpc.get_streamed(req, got, state, idle_s)

    while True:
        try:
            await attempts.attempt(req, once, self_timed=True)
            return
        except KVError as exc:
            if exc.code is KVErrorCode.KV_CORRUPT:
                attempts.metrics.corrupt.labels(side="client").inc()
            await attempts.before_retry(req, exc)
