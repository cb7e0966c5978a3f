"""The KV store's RPC handlers: Put/Get/Release/Renew/Stat/DataPlane over one store.

Chunk messages travel as raw bytes (see :mod:`pdx.transfer.wire`): the service parses them
without copying and streams stored messages back unchanged. The same service also serves
Put and Get on the data plane (:class:`pdx.transfer.dataplane.server.DataServer`, announced
by the DataPlane call) through :meth:`KVService.data_put` and :meth:`KVService.data_get`.
Errors are mapped to gRPC in :mod:`pdx.transfer.rpc`; the server lifecycle is in
:mod:`pdx.transfer.server`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from pdx._proto import kv_transfer_pb2 as pb
from pdx.tcp import available_congestion_controls
from pdx.transfer.audit import digest_hex
from pdx.transfer.contract import (
    CLIENT_ID_METADATA_KEY,
    MAX_KV_ID_CHARS,
    KVError,
    KVErrorCode,
    KVStoreConfig,
    parse_kv_id,
)
from pdx.transfer.dataplane.framing import BUFFERS
from pdx.transfer.dataplane.handoff import GetOutcome, Handoff, PutOutcome
from pdx.transfer.dataplane.server import DataServer
from pdx.transfer.rpc import SERVICE_NAME
from pdx.transfer.store import KVStore, StoredObject
from pdx.transfer.wire import is_chunk_message, parse_chunk

log = logging.getLogger(__name__)


def peer_identity(context: grpc.aio.ServicerContext) -> str:
    """Who is calling: the mTLS certificate's common name, else the declared client id."""
    auth = context.auth_context() or {}
    cn = auth.get("x509_common_name")
    if cn:
        return "cn=" + cn[0].decode(errors="replace")
    for key, value in context.invocation_metadata() or ():
        if key == CLIENT_ID_METADATA_KEY:
            return "client=" + str(value)[:128]
    return "anonymous"


def checked_kv_id(kv_id: str) -> str:
    """``kv_id`` if it is well-formed; else KV_INVALID (before anything stores or logs it)."""
    if len(kv_id) > MAX_KV_ID_CHARS:
        raise KVError(KVErrorCode.KV_INVALID, f"kv_id of {len(kv_id)} characters")
    parse_kv_id(kv_id)
    return kv_id


def holder(op: _Op) -> str:
    """Whose transfer slots an operation counts against: a certificate identity, else the
    peer's address (a declared client id costs nothing to change)."""
    if op.who.startswith("cn="):
        return op.who
    return op.peer.rsplit(":", 1)[0] if op.peer.count(":") >= 2 else op.peer


@dataclass
class _Op:
    """One audited operation in flight."""

    event: str
    who: str
    peer: str
    kv_id: str = ""
    bytes: int = 0
    start_s: float = field(default_factory=time.perf_counter)
    extra: dict[str, Any] = field(default_factory=dict)
    outcome: str | None = None  # set when the call ended otherwise than its code says
    recorded: int | None = None  # bytes in the record already written (a Get's, as it ends)


