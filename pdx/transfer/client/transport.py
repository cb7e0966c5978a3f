"""Client wrapper for the KV store: chunked, checksummed, resumable, bounded in time.

``KVClient(target, cfg, tls=...)`` offers ``put``, ``get``, ``release``, ``renew`` and
``stat``. Every call has a deadline (``kv_transfer_timeout_ms``, for all attempts
together); retryable errors are retried with jittered exponential backoff under the
per-request and global budgets; a corrupt chunk is re-fetched from that chunk, not
from zero. ``AioRpcError`` becomes :class:`KVError` in one function,
:func:`pdx.transfer.rpc.map_rpc_error`. Each transfer leaves a :class:`TransferRecord`.
Fetched objects are assembled and verified in :mod:`pdx.transfer.objects`; data-plane
bytes move in worker threads through :mod:`pdx.transfer.dataplane.client`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import xxhash

from pdx._proto import kv_transfer_pb2 as pb
from pdx.errors import InputError
from pdx.netaddr import parse_hostport
from pdx.tcp import (
    TcpInfo,
    available_congestion_controls,
    bdp_bytes,
    buffer_limits,
    default_congestion_control,
    tcp_info,
    window_for,
)
from pdx.tls import TLSConfig, channel_credentials, client_ssl_context
from pdx.transfer.audit import AuditLog
from pdx.transfer.contract import (
    CLIENT_ID_METADATA_KEY,
    KVClientConfig,
    KVError,
    KVErrorCode,
    KVLayout,
)
from pdx.transfer.dataplane.client import (
    ConnPool,
    DataPlaneUnreachable,
    Endpoint,
    client_error,
    get_stream,
    put_stream,
)
from pdx.transfer.dataplane.framing import Conn
from pdx.transfer.metrics import KVMetrics, TransferRecord
from pdx.transfer.objects import Assembly, KVObject, StreamAssembly, encode_tensors
from pdx.transfer.path import Deadline, PathEstimate
from pdx.transfer.retry import GlobalRetryBudget, backoff_s
from pdx.transfer.rpc import CHANNEL_OPTIONS, SERVICE_NAME, map_rpc_error
from pdx.transfer.wire import digest64, encode_chunk, is_chunk_message, rechunk

if TYPE_CHECKING:
    import torch

__all__ = ["KVClient", "KVObject", "StreamWriter", "encode_tensors", "map_rpc_error"]

T = TypeVar("T")
log = logging.getLogger(__name__)

# Worker threads that move data-plane bytes (blocking sockets release the interpreter
# lock). One pool for every client in the process; it grows only as transfers overlap.
_IO = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="pdx-kv-io")
_UNRESOLVED = object()
DATA_RETRY_AFTER_S = 5.0  # auto: after the data port did not answer, gRPC for this long

# After a link blip gRPC refuses calls until its reconnect backoff (default 1 s, growing)
# expires; keep that short so a healed link is used again within ~0.1 s. gRPC also takes
# min_reconnect_backoff as the least time it gives one connection attempt: TCP, TLS and the
# HTTP/2 SETTINGS exchange are four round trips (1.2 s at 300 ms RTT) and a lost SYN is
# resent after 1 s, so an attempt gets 3 s; the request's own deadline still bounds the call.
CONNECT_ATTEMPT_MS = 3000
RECONNECT_OPTIONS: list[tuple[str, int]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", CONNECT_ATTEMPT_MS),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


@dataclass
class _Request:
    """Retry and deadline state of one logical request."""

    op: str
    deadline_s: float
    kv_id: str = ""
    transport: str = "grpc"
    retries: int = 0
    resumed_chunks: int = 0
    start_s: float = field(default_factory=time.perf_counter)
    deadline: Deadline | None = None
    began_s: float = 0.0
    size: int | None = 0  # bytes it moves, None = unknown (a Get without a size hint)
    congestion_control: str | None = None  # of the data-plane sockets that carried it
    limited_by: str | None = None  # a Put stream capped by its send buffer / the peer's window

    def remaining_s(self) -> float:
        return self.deadline_s - time.monotonic()


class KVClient:
    """Talks to one store. Use as ``async with KVClient(target, cfg) as kv:``."""

    def __init__(
        self,
        target: str,
        cfg: KVClientConfig | None = None,
        *,
        tls: TLSConfig | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        audit: AuditLog | None = None,
        metrics: KVMetrics | None = None,
        retry_budget: GlobalRetryBudget | None = None,
        data_ssl: ssl.SSLContext | None = None,
    ) -> None:
        self.target = target
        self.cfg = cfg or KVClientConfig()
        self.audit = audit or AuditLog()
        self.metrics = metrics or KVMetrics()
        self.retry_budget = retry_budget or GlobalRetryBudget(
            self.cfg.retry_ratio, self.cfg.retry_min_per_s, self.cfg.retry_window_s
        )
        if credentials is None and tls is not None:
            credentials = channel_credentials(tls)
        self._channels = [self._channel(i, credentials) for i in range(self.cfg.connections)]
        self._metadata = ((CLIENT_ID_METADATA_KEY, self.cfg.client_id),)
        if data_ssl is None and tls is not None:
            data_ssl = client_ssl_context(tls)
        self._data_ssl = data_ssl
        self._secure = credentials is not None or data_ssl is not None
        self._endpoint: Any = _UNRESOLVED
        self._endpoint_lock = asyncio.Lock()
        self._data_down_until = 0.0  # auto: use gRPC until then (the data port did not answer)
        self._pool = ConnPool(limit=2 * max(self.cfg.streams, self.cfg.connections))
        self.path = PathEstimate(self.cfg.link_gbps)
        self.system_cc = default_congestion_control()
        self._warned_cap = False

    def _channel(self, i: int, creds: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
        # A distinct option per channel keeps each on its own TCP connection.
        options = [*CHANNEL_OPTIONS, *RECONNECT_OPTIONS, ("pdx.connection", i)]
        if creds is None:
            return grpc.aio.insecure_channel(self.target, options=options)
        return grpc.aio.secure_channel(self.target, creds, options=options)

    def _rpc(self, i: int, kind: str, name: str, **kw: Any) -> Any:
        ch = self._channels[i % len(self._channels)]
        return getattr(ch, kind)(f"/{SERVICE_NAME}/{name}", **kw)

    async def __aenter__(self) -> KVClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every channel and data-plane connection."""
        self._pool.close()
        for ch in self._channels:
            await ch.close()

    @property
    def secure(self) -> bool:
        """Whether this client presents a TLS identity (gRPC or data plane)."""
        return self._secure

    def records(self) -> list[TransferRecord]:
        """Per-transfer records of this client, oldest first."""
        return self.metrics.records()

    # --- retries ----------------------------------------------------------------------

    def _begin(self, op: str, kv_id: str = "", size_bytes: int | None = 0) -> _Request:
        self.retry_budget.on_request()
        d = self.path.deadline(size_bytes, self.cfg.kv_transfer_timeout_ms)
        now = time.monotonic()
        return _Request(op, now + d.ms / 1000, kv_id, deadline=d, began_s=now, size=size_bytes)

    def _extend(self, req: _Request) -> None:
        """A derived deadline follows what the request itself taught the path estimate (the
        first RTT a cold client measures): it may grow, never shrink."""
        d = req.deadline
        if d is None or d.source != "derived":
            return
        now = self.path.deadline(req.size, None)
        if now.ms > d.ms:
            req.deadline = now
            req.deadline_s = max(req.deadline_s, req.began_s + now.ms / 1000)

    async def _attempt(self, req: _Request, fn: Callable[[float], Awaitable[T]]) -> T:
        """Run ``fn(timeout_s)`` once, mapping gRPC failures and the deadline to KVError."""
        self._extend(req)
        remaining = req.remaining_s()
        if remaining <= 0:
            raise KVError(KVErrorCode.KV_TIMEOUT, f"{req.op}: deadline passed", kv_id=req.kv_id)
        try:
            return await asyncio.wait_for(fn(remaining), timeout=remaining + 0.05)
        except grpc.aio.AioRpcError as exc:
            raise map_rpc_error(exc, req.kv_id) from None
        except TimeoutError:
            raise KVError(
                KVErrorCode.KV_TIMEOUT, f"{req.op}: deadline passed", kv_id=req.kv_id
            ) from None

    async def _before_retry(self, req: _Request, exc: KVError) -> None:
        """Decide whether ``exc`` may be retried; wait the backoff, or raise."""
        exc.retries = req.retries
        if not exc.retryable or req.remaining_s() <= 0 or self.cfg.kv_retry_budget == 0:
            raise exc
        if req.retries >= self.cfg.kv_retry_budget:
            raise KVError(
                KVErrorCode.RETRY_BUDGET_EXHAUSTED,
                f"{req.op}: {req.retries} retries used (kv_retry_budget); "
                f"last error {exc.code.value}: {exc.message}",
                kv_id=req.kv_id,
                retries=req.retries,
            ) from exc
        if not self.retry_budget.try_retry():
            raise KVError(
                KVErrorCode.RETRY_BUDGET_EXHAUSTED,
                f"{req.op}: global retry budget spent; last error {exc.code.value}: {exc.message}",
                kv_id=req.kv_id,
                retries=req.retries,
            ) from exc
        req.retries += 1
        self.metrics.retries.labels(op=req.op).inc()
        self.audit.record(
            "retry",
            who=self.cfg.client_id,
            peer=self.target,
            side="client",
            op=req.op,
            kv_id=req.kv_id or exc.kv_id or None,
            outcome=exc.code.value,
            reason=exc.message,
            resume_chunk=exc.resume_chunk,
            retries=req.retries,
        )
        delay = backoff_s(req.retries, self.cfg.backoff_base_ms, self.cfg.backoff_max_ms)
        await asyncio.sleep(min(delay, max(req.remaining_s(), 0)))

    async def _unary(self, req: _Request, name: str, request: Any, reply: Any) -> Any:
        call = self._rpc(
            0,
            "unary_unary",
            name,
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=reply.FromString,
        )

        async def once(timeout_s: float) -> Any:
            t0 = time.perf_counter()
            reply = await call(request, timeout=timeout_s, metadata=self._metadata)
            # An upper bound of the RTT (the first call also sets up the channel: a cold
            # client's deadline errs on the long side until TCP itself measures the path).
            self.path.observe_rtt((time.perf_counter() - t0) * 1e3)
            return reply

        while True:
            try:
                return await self._attempt(req, once)
            except KVError as exc:
                await self._before_retry(req, exc)

    def _finish(
        self, req: _Request, nbytes: int, chunks: int, outcome: str, **extra: Any
    ) -> TransferRecord:
        ms = (time.perf_counter() - req.start_s) * 1000
        d = req.deadline
        moves = req.op in ("put", "get")
        rec = TransferRecord(
            req.kv_id,
            req.op,
            nbytes,
            round(ms, 3),
            req.retries,
            outcome,
            chunks,
            req.resumed_chunks,
            transport=req.transport if moves else None,
            congestion_control=req.congestion_control
            or (self.system_cc if moves and req.transport == "grpc" else None),
            streams=self.cfg.streams if moves else None,
            connections=self.cfg.connections if moves else None,
            rtt_ms=round(self.path.rtt_ms, 3) if self.path.rtt_ms is not None else None,
            deadline_ms=d.ms if d is not None else None,
            deadline_source=d.source if d is not None else None,
            limited_by=req.limited_by,
            **extra,
        )
        self.metrics.add_record(rec)
        self.metrics.duration.labels(op=req.op, side="client").observe(ms / 1000)
        if outcome != "ok":
            self.metrics.errors.labels(code=outcome, side="client").inc()
        else:
            self.path.observe_success(nbytes, ms / 1000)
            self.metrics.bytes.labels(op=req.op, side="client").inc(nbytes)
            self.metrics.chunks.labels(op=req.op, side="client").inc(chunks)
        if moves:
            self.metrics.transfers.labels(
                op=req.op, outcome=outcome, transport=req.transport,
                congestion_control=rec.congestion_control or "unknown",
            ).inc()  # fmt: skip
        rtt = self.path.rtt_ms
        if req.limited_by and not self._warned_cap and rtt is not None and rtt >= 1.0:
            self._warn_cap(req, rtt)  # (on a LAN a window limit is about the peer's CPU)
        self.audit.record(
            req.op,
            who=self.cfg.client_id,
            peer=self.target,
            side="client",
            **{k: v for k, v in rec.as_dict().items() if k != "op" and v is not None},
        )
        return rec

    def _warn_cap(self, req: _Request, rtt_ms: float) -> None:
        """Say once which sysctl caps this client's streams, and what would not."""
        self._warned_cap = True
        if req.limited_by == "send buffer":
            where = f"net.ipv4.tcp_wmem max {buffer_limits().tcp_wmem_max} B here"
        else:
            where = "net.ipv4.tcp_rmem max on the store"
        log.warning(
            "KV %s to %s: one stream is limited by its %s (%s) at RTT %.1f ms; a max of "
            "%d B per Gbit/s of link would not cap it: raise it, set kv.link_gbps, or use "
            "more kv.streams",
            req.op, self.target, req.limited_by, where, rtt_ms,
            window_for(bdp_bytes(1e9, rtt_ms)),
        )  # fmt: skip

    # --- data plane -------------------------------------------------------------------

    async def data_endpoint(self) -> Endpoint | None:
        """Where this client moves Put/Get bytes: the store's data plane, or None for gRPC."""
        return await self._data_endpoint(self._begin("data_plane"))

    async def _data_endpoint(self, req: _Request) -> Endpoint | None:
        if self.cfg.transport == "grpc":
            return None
        if self.cfg.transport == "auto" and time.monotonic() < self._data_down_until:
            return None
        if self._endpoint is _UNRESOLVED:
            async with self._endpoint_lock:
                if self._endpoint is _UNRESOLVED:
                    self._endpoint = await self._resolve(req)
        return self._endpoint  # type: ignore[no-any-return]

    async def _resolve(self, req: _Request) -> Endpoint | None:
        """Ask the store for its data plane; decide whether this client may use it."""
        strict = self.cfg.transport == "data"
        try:
            resp = await self._unary(req, "DataPlane", pb.DataPlaneRequest(), pb.DataPlaneResponse)
        except KVError as exc:
            if strict or exc.code is not KVErrorCode.KV_INTERNAL:
                raise
            return None  # a store without the DataPlane call: gRPC it is
        why = ""
        if not resp.enabled:
            why = "the store has no data plane (data_plane: false)"
        elif resp.tls and self._data_ssl is None:
            why = "the data plane uses TLS but this client has no TLS identity for it"
        elif not resp.tls and self._secure:
            why = "the data plane is plaintext but this client uses TLS"
        if why:
            if strict:
                raise KVError(KVErrorCode.KV_UNAVAILABLE, f"transport data: {why}")
            return None
        try:
            if self.cfg.data_target:
                host, port = parse_hostport(self.cfg.data_target, "data_target")
            else:
                host = parse_hostport(self.target, "target")[0]
                port = resp.port
        except InputError as exc:
            if strict or self.cfg.data_target:
                raise KVError(KVErrorCode.KV_INVALID, str(exc)) from None
            return None
        cc = self.cfg.congestion_control
        wanted = None if cc == "system" or cc not in available_congestion_controls() else cc
        return Endpoint(host, port, self._data_ssl, self.cfg.client_id, wanted, self.cfg.link_gbps)

    async def _in_thread(
        self, req: _Request, ep: Endpoint, kv_id: str, timeout_s: float,
        work: Callable[[Conn, int], T],
    ) -> T:  # fmt: skip
        """Run ``work(conn, timeout_ms)`` on a pooled data-plane connection in a worker thread.

        The connection's deadline bounds every socket call; if the caller gives up first
        (cancellation), the socket is shut down so the thread ends at once.
        """
        deadline = time.monotonic() + timeout_s
        timeout_ms = max(1, int(timeout_s * 1000))
        used: list[Conn] = []

        def run() -> T:
            conn = self._pool.take()
            while conn is not None and conn.answered():  # closed by the store while idle
                conn.close()
                conn = self._pool.take()
            fresh = conn is None
            if conn is None:
                try:
                    conn = ep.connect(deadline)
                except DataPlaneUnreachable:
                    self._unreachable()
                    raise
                if conn.rtt_ms:
                    self.path.observe_rtt(conn.rtt_ms)
            used.append(conn)
            req.congestion_control = conn.congestion_control
            conn.set_deadline(deadline)
            before = tcp_info(conn.sock) if req.op == "put" else None
            try:
                result = work(conn, timeout_ms)
            except BaseException as exc:
                conn.close()
                err = client_error(exc, kv_id, None)
                if fresh and err.code is KVErrorCode.KV_UNAVAILABLE:
                    # A connection just dialled was refused or dropped (the store at its
                    # connection limit, or gone): under ``auto``, gRPC serves this attempt.
                    self._unreachable()
                    raise DataPlaneUnreachable(err.code, err.message, kv_id=kv_id) from None
                raise err from None
            if before is not None:
                req.limited_by = req.limited_by or _limited(before, tcp_info(conn.sock))
            conn.set_deadline(None)
            self._pool.give(conn)
            return result

        try:
            return await asyncio.get_running_loop().run_in_executor(_IO, run)
        except asyncio.CancelledError:
            for conn in used:
                conn.abort()
            raise

    def _unreachable(self) -> None:
        """The data port did not answer: ask the store again next time (it may have
        restarted on another port); under ``auto`` use gRPC for a while meanwhile."""
        self._endpoint = _UNRESOLVED
        self._pool.close()
        if self.cfg.transport == "auto":
            self._data_down_until = time.monotonic() + DATA_RETRY_AFTER_S

    async def _on_data_plane(
        self, req: _Request, timeout_s: float, kv_id: str, work: Callable[[Conn, int], T]
    ) -> tuple[bool, T | None]:
        """Try ``work`` on the data plane: ``(True, result)``, or ``(False, None)`` when this
        attempt should use gRPC (the data plane is off or, under ``auto``, unreachable)."""
        ep = await self._data_endpoint(req)
        if ep is None:
            req.transport = "grpc"
            return False, None
        req.transport = "data"
        try:
            return True, await self._in_thread(req, ep, kv_id, timeout_s, work)
        except DataPlaneUnreachable:
            if self.cfg.transport != "auto":
                raise
            req.transport = "grpc"
            return False, None

    # --- put --------------------------------------------------------------------------

    async def put(
        self,
        data: bytes | bytearray | memoryview | Sequence[torch.Tensor],
        layout: KVLayout | None = None,
        *,
        codec: str = "raw",
        model_version: str = "unversioned",
        ttl_s: int = 0,
    ) -> str:
        """Store tensors (encoded with ``codec``) or ready bytes; return the new kv_id."""
        if isinstance(data, bytes | bytearray | memoryview):
            payload: bytes | bytearray | memoryview = data
            layout = layout or KVLayout(codec="")
        else:
            payload, layout = encode_tensors(data, codec, layout.roles if layout else None)
        view = memoryview(payload).cast("B")
        req = self._begin("put", size_bytes=len(view))
        try:
            info = await self._put_object(req, view, layout, model_version, ttl_s)
        except KVError as exc:
            self._finish(req, 0, 0, exc.code.value)
            raise
        req.kv_id = info.kv_id
        self._finish(req, info.size_bytes, info.num_chunks, "ok")
        return info.kv_id

    async def _put_object(
        self, req: _Request, view: memoryview, layout: KVLayout, model_version: str, ttl_s: int
    ) -> pb.ObjectInfo:
        size = len(view)
        chunk = self.cfg.chunk_size_bytes
        n = -(-size // chunk)
        header = pb.PutHeader(
            model_version=model_version,
            ttl_s=ttl_s,
            layout=layout.to_proto(),
            size_bytes=size,
            chunk_size_bytes=chunk,
            upload_token=secrets.token_bytes(16),
        )
        await self._data_endpoint(req)  # a transport that cannot work fails here, not retried
        ranges = _split(n, self.cfg.streams)
        if len(ranges) == 1:
            # One stream sends every chunk in order: hash the object while streaming it
            # and send the digest last, instead of reading the whole object once first.
            header.digest_in_trailer = True
        else:
            header.object_digest = digest64(view)
        results = await asyncio.gather(
            *(self._put_range(req, k, header, view, a, b) for k, (a, b) in enumerate(ranges))
        )
        done = [r for r in results if r.missing_chunks == 0]
        if not done:
            raise KVError(KVErrorCode.KV_INTERNAL, "upload ended with chunks missing")
        return done[0].info

    async def _put_range(
        self,
        req: _Request,
        k: int,
        header: pb.PutHeader,
        view: memoryview,
        start: int,
        end: int,
    ) -> pb.PutResponse:
        call = self._rpc(k, "stream_unary", "Put", response_deserializer=pb.PutResponse.FromString)
        first = start
        hdr = pb.PutHeader()
        hdr.CopyFrom(header)
        while True:
            hdr.start_chunk = first
            sent = pb.PutHeader()
            sent.CopyFrom(hdr)

            def work(conn: Conn, ms: int, h: pb.PutHeader = sent, a: int = first) -> Any:
                return put_stream(conn, h, view, a, end, ms)

            async def once(
                timeout_s: float, h: pb.PutHeader = sent, a: int = first, w: Any = work
            ) -> Any:
                done, result = await self._on_data_plane(req, timeout_s, "", w)
                if done:
                    return result
                messages = _put_messages(h, view, a, end)
                left = max(req.remaining_s(), 0.001)
                return await call(messages, timeout=left, metadata=self._metadata)

            try:
                return await self._attempt(req, once)
            except KVError as exc:
                await self._before_retry(req, exc)
                if hdr.digest_in_trailer:  # a retry names the digest up front
                    hdr.digest_in_trailer = False
                    hdr.object_digest = digest64(view)
                if exc.code is KVErrorCode.KV_CORRUPT and exc.resume_chunk is not None:
                    first = min(max(exc.resume_chunk, start), end)
                    req.resumed_chunks += first - start
                else:
                    first = start

    # --- streamed objects ---------------------------------------------------------------

    async def open(
        self,
        reserve_bytes: int,
        layout: KVLayout | None = None,
        *,
        model_version: str = "unversioned",
        ttl_s: int = 0,
    ) -> StreamWriter:
        """Open a streamed object of at most ``reserve_bytes``; write it with the writer.

        The kv_id is known at once and readers may Get the object while it is written.
        Its Put travels on gRPC (the data plane carries whole objects only).
        """
        req = self._begin("put", size_bytes=reserve_bytes)
        req.transport = "grpc"
        header = pb.PutHeader(
            model_version=model_version,
            ttl_s=ttl_s,
            layout=(layout or KVLayout(codec="")).to_proto(),
            size_bytes=reserve_bytes,
            chunk_size_bytes=self.cfg.chunk_size_bytes,
            upload_token=secrets.token_bytes(16),
            digest_in_trailer=True,
        )
        try:
            opened = await self._unary(req, "Open", pb.OpenRequest(header=header), pb.OpenResponse)
        except KVError as exc:
            self._finish(req, 0, 0, exc.code.value)
            raise
        req.kv_id = opened.info.kv_id
        return StreamWriter(self, req, header)

    async def get_streamed(
        self,
        kv_id: str,
        *,
        size_hint: int | None = None,
        on_chunk: Callable[[pb.ObjectInfo, memoryview], None] | None = None,
    ) -> StreamedGet:
        """Fetch an object that may still be written: chunks as they are stored (gRPC).

        Verifies every chunk on arrival and the whole object against its closed info. The
        writer ending it is KV_INCOMPLETE (not retried); a writer slower than this request's
        deadline is KV_TIMEOUT.
        """
        req = self._begin("get", kv_id, size_bytes=size_hint)
        req.transport = "grpc"
        got = StreamAssembly(kv_id, on_chunk)
        try:
            await self._get_range(req, 0, got, 0, 0, grpc_only=True)
            obj = got.finish()
        except KVError as exc:
            self._finish(req, 0, 0, exc.code.value)
            raise
        chunk = obj.info.chunk_size_bytes
        late = max(0, int(obj.info.size_bytes) - got.stored_at_start * chunk)
        wait_ms = (got.closed_s - got.first_s) * 1e3 if got.closed_s and got.first_s else 0.0
        n = obj.info.num_chunks
        rec = self._finish(
            req, obj.info.size_bytes, n, "ok", streamed=True, overlap_bytes=late,
            overlap_ms=round(wait_ms, 3),
        )  # fmt: skip
        return StreamedGet(obj, rec, late, wait_ms)

    # --- get --------------------------------------------------------------------------

    async def get(self, kv_id: str, *, size_hint: int | None = None) -> KVObject:
        """Fetch and verify a whole object (every chunk and the object digest).

        ``size_hint`` (bytes, when the caller knows it) sizes a derived deadline; without it
        the largest object this client has moved stands in.
        """
        req = self._begin("get", kv_id, size_bytes=size_hint)
        try:
            obj = await self._get_object(req, kv_id)
        except KVError as exc:
            self._finish(req, 0, 0, exc.code.value)
            raise
        self._finish(req, obj.info.size_bytes, obj.info.num_chunks, "ok")
        return obj

    async def _get_object(self, req: _Request, kv_id: str) -> KVObject:
        got = Assembly(kv_id)
        await self._data_endpoint(req)  # a transport that cannot work fails here, not retried
        ranges = [(0, 0)]
        if self.cfg.streams > 1:
            stat = await self._unary(req, "Stat", pb.StatRequest(kv_id=kv_id), pb.StatResponse)
            got.accept_info(stat.info)
            ranges = _split(stat.info.num_chunks, self.cfg.streams)
        await asyncio.gather(
            *(self._get_range(req, k, got, a, b) for k, (a, b) in enumerate(ranges))
        )
        return got.finish()

    async def _get_range(
        self, req: _Request, k: int, got: Assembly, start: int, end: int, *, grpc_only: bool = False
    ) -> None:
        call = self._rpc(
            k, "unary_stream", "Get", request_serializer=pb.GetRequest.SerializeToString
        )
        state = {"next": start}

        def work(conn: Conn, timeout_ms: int) -> None:
            request = pb.GetRequest(kv_id=got.kv_id, from_chunk=state["next"], to_chunk=end)

            def verified(index: int, digest: int, view: memoryview) -> None:
                got.add_view(index, digest, view)
                state["next"] = index + 1

            try:
                get_stream(conn, request, timeout_ms, got.accept_info, got.slot, verified)
            except KVError:
                raise
            except Exception as exc:  # socket or framing trouble: resume where it stopped
                raise client_error(exc, got.kv_id, state["next"]) from None

        async def once(timeout_s: float) -> None:
            if not grpc_only:
                done, _ = await self._on_data_plane(req, timeout_s, got.kv_id, work)
                if done:
                    return
            request = pb.GetRequest(kv_id=got.kv_id, from_chunk=state["next"], to_chunk=end)
            left = max(req.remaining_s(), 0.001)
            stream = call(request, timeout=left, metadata=self._metadata)
            try:
                await self._receive(stream, got, state)
            finally:
                stream.cancel()

        while True:
            try:
                await self._attempt(req, once)
                return
            except KVError as exc:
                if exc.code is KVErrorCode.KV_CORRUPT:
                    self.metrics.corrupt.labels(side="client").inc()
                await self._before_retry(req, exc)
                if exc.code is KVErrorCode.KV_CORRUPT:
                    req.resumed_chunks += state["next"] - start

    async def _receive(self, stream: Any, got: Assembly, state: dict[str, int]) -> None:
        first = True
        async for raw in stream:
            if first or not is_chunk_message(raw):  # info first; a streamed Get's closed info last
                got.accept_info(pb.GetResponse.FromString(raw).info)
                if isinstance(got, StreamAssembly):
                    now = time.perf_counter()
                    got.first_s = got.first_s or now
                    if got.closed is not None:
                        got.closed_s = now
                first = False
                continue
            got.add(state["next"], raw)
            state["next"] += 1

    # --- small calls ------------------------------------------------------------------

    async def _small(self, op: str, kv_id: str, name: str, request: Any, reply: Any) -> Any:
        req = self._begin(op, kv_id)
        try:
            result = await self._unary(req, name, request, reply)
        except KVError as exc:
            self._finish(req, 0, 0, exc.code.value)
            raise
        self._finish(req, 0, 0, "ok")
        return result

    async def release(self, kv_id: str) -> int:
        """Acknowledge consumption: the store deletes the object now. Returns its size."""
        resp = await self._small(
            "release", kv_id, "Release", pb.ReleaseRequest(kv_id=kv_id), pb.ReleaseResponse
        )
        return int(resp.size_bytes)

    async def renew(self, kv_id: str, lease_s: int = 0) -> pb.ObjectInfo:
        """Lease heartbeat: keep the object past its TTL while still needed."""
        resp = await self._small(
            "renew", kv_id, "Renew", pb.RenewRequest(kv_id=kv_id, lease_s=lease_s), pb.RenewResponse
        )
        return resp.info

    async def stat(self, kv_id: str) -> pb.ObjectInfo:
        """Describe an object without moving its bytes."""
        resp = await self._small(
            "stat", kv_id, "Stat", pb.StatRequest(kv_id=kv_id), pb.StatResponse
        )
        return resp.info


@dataclass
class StreamedGet:
    """What :meth:`KVClient.get_streamed` fetched, and how much of it streamed while written."""

    obj: KVObject
    record: TransferRecord
    bytes_while_writing: int  # stored only after the Get began
    wait_ms: float  # from the first info to the closed object's info


class StreamWriter:
    """The writer of a streamed object: ``write`` bytes in order, then ``close``.

    Full chunks go out on the object's Put stream as soon as they exist. ``mark_overlap``
    records how much had been sent when the producer finished computing; ``abort`` ends
    the stream (the store then ends the object: readers get KV_INCOMPLETE).
    """

    def __init__(self, client: KVClient, req: _Request, header: pb.PutHeader) -> None:
        self.client, self.req, self.header = client, req, header
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
        call = client._rpc(0, "stream_unary", "Put", response_deserializer=reply)
        left = max(req.remaining_s(), 0.001)
        self._call = call(self._messages(), timeout=left, metadata=client._metadata)
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
        try:
            reply = await self.client._attempt(req, lambda _t: self._call)
        except KVError as exc:
            self.client._finish(req, 0, 0, exc.code.value, streamed=True)
            raise
        if reply.missing_chunks:
            short = KVError(KVErrorCode.KV_INTERNAL, "streamed object closed with chunks missing",
                            kv_id=self.kv_id)  # fmt: skip
            self.client._finish(req, 0, 0, short.code.value, streamed=True)
            raise short
        ob, oms = self.overlap if self.overlap is not None else (None, None)
        self.client._finish(req, reply.info.size_bytes, reply.info.num_chunks, "ok",
                            streamed=True, overlap_bytes=ob,
                            overlap_ms=round(oms, 3) if oms is not None else None)  # fmt: skip
        return reply.info

    def abort(self) -> None:
        """Stop writing: the stream is cancelled and the store ends the object."""
        if not self._call.done():
            self._call.cancel()
            self.client._finish(self.req, 0, 0, "cancelled", streamed=True)


async def _put_messages(
    header: pb.PutHeader, view: memoryview, first: int, end: int
) -> AsyncIterator[bytes]:
    """A Put stream: header, chunks ``first .. end-1``, and the trailer if announced.

    Each chunk is hashed just before it is copied into its message, so its bytes are
    read from memory once for both; with ``digest_in_trailer`` the object digest grows
    from the same, still cached, chunk.
    """
    yield pb.PutRequest(header=header).SerializeToString()
    size = header.chunk_size_bytes
    whole = xxhash.xxh3_64() if header.digest_in_trailer else None
    for i in range(first, end):
        part = view[i * size : (i + 1) * size]
        if whole is not None:
            whole.update(part)
        yield encode_chunk(i, part)
    if whole is not None:
        trailer = pb.PutTrailer(object_digest=whole.intdigest())
        yield pb.PutRequest(trailer=trailer).SerializeToString()


def _limited(before: TcpInfo | None, after: TcpInfo | None) -> str | None:
    """What limited a sending socket over one transfer (TCP_INFO's counters, differenced)."""
    if before is None or after is None:
        return None
    busy = after.busy_ms - before.busy_ms
    if busy < 100:  # too short to say (a transfer of a few RTTs is limited by slow start)
        return None
    if (after.sndbuf_limited_ms - before.sndbuf_limited_ms) / busy > 0.5:
        return "send buffer"
    if (after.rwnd_limited_ms - before.rwnd_limited_ms) / busy > 0.5:
        return "receive window"
    return None


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """``n`` chunks into at most ``parts`` contiguous, non-empty ranges (one empty if n=0)."""
    parts = max(1, min(parts, n))
    step = -(-n // parts) if n else 0
    return [(a, min(a + step, n)) for a in range(0, n, step)] if n else [(0, 0)]
