"""How a KV client's Put and Get bytes travel, attempt by attempt.

A :class:`KVTransport` moves one range of chunks of a whole object for one attempt:
:class:`~pdx.transfer.client.grpc_transport.GrpcTransport` inside gRPC messages, a
:class:`DataPlaneTransport` on the store's data plane (:class:`DataPlane`: where it
listens, asked of the store once and again after it did not answer; pooled connections;
worker threads). ``TRANSPORTS`` maps ``kv.transport`` to the :class:`TransportPolicy`
that picks one per attempt: ``grpc``, ``data``, or ``auto`` (the data plane when the
store offers one this client may use, else gRPC). Every other call, and streamed objects,
use gRPC.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from pdx._proto import kv_transfer_pb2 as pb
from pdx.errors import InputError
from pdx.netaddr import parse_hostport
from pdx.tcp import TcpInfo, available_congestion_controls, tcp_info
from pdx.transfer.client.attempts import Request
from pdx.transfer.client.grpc_transport import GrpcTransport
from pdx.transfer.contract import KVClientConfig, KVError, KVErrorCode
from pdx.transfer.dataplane.client import (
    ConnPool,
    DataPlaneUnreachable,
    Endpoint,
    client_error,
    get_stream,
    put_stream,
)
from pdx.transfer.dataplane.framing import Conn
from pdx.transfer.objects import Assembly
from pdx.transfer.path import PathEstimate

T = TypeVar("T")

# Worker threads that move data-plane bytes (blocking sockets release the interpreter
# lock). One pool for every client in the process; it grows only as transfers overlap.
_IO = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="pdx-kv-io")
_UNRESOLVED = object()
DATA_RETRY_AFTER_S = 5.0  # auto: after the data port did not answer, gRPC for this long


class KVTransport(Protocol):
    """Moves one range of chunks of a whole object, for one attempt of its request."""

    async def put_range(
        self,
        req: Request,
        k: int,
        header: pb.PutHeader,
        view: memoryview,
        first: int,
        end: int,
        timeout_s: float,
    ) -> pb.PutResponse:
        """Send ``header`` and chunks ``first .. end-1`` of ``view`` (stripe ``k``)."""
        ...

    async def get_range(
        self,
        req: Request,
        k: int,
        got: Assembly,
        state: dict[str, int],
        end: int,
        timeout_s: float,
    ) -> None:
        """Fetch chunks ``state["next"] .. end-1`` into ``got``, advancing ``state["next"]``."""
        ...


@dataclass(frozen=True)
class TransportContext:
    """What a client's transport policy is built from."""

    target: str
    cfg: KVClientConfig
    grpc: GrpcTransport
    path: PathEstimate
    data_ssl: ssl.SSLContext | None  # the client's TLS identity on the data plane
    secure: bool  # the client uses TLS (gRPC or data plane)