class KVService:
    """The RPC handlers over one :class:`KVStore`."""

    def __init__(self, store: KVStore, cfg: KVStoreConfig) -> None:
        self.store = store
        self.cfg = cfg
        self.audit = store.audit
        self.metrics = store.metrics
        self._slots = asyncio.Semaphore(cfg.max_inflight_kv)
        self._held: dict[str, int] = {}  # slots per peer
        self._peer_cv = asyncio.Condition()
        self.data_server: DataServer | None = None

    # --- plumbing ---------------------------------------------------------------------

    def _audited(self, event: str, context: grpc.aio.ServicerContext) -> Any:
        return self._audit_op(event, peer_identity(context), context.peer())

    @contextlib.asynccontextmanager
    async def _audit_op(self, event: str, who: str, peer: str, **extra: Any) -> AsyncIterator[_Op]:
        op = _Op(event, who, peer, extra=dict(extra))
        outcome = "ok"
        try:
            yield op
        except KVError as exc:
            outcome = exc.code.value
            self.metrics.errors.labels(code=outcome, side="store").inc()
            op.extra.setdefault("reason", exc.message)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        except Exception:
            outcome = KVErrorCode.KV_INTERNAL.value
            raise
        finally:
            self._record(op, op.outcome or outcome)

    def _record(self, op: _Op, outcome: str) -> None:
        """Write ``op``'s audit record, once. A Get writes it just before its last chunk
        leaves (:meth:`_sent`), so the log holds every byte a client can have read even if
        the store dies a moment later; if that last send then fails, a second record of the
        failure follows (bytes 0: the first one counted them)."""
        nbytes, extra = op.bytes, op.extra
        if op.recorded is not None:
            if outcome == "ok":
                return
            nbytes, extra = 0, {**op.extra, "recorded_bytes": op.recorded}
        ms = (time.perf_counter() - op.start_s) * 1000
        self.audit.record(
            op.event,
            who=op.who,
            peer=op.peer,
            kv_id=op.kv_id or None,
            bytes=nbytes,
            outcome=outcome,
            ms=round(ms, 3),
            **extra,
        )
        op.recorded = op.bytes

    def _sent(self, op: _Op, chunks: int, start: float) -> None:
        """A Get's last message is about to leave: count its bytes and write its record now
        (thread-safe: a data-plane connection thread calls it too)."""
        self._count("get", op.bytes, chunks, start)
        self._record(op, "ok")

    def _slot(self, context: grpc.aio.ServicerContext, op: _Op) -> Any:
        return self._slot_wait(self._time_left(context.time_remaining()), holder(op))

    def _time_left(self, remaining: float | None) -> float:
        """A call's time: its own deadline, never more than ``max_request_timeout_ms``."""
        cap = self.cfg.max_request_timeout_ms / 1000
        return cap if remaining is None else min(remaining, cap)

    @contextlib.asynccontextmanager
    async def _slot_wait(self, remaining: float | None, who: str) -> AsyncIterator[None]:
        """``max_inflight_kv`` back-pressure: wait (bounded by the call's deadline) or refuse.

        One peer holds at most ``inflight_per_peer`` slots (it waits for its own to free
        like any other), so a peer that stalls its transfers cannot take the slots every
        other client needs.
        """
        cap = self.cfg.inflight_per_peer
        wait_s = self.cfg.inflight_wait_ms / 1000
        if remaining is not None:
            wait_s = min(wait_s, max(remaining, 0.0))
        async with self._peer_cv:
            try:
                if self._held.get(who, 0) >= cap:
                    await asyncio.wait_for(
                        self._peer_cv.wait_for(lambda: self._held.get(who, 0) < cap), wait_s
                    )
            except TimeoutError:
                raise KVError(
                    KVErrorCode.KV_OVERLOADED,
                    f"{self._held.get(who, 0)} transfers of {who} in flight (at most {cap} "
                    "per peer)",
                ) from None
            self._held[who] = self._held.get(who, 0) + 1
        try:
            async with self._global_slot(remaining):
                yield
        finally:
            async with self._peer_cv:
                self._held[who] -= 1
                if not self._held[who]:
                    del self._held[who]
                self._peer_cv.notify_all()

    @contextlib.asynccontextmanager
    async def _global_slot(self, remaining: float | None) -> AsyncIterator[None]:
        wait_s = self.cfg.inflight_wait_ms / 1000
        if remaining is not None:
            wait_s = min(wait_s, max(remaining, 0.0))
        try:
            if self._slots.locked():
                if wait_s <= 0:
                    raise TimeoutError
                await asyncio.wait_for(self._slots.acquire(), timeout=wait_s)
            else:
                await self._slots.acquire()
        except TimeoutError:
            raise KVError(
                KVErrorCode.KV_OVERLOADED,
                f"{self.cfg.max_inflight_kv} transfers in flight (max_inflight_kv)",
            ) from None
        gauge = self.metrics.inflight.labels(side="store")
        gauge.inc()
        try:
            yield
        finally:
            gauge.dec()
            self._slots.release()

    # --- handlers ---------------------------------------------------------------------

    async def put(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> pb.PutResponse:
        """Client-streaming upload: a header, then chunks in order from ``start_chunk``."""
        async with self._audited("put", context) as op, self._slot(context, op):
            left = self._time_left(context.time_remaining())
            try:
                async with asyncio.timeout(left):
                    stalled = self._stall_guarded(requests)
                    first = await anext(stalled, None)
                    if first is None or is_chunk_message(first):
                        raise KVError(
                            KVErrorCode.KV_INVALID, "a Put stream must start with a header"
                        )
                    try:
                        header = pb.PutRequest.FromString(first).header
                    except DecodeError:
                        raise KVError(
                            KVErrorCode.KV_INVALID, "Put header: not a PutRequest"
                        ) from None
                    reply = await self._upload(
                        op, header, lambda obj: self._receive(obj, header.start_chunk, stalled)
                    )
            except TimeoutError:
                raise KVError(
                    KVErrorCode.KV_TIMEOUT, f"Put took longer than its {left:g} s", kv_id=op.kv_id
                ) from None
            if context.cancelled() or (header.digest_in_trailer and reply.missing_chunks):
                # A cancelled call just ends the request stream here; a stream that promised
                # a trailer and stopped short of it did not finish: it was cancelled or cut.
                op.outcome = "cancelled"
                op.extra["reason"] = "the stream ended before its last chunk and trailer"
            return reply

    async def _stall_guarded(self, requests: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The messages of a client stream, ended by KV_TIMEOUT when one takes longer than
        ``stall_timeout_s`` to arrive (a stalled upload frees its slot and reservation)."""
        stall = self.cfg.stall_timeout_s
        iterator = aiter(requests)
        while True:
            try:
                raw = await asyncio.wait_for(anext(iterator), stall)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise KVError(KVErrorCode.KV_TIMEOUT, f"no progress for {stall:g} s") from None
            yield raw

    async def _upload(
        self, op: _Op, header: pb.PutHeader, receive: Callable[[StoredObject], Awaitable[int]]
    ) -> pb.PutResponse:
        """Start (or rejoin) an upload, let ``receive`` fill it, then complete it if whole.

        ``receive`` returns the payload bytes it took; if it fails, an upload nobody can
        rejoin is dropped. Shared by the gRPC and the data-plane Put.
        """
        obj = self.store.begin_put(header, op.who)
        op.kv_id = obj.kv_id
        op.extra["start_chunk"] = header.start_chunk
        try:
            op.bytes = await receive(obj)
        except BaseException:
            self.store.abandon(obj, "upload failed")
            raise
        try:
            missing = self.store.finish_put(obj)
        finally:
            if obj.writing:  # the only stream of a streamed object ended before closing it
                self.store.end_writing(obj, "the Put stream ended before its trailer")
        op.extra["missing_chunks"] = missing
        return pb.PutResponse(info=self.store.info(obj), missing_chunks=missing)

    async def _receive(self, obj: StoredObject, index: int, requests: AsyncIterator[bytes]) -> int:
        received = 0
        start = time.perf_counter()
        trailer = False
        async for raw in requests:
            if trailer or not is_chunk_message(raw):
                trailer = self._trailer(obj, raw, trailer, index)
                continue
            try:
                chunk = parse_chunk(raw)
            except ValueError as exc:
                raise KVError(
                    KVErrorCode.KV_CORRUPT,
                    f"chunk {index}: {exc}",
                    kv_id=obj.kv_id,
                    resume_chunk=index,
                ) from None
            if chunk.index != index:
                raise KVError(
                    KVErrorCode.KV_CORRUPT,
                    f"chunk index {chunk.index}, expected {index}",
                    kv_id=obj.kv_id,
                    resume_chunk=index,
                )
            self.store.put_chunk(obj, chunk, raw)
            received += len(chunk.data)
            index += 1
        self._count("put", received, index, start)
        return received

    def _trailer(self, obj: StoredObject, raw: bytes, seen: bool, index: int) -> bool:
        """Take the object digest from a ``PutTrailer``: announced, once, and last."""
        try:
            msg = pb.PutRequest.FromString(raw)
        except DecodeError:  # a garbled message: judged below like any non-trailer
            msg = pb.PutRequest()
        if seen or not obj.digest_pending or msg.WhichOneof("msg") != "trailer":
            raise KVError(
                KVErrorCode.KV_CORRUPT,
                f"chunk {index}: not a chunk message",
                kv_id=obj.kv_id,
                resume_chunk=index,
            )
        if obj.writing:
            self.store.close_streamed(obj, msg.trailer)
        else:
            self.store.set_object_digest(obj, msg.trailer.object_digest)
        return True

    async def get(
        self, request: pb.GetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        """Server-streaming read: info, then stored chunk messages from ``from_chunk``."""
        async with self._audited("get", context) as op:
            op.kv_id = checked_kv_id(request.kv_id)
            left = self._time_left(context.time_remaining())
            async with self._slot(context, op):
                try:
                    async with asyncio.timeout(left):
                        async for message in self._stream(op, request):
                            yield message
                except TimeoutError:
                    raise KVError(
                        KVErrorCode.KV_TIMEOUT, f"Get took longer than {left:g} s", kv_id=op.kv_id
                    ) from None

    async def _stream(self, op: _Op, request: pb.GetRequest) -> AsyncIterator[bytes]:
        obj = self.store.lookup_any(request.kv_id)
        self.store.check_reader(obj, op.who)
        if obj.writing:
            async for streamed in self._stream_writing(op, obj, request):
                yield streamed
            return
        end = _range_end(obj, request)
        op.extra["from_chunk"] = request.from_chunk
        obj.readers += 1
        start = time.perf_counter()
        try:
            info = pb.GetResponse(info=self.store.info(obj)).SerializeToString()
            if end == request.from_chunk:  # nothing but the info to send
                self._sent(op, 0, start)
            yield info
            for i in range(request.from_chunk, end):
                message = obj.chunk_message(i)
                if message is None:  # complete objects have every chunk; never sent half-made
                    raise KVError(KVErrorCode.KV_INTERNAL, f"chunk {i} missing", kv_id=obj.kv_id)
                op.bytes += obj.chunk_len(i)
                if i == end - 1:
                    self._sent(op, end - request.from_chunk, start)
                yield message
        finally:
            obj.readers -= 1

    async def _stream_writing(
        self, op: _Op, obj: StoredObject, request: pb.GetRequest
    ) -> AsyncIterator[bytes]:
        """A Get of a streamed object: chunks as they are stored, then the closed info.

        Waits for each chunk (the caller's deadline bounds it: KV_TIMEOUT); an object its
        writer ended is KV_INCOMPLETE, never a short object.
        """
        want = request.to_chunk  # 0: up to the closed object's last chunk
        _range_end(obj, request)  # KV_INVALID outside the reservation
        op.extra["from_chunk"] = request.from_chunk
        op.extra["streamed"] = True
        obj.readers += 1
        start = time.perf_counter()
        i = request.from_chunk
        try:
            yield pb.GetResponse(info=self.store.info(obj)).SerializeToString()
            while True:
                if obj.ended:
                    raise KVError(KVErrorCode.KV_INCOMPLETE, obj.ended, kv_id=obj.kv_id)
                limit = min(want, obj.num_chunks) if want else obj.num_chunks
                if obj.writing and obj.final_chunks is not None:
                    limit = min(limit, obj.final_chunks)
                if i >= limit and (not obj.writing or (want and i >= want)):
                    break
                message: bytes | None = obj.chunk_message(i) if i < limit else None
                if message is None:  # not stored yet: wait for the writer
                    await obj.changed().wait()
                    continue
                yield message
                op.bytes += obj.chunk_len(i)
                i += 1
            closed = pb.GetResponse(info=self.store.info(obj)).SerializeToString()
            self._sent(op, i - request.from_chunk, start)
            yield closed
        finally:
            obj.readers -= 1

    async def open(
        self, request: pb.OpenRequest, context: grpc.aio.ServicerContext
    ) -> pb.OpenResponse:
        """Create a streamed object, readable while its writer's Put stream fills it."""
        async with self._audited("open", context) as op:
            obj = self.store.open(request.header, op.who)
            op.kv_id, op.bytes = obj.kv_id, obj.size_bytes
            return pb.OpenResponse(info=self.store.info(obj))

    # --- data plane (pdx.transfer.dataplane): the same rules, bytes moved by a thread ---------

    async def data_put(
        self,
        header: pb.PutHeader,
        who: str,
        peer: str,
        timeout_s: float | None,
        handoff: Handoff,
    ) -> pb.PutResponse:
        """A Put whose chunks a data-plane connection thread receives and checks."""
        async with (
            self._audit_op("put", who, peer, transport="data") as op,
            self._slot_wait(self._time_left(timeout_s), holder(op)),
        ):

            async def receive(obj: StoredObject) -> int:
                if obj.buffer is None and obj.missing() == obj.num_chunks:
                    obj.buffer = BUFFERS.get(obj.size_bytes)
                start = time.perf_counter()
                got: PutOutcome = await handoff.exchange(obj)
                if got.chunks:
                    self.store.put_verified(obj, header.start_chunk, got.chunks)
                op.bytes = got.nbytes  # audited even when the stream failed part-way
                if got.error is not None:
                    raise got.error
                if got.trailer_digest is not None:
                    self.store.set_object_digest(obj, got.trailer_digest)
                self._count("put", got.nbytes, len(got.chunks), start)
                return got.nbytes

            return await self._upload(op, header, receive)

    async def data_get(
        self,
        request: pb.GetRequest,
        who: str,
        peer: str,
        timeout_s: float | None,
        handoff: Handoff,
    ) -> None:
        """A Get whose chunks a data-plane connection thread sends."""
        async with self._audit_op("get", who, peer, transport="data") as op:
            op.kv_id = checked_kv_id(request.kv_id)
            left = self._time_left(timeout_s)
            async with self._slot_wait(left, holder(op)):
                obj = self.store.lookup_any(request.kv_id)
                self.store.check_reader(obj, op.who)
                if obj.writing:  # the data plane serves a streamed object once closed
                    await self._until_closed(obj, left)
                end = _range_end(obj, request)
                op.extra["from_chunk"] = request.from_chunk
                chunks = [(i, obj.digests[i], obj.data[i]) for i in range(request.from_chunk, end)]
                if any(c[2] is None for c in chunks):
                    raise KVError(KVErrorCode.KV_INTERNAL, "chunk missing", kv_id=obj.kv_id)
                obj.readers += 1
                start = time.perf_counter()

                def last_leaves(nbytes: int, count: int) -> None:  # (thread) before the last frame
                    op.bytes = nbytes
                    self._sent(op, count, start)

                try:
                    sent: GetOutcome = await handoff.exchange(
                        (self.store.info(obj), chunks, last_leaves)
                    )
                finally:
                    obj.readers -= 1
                op.bytes = sent.nbytes
                if sent.error is not None:
                    raise sent.error

    async def _until_closed(self, obj: StoredObject, left: float | None) -> None:
        try:
            async with asyncio.timeout(left):
                while obj.writing and not obj.ended:
                    await obj.changed().wait()
        except TimeoutError:
            raise KVError(
                KVErrorCode.KV_TIMEOUT, "the object was still being written", kv_id=obj.kv_id
            ) from None
        if obj.ended:
            raise KVError(KVErrorCode.KV_INCOMPLETE, obj.ended, kv_id=obj.kv_id)

    async def data_plane(
        self, request: pb.DataPlaneRequest, context: grpc.aio.ServicerContext
    ) -> pb.DataPlaneResponse:
        """Where the data plane listens (``enabled=false`` when it is off)."""
        ds = self.data_server
        if ds is None:
            return pb.DataPlaneResponse(enabled=False)
        return pb.DataPlaneResponse(
            enabled=True,
            port=ds.port,
            tls=ds.ssl_context is not None,
            max_frame_bytes=ds.max_frame_bytes,
            congestion_controls=available_congestion_controls(),
        )

    async def release(
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseResponse:
        """The consumer's acknowledgement: delete now."""
        async with self._audited("release", context) as op:
            op.kv_id = checked_kv_id(request.kv_id)
            self.store.check_reader(self.store.lookup_any(request.kv_id), op.who)
            obj = self.store.release(request.kv_id, op.who)
            op.bytes = obj.size_bytes
            op.extra["object_digest"] = digest_hex(obj.object_digest)
            return pb.ReleaseResponse(size_bytes=obj.size_bytes, object_digest=obj.object_digest)

    async def renew(
        self, request: pb.RenewRequest, context: grpc.aio.ServicerContext
    ) -> pb.RenewResponse:
        """Lease heartbeat."""
        async with self._audited("renew", context) as op:
            op.kv_id = checked_kv_id(request.kv_id)
            self.store.check_reader(self.store.lookup_any(request.kv_id), op.who)
            obj = self.store.renew(request.kv_id, request.lease_s)
            return pb.RenewResponse(info=self.store.info(obj))

    async def stat(
        self, request: pb.StatRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatResponse:
        """Describe an object without moving it."""
        async with self._audited("stat", context) as op:
            op.kv_id = checked_kv_id(request.kv_id)
            obj = self.store.lookup_any(request.kv_id)
            self.store.check_reader(obj, op.who)
            return pb.StatResponse(info=self.store.info(obj))

    def _count(self, op: str, nbytes: int, chunks: int, start: float) -> None:
        self.metrics.bytes.labels(op=op, side="store").inc(nbytes)
        self.metrics.chunks.labels(op=op, side="store").inc(chunks)
        self.metrics.duration.labels(op=op, side="store").observe(time.perf_counter() - start)

    def handler(self) -> grpc.GenericRpcHandler:
        """Method table. Chunk-carrying directions use raw bytes (no protobuf runtime copy)."""
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Put": grpc.stream_unary_rpc_method_handler(
                    self.put, response_serializer=pb.PutResponse.SerializeToString
                ),
                "Get": grpc.unary_stream_rpc_method_handler(
                    self.get, request_deserializer=pb.GetRequest.FromString
                ),
                "Release": _unary(self.release, pb.ReleaseRequest),
                "Renew": _unary(self.renew, pb.RenewRequest),
                "Stat": _unary(self.stat, pb.StatRequest),
                "DataPlane": _unary(self.data_plane, pb.DataPlaneRequest),
                "Open": _unary(self.open, pb.OpenRequest),
            },
        )


def _range_end(obj: StoredObject, request: pb.GetRequest) -> int:
    """The exclusive end chunk a Get asks for (0 = the last); KV_INVALID outside the object."""
    end = request.to_chunk or obj.num_chunks
    if not request.from_chunk <= end <= obj.num_chunks:
        raise KVError(
            KVErrorCode.KV_INVALID,
            f"chunk range {request.from_chunk}..{end} outside 0..{obj.num_chunks}",
            kv_id=obj.kv_id,
        )
    return end


def _unary(fn: Callable[..., Any], request_type: Any) -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(
        fn,
        request_deserializer=request_type.FromString,
        response_serializer=lambda m: m.SerializeToString(),
    )
