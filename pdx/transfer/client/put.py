"""Put: whole objects in striped, resumable ranges, and streamed objects (:class:`StreamWriter`).

A whole object's ranges go on the transport its client's policy picks per attempt; a chunk
the store found corrupt is resent from that chunk, not from zero. A streamed object is
opened first (its kv_id known at once) and travels on one gRPC Put stream.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import TYPE_CHECKING

import xxhash

from pdx._proto import kv_transfer_pb2 as pb
from pdx.transfer.client.attempts import Attempts, Request, split
from pdx.transfer.client.grpc_transport import GrpcTransport
from pdx.transfer.client.transport import KVTransport, TransportPolicy
from pdx.transfer.contract import KVError, KVErrorCode, KVLayout
from pdx.transfer.objects import encode_tensors
from pdx.transfer.wire import digest64, encode_chunk, is_chunk_message, rechunk
from pdx.transfer.writer import KVWriter

if TYPE_CHECKING:
    import torch


async def put(
    attempts: Attempts,
    route: TransportPolicy,
    data: bytes | bytearray | memoryview | Sequence[torch.Tensor],
    layout: KVLayout | None,
    *,
    codec: str,
    model_version: str,
    ttl_s: int,
) -> str:
    """Store tensors (encoded with ``codec``) or ready bytes; return the new kv_id."""
    if isinstance(data, bytes | bytearray | memoryview):
        payload: bytes | bytearray | memoryview = data
        layout = layout or KVLayout(codec="")
    else:
        payload, layout = encode_tensors(data, codec, layout.roles if layout else None)
    view = memoryview(payload).cast("B")
    req = attempts.begin("put", size_bytes=len(view))
    try:
        info = await _put_object(attempts, route, req, view, layout, model_version, ttl_s)
    except KVError as exc:
        attempts.finish(req, 0, 0, exc.code.value)
        raise
    req.kv_id = info.kv_id
    attempts.finish(req, info.size_bytes, info.num_chunks, "ok")
    return info.kv_id


async def _put_object(
    attempts: Attempts,
    route: TransportPolicy,
    req: Request,
    view: memoryview,
    layout: KVLayout,
    model_version: str,
    ttl_s: int,
) -> pb.ObjectInfo:
    cfg = attempts.cfg
    size = len(view)
    chunk = cfg.chunk_size_bytes
    n = -(-size // chunk)
    header = pb.PutHeader(
        model_version=model_version,
        ttl_s=ttl_s,
        layout=layout.to_proto(),
        size_bytes=size,
        chunk_size_bytes=chunk,
        upload_token=secrets.token_bytes(16),
    )
    await route.endpoint(req)  # a transport that cannot work fails here, not retried
    ranges = split(n, cfg.streams)
    if len(ranges) == 1:
        # One stream sends every chunk in order: hash the object while streaming it
        # and send the digest last, instead of reading the whole object once first.
        header.digest_in_trailer = True
    else:
        header.object_digest = digest64(view)
    results = await asyncio.gather(
        *(
            _put_range(attempts, route, req, k, header, view, a, b)
            for k, (a, b) in enumerate(ranges)
        )
    )
    done = [r for r in results if r.missing_chunks == 0]
    if not done:
        raise KVError(KVErrorCode.KV_INTERNAL, "upload ended with chunks missing")
    return done[0].info


async def _put_range(
    attempts: Attempts,
    route: TransportPolicy,
    req: Request,
    k: int,
    header: pb.PutHeader,
    view: memoryview,
    start: int,
    end: int,
) -> pb.PutResponse:
    first = start
    hdr = pb.PutHeader()
    hdr.CopyFrom(header)
    while True:
        hdr.start_chunk = first
        sent = pb.PutHeader()
        sent.CopyFrom(hdr)

        async def once(timeout_s: float, h: pb.PutHeader = sent, a: int = first) -> pb.PutResponse:
            def move(t: KVTransport) -> Awaitable[pb.PutResponse]:
                return t.put_range(req, k, h, view, a, end, timeout_s)

            return await route.run(req, move)

        try:
            return await attempts.attempt(req, once)
        except KVError as exc:
            await attempts.before_retry(req, exc)
            if hdr.digest_in_trailer:  # a retry names the digest up front
                hdr.digest_in_trailer = False
                hdr.object_digest = digest64(view)
            if exc.code is KVErrorCode.KV_CORRUPT and exc.resume_chunk is not None:
                first = min(max(exc.resume_chunk, start), end)
                req.resumed_chunks += first - start
            else:
                first = start


async def open_stream(
    attempts: Attempts,
    grpc: GrpcTransport,
    reserve_bytes: int,
    layout: KVLayout | None,
    *,
    model_version: str,
    ttl_s: int,
) -> StreamWriter:
    """Open a streamed object of at most ``reserve_bytes`` (gRPC); its writer."""
    req = attempts.begin("put", size_bytes=reserve_bytes)
    req.transport = "grpc"
    header = pb.PutHeader(
        model_version=model_version,
        ttl_s=ttl_s,
        layout=(layout or KVLayout(codec="")).to_proto(),
        size_bytes=reserve_bytes,
        chunk_size_bytes=attempts.cfg.chunk_size_bytes,
        upload_token=secrets.token_bytes(16),
        digest_in_trailer=True,
    )
    try:
        opened = await grpc.unary(req, "Open", pb.OpenRequest(header=header), pb.OpenResponse)
    except KVError as exc:
        attempts.finish(req, 0, 0, exc.code.value)
        raise
    req.kv_id = opened.info.kv_id
    return StreamWriter(attempts, grpc, req, header)


class StreamWriter:
    """The writer of a streamed object: ``write`` bytes in order, then ``close``.

    Full chunks go out on the object's Put stream as soon as they exist. ``mark_overlap``
    records how much had been sent when the producer finished computing; ``abort`` ends
    the stream (the store then ends the object: readers get KV_INCOMPLETE).
    """

    def __init__(
        self, attempts: Attempts, grpc: GrpcTransport, req: Request, header: pb.PutHeader
    ) -> None:
        self.attempts, self.req, self.header = attempts, req, header
        self.kv_id = req.kv_id
        self.chunk = header.chunk_size_bytes
        self.reserve = header.size_bytes
        self._buf = bytearray()
        self._index = 0
        self._hash = xxhash.xxh3_64()
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.written = 0  # bytes handed to write()
        self.sent = 0  # chunk bytes handed to gRPC
        self.opened_s = time.perf_counter()
        self.overlap: tuple[int, float] | None = None
        reply = pb.PutResponse.FromString
        call = grpc.rpc(0, "stream_unary", "Put", response_deserializer=reply)
        # A derived deadline follows the producer (see pdx.transfer.path): the stream is open
        # as long as the producer keeps writing (the store ends one that stalls) and the rest
        # is bounded from the close on. An explicit one bounds the whole Put.
        self._follows = req.deadline is not None and req.deadline.source == "derived"
        left = None if self._follows else max(req.remaining_s(), 0.001)
        self._call = call(self._messages(), timeout=left, metadata=grpc.metadata)
        self._closed = False

    async def _messages(self) -> AsyncIterator[bytes]:
        yield pb.PutRequest(header=self.header).SerializeToString()
        while (message := await self._queue.get()) is not None:
            yield message
            if is_chunk_message(message):
                self.sent += min(self.chunk, len(message))

    def _emit(self, data: bytes | bytearray | memoryview) -> None:
        self._hash.update(data)
        self._queue.put_nowait(encode_chunk(self._index, data))
        self._index += 1

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append bytes; every full chunk is queued for the Put stream at once."""
        if self._closed:
            raise KVError(KVErrorCode.KV_INVALID, "write after close", kv_id=self.kv_id)
        view = memoryview(data).cast("B")
        if self.written + len(view) > self.reserve:
            raise KVError(
                KVErrorCode.KV_INVALID,
                f"{self.written + len(view)} bytes written, {self.reserve} reserved",
                kv_id=self.kv_id,
            )
        self.written += len(view)
        rechunk(self._buf, view, self.chunk, self._emit)

    def mark_overlap(self) -> None:
        """The producer finished computing: what was sent by now overlapped it."""
        self.overlap = (self.sent, (time.perf_counter() - self.opened_s) * 1e3)

    async def close(self, layout: KVLayout | None = None, tail: bytes = b"") -> pb.ObjectInfo:
        """Send the last chunk and the trailer (final size, layout, tail, digest)."""
        self._closed = True
        if self._buf or not self.written:
            self._emit(bytes(self._buf))
            self._buf.clear()
        trailer = pb.PutTrailer(object_digest=self._hash.intdigest(), size_bytes=self.written,
                                tail=tail)  # fmt: skip
        if layout is not None:
            trailer.layout.CopyFrom(layout.to_proto())
        self._queue.put_nowait(pb.PutRequest(trailer=trailer).SerializeToString())
        self._queue.put_nowait(None)
        req = self.req
        if self._follows and req.deadline is not None:
            req.deadline_s = time.monotonic() + req.deadline.ms / 1000
        try:
            reply = await self.attempts.attempt(req, lambda _t: self._call)
        except KVError as exc:
            self.attempts.finish(req, 0, 0, exc.code.value, streamed=True)
            raise
        if reply.missing_chunks:
            short = KVError(KVErrorCode.KV_INTERNAL, "streamed object closed with chunks missing",
                            kv_id=self.kv_id)  # fmt: skip
            self.attempts.finish(req, 0, 0, short.code.value, streamed=True)
            raise short
        ob, oms = self.overlap if self.overlap is not None else (None, None)
        self.attempts.finish(req, reply.info.size_bytes, reply.info.num_chunks, "ok",
                             streamed=True, overlap_bytes=ob,
                             overlap_ms=round(oms, 3) if oms is not None else None)  # fmt: skip
        return reply.info

    def abort(self) -> None:
        """Stop writing: the stream is cancelled and the store ends the object."""
        if not self._call.done():
            self._call.cancel()
            self.attempts.finish(self.req, 0, 0, "cancelled", streamed=True)


_writer: type[KVWriter] = StreamWriter  # mypy checks that it implements KVWriter