class DataPlane:
    """The store's data plane as one client uses it: its endpoint, asked of the store once
    (again after it did not answer), pooled connections, and worker threads.

    ``strict``: a data plane this client cannot use is an error, not None.
    ``on_unreachable``: called (in a worker thread) when the data port did not answer.
    """

    def __init__(
        self,
        ctx: TransportContext,
        *,
        strict: bool,
        on_unreachable: Callable[[], None] | None = None,
    ) -> None:
        self.target, self.cfg, self.grpc, self.path = ctx.target, ctx.cfg, ctx.grpc, ctx.path
        self._data_ssl = ctx.data_ssl
        self._secure = ctx.secure
        self.strict = strict
        self._on_unreachable = on_unreachable
        self._endpoint: Any = _UNRESOLVED
        self._endpoint_lock = asyncio.Lock()
        self._pool = ConnPool(limit=2 * max(self.cfg.streams, self.cfg.connections))

    def close(self) -> None:
        """Close every pooled connection."""
        self._pool.close()

    async def endpoint(self, req: Request) -> Endpoint | None:
        """Where to dial, or None when this client may not use the data plane."""
        if self._endpoint is _UNRESOLVED:
            async with self._endpoint_lock:
                if self._endpoint is _UNRESOLVED:
                    self._endpoint = await self._resolve(req)
        return self._endpoint  # type: ignore[no-any-return]

    async def _resolve(self, req: Request) -> Endpoint | None:
        """Ask the store for its data plane; decide whether this client may use it."""
        strict = self.strict
        try:
            resp = await self.grpc.unary(
                req, "DataPlane", pb.DataPlaneRequest(), pb.DataPlaneResponse
            )
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

    async def run(
        self, req: Request, ep: Endpoint, kv_id: str, timeout_s: float,
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
        restarted on another port)."""
        self._endpoint = _UNRESOLVED
        self._pool.close()
        if self._on_unreachable is not None:
            self._on_unreachable()


class DataPlaneTransport:
    """Ranges on one data-plane endpoint, each on a pooled connection in a worker thread."""

    def __init__(self, plane: DataPlane, endpoint: Endpoint) -> None:
        self.plane, self.endpoint = plane, endpoint

    async def put_range(
        self,
        req: Request,
        k: int,
        header: pb.PutHeader,
        view: memoryview,
        first: int,
        end: int,
        timeout_s: float,
    ) -> pb.PutResponse:
        """A Put stream on one connection."""

        def work(conn: Conn, ms: int) -> pb.PutResponse:
            return put_stream(conn, header, view, first, end, ms)

        return await self.plane.run(req, self.endpoint, "", timeout_s, work)

    async def get_range(
        self,
        req: Request,
        k: int,
        got: Assembly,
        state: dict[str, int],
        end: int,
        timeout_s: float,
    ) -> None:
        """A Get stream on one connection; socket or framing trouble resumes where it stopped."""

        def work(conn: Conn, timeout_ms: int) -> None:
            request = pb.GetRequest(kv_id=got.kv_id, from_chunk=state["next"], to_chunk=end)

            def verified(index: int, digest: int, view: memoryview) -> None:
                got.add_view(index, digest, view)
                state["next"] = index + 1

            try:
                get_stream(conn, request, timeout_ms, got.accept_info, got.slot, verified)
            except KVError:
                raise
            except Exception as exc:
                raise client_error(exc, got.kv_id, state["next"]) from None

        await self.plane.run(req, self.endpoint, got.kv_id, timeout_s, work)


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


class TransportPolicy(Protocol):
    """Which transport carries each attempt of a client's Put and Get ranges."""

    async def endpoint(self, req: Request) -> Endpoint | None:
        """The data plane used now, or None for gRPC; raises when the policy's transport
        cannot work at all."""
        ...

    async def run(self, req: Request, move: Callable[[KVTransport], Awaitable[T]]) -> T:
        """``move`` on the transport picked for this attempt, named in ``req.transport``."""
        ...

    def close(self) -> None:
        """Close what the policy holds besides the gRPC channels."""
        ...


class GrpcOnly:
    """``grpc``: every range inside gRPC messages."""

    def __init__(self, grpc: GrpcTransport) -> None:
        self.grpc = grpc

    async def endpoint(self, req: Request) -> Endpoint | None:
        return None

    async def run(self, req: Request, move: Callable[[KVTransport], Awaitable[T]]) -> T:
        req.transport = "grpc"
        return await move(self.grpc)

    def close(self) -> None:
        pass


class _DataFirst:
    """The data plane whenever :meth:`endpoint` names one, else gRPC. With ``fallback``,
    an attempt whose data port did not answer is carried by gRPC instead."""

    fallback = False

    def __init__(self, grpc: GrpcTransport, plane: DataPlane) -> None:
        self.grpc, self.plane = grpc, plane

    async def endpoint(self, req: Request) -> Endpoint | None:
        return await self.plane.endpoint(req)

    async def run(self, req: Request, move: Callable[[KVTransport], Awaitable[T]]) -> T:
        ep = await self.endpoint(req)
        if ep is not None:
            req.transport = "data"
            try:
                return await move(DataPlaneTransport(self.plane, ep))
            except DataPlaneUnreachable:
                if not self.fallback:
                    raise
        req.transport = "grpc"
        return await move(self.grpc)

    def close(self) -> None:
        self.plane.close()


class DataOnly(_DataFirst):
    """``data``: every range on the data plane; one this client cannot use, or that does not
    answer, is an error."""

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx.grpc, DataPlane(ctx, strict=True))


class Auto(_DataFirst):
    """``auto``: the data plane when the store offers one this client may use, else gRPC.
    When the data port does not answer, gRPC carries that attempt and every other for
    ``DATA_RETRY_AFTER_S``; then the store is asked for its data plane again."""

    fallback = True

    def __init__(self, ctx: TransportContext) -> None:
        self._down_until = 0.0
        super().__init__(ctx.grpc, DataPlane(ctx, strict=False, on_unreachable=self._down))

    def _down(self) -> None:
        self._down_until = time.monotonic() + DATA_RETRY_AFTER_S

    async def endpoint(self, req: Request) -> Endpoint | None:
        if time.monotonic() < self._down_until:
            return None
        return await self.plane.endpoint(req)


def _grpc_only(ctx: TransportContext) -> TransportPolicy:
    return GrpcOnly(ctx.grpc)


# kv.transport -> the policy a client uses
TRANSPORTS: dict[str, Callable[[TransportContext], TransportPolicy]] = {
    "grpc": _grpc_only,
    "data": DataOnly,
    "auto": Auto,
}
