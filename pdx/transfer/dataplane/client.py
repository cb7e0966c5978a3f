"""The client side of the data plane: dialing, a connection pool, one Put or Get stream.

Everything here runs in worker threads of :class:`pdx.transfer.client.KVClient`.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdx._proto import kv_transfer_pb2 as pb
from pdx.tcp import (
    bdp_bytes,
    buffer_limits,
    congestion_control,
    set_congestion_control,
    tcp_info,
    window_for,
)
from pdx.transfer.contract import KVError, KVErrorCode
from pdx.transfer.dataplane.framing import (
    VERSION,
    Conn,
    FrameError,
    Kind,
    connection_error,
    error_from_payload,
    tls_handshake,
)
from pdx.transfer.wire import digest64


class DataPlaneUnreachable(KVError):
    """The data plane could not be dialed, nothing moved yet (``KV_UNAVAILABLE``, or
    ``KV_TIMEOUT`` when the deadline passed while dialing)."""


@dataclass(frozen=True)
class Endpoint:
    """Where a store's data plane listens, as this client dials it, and how to dial it.

    ``congestion_control``: the TCP algorithm for this side's socket and asked of the store
    for its side (None = the systems' defaults). ``link_gbps``: when known, both sides'
    buffers are sized to twice the path's bandwidth-delay product (the RTT is TCP's own,
    from the handshake), up to the kernel's limits.
    """

    host: str
    port: int
    ssl_context: ssl.SSLContext | None
    client_id: str
    congestion_control: str | None = None
    link_gbps: float | None = None

    def connect(self, deadline: float) -> Conn:
        """Dial, handshake (TLS), say HELLO. Errors map to contract errors."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise KVError(KVErrorCode.KV_TIMEOUT, "deadline passed before connecting")
        try:
            sock = _dial(self.host, self.port, left, self.congestion_control)
        except TimeoutError:
            raise DataPlaneUnreachable(
                KVErrorCode.KV_TIMEOUT, f"data plane {self.host}:{self.port}: connect timed out"
            ) from None
        except OSError as exc:
            raise DataPlaneUnreachable(
                KVErrorCode.KV_UNAVAILABLE, f"data plane {self.host}:{self.port}: {exc}"
            ) from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            info = tcp_info(sock)
            rtt_ms = info.rtt_ms if info is not None else None
            buffer = self._size_buffers(sock, rtt_ms)
            conn: Conn
            if self.ssl_context is not None:
                left = max(0.001, deadline - time.monotonic())
                conn = tls_handshake(
                    sock, self.ssl_context, server_side=False, hostname=self.host, timeout_s=left
                )
            else:
                conn = Conn(sock)
            conn.rtt_ms = rtt_ms
            conn.congestion_control = congestion_control(sock)
            conn.set_deadline(deadline)
            hello = pb.DataHello(
                version=VERSION,
                client_id=self.client_id,
                congestion_control=self.congestion_control or "",
                send_buffer_bytes=buffer,
            )
            conn.send_frame(Kind.HELLO, hello.SerializeToString())
            return conn
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError) as exc:
            # Closed before the handshake finished: refused at the store's connection limit
            # (a certificate the store rejects ends in an alert, not a bare close).
            sock.close()
            raise DataPlaneUnreachable(
                KVErrorCode.KV_UNAVAILABLE,
                f"data plane {self.host}:{self.port} closed the "
                f"connection during the TLS handshake ({exc.reason or exc})",
            ) from None
        except ssl.SSLError as exc:
            sock.close()
            raise KVError(KVErrorCode.KV_UNAUTHENTICATED, f"TLS: {exc.reason or exc}") from None
        except ConnectionError as exc:
            sock.close()
            raise DataPlaneUnreachable(
                KVErrorCode.KV_UNAVAILABLE, f"data plane {self.host}:{self.port}: {exc}"
            ) from None
        except TimeoutError:
            sock.close()
            raise KVError(KVErrorCode.KV_TIMEOUT, "TLS handshake timed out") from None
        except OSError as exc:
            sock.close()
            raise KVError(KVErrorCode.KV_UNAVAILABLE, f"data plane: {exc}") from None

    def _size_buffers(self, sock: socket.socket, rtt_ms: float | None) -> int:
        """Buffers for twice the BDP where autotuning would stop short; the size (0: none)."""
        if not self.link_gbps or not rtt_ms:
            return 0
        want = window_for(bdp_bytes(self.link_gbps * 1e9, rtt_ms))
        limits = buffer_limits()
        sides = ((socket.SO_SNDBUF, limits.tcp_wmem_max, limits.wmem_max),
                 (socket.SO_RCVBUF, limits.tcp_rmem_max, limits.rmem_max))  # fmt: skip
        for opt, auto, core in sides:
            if auto is not None and want > auto and core:
                # An explicit size stops autotuning: set it only where it is larger; the
                # kernel caps it at net.core.*mem_max (and doubles it for bookkeeping).
                sock.setsockopt(socket.SOL_SOCKET, opt, min(want, core))
        return want


def _dial(host: str, port: int, timeout_s: float, cc: str | None) -> socket.socket:
    """A connected TCP socket, with congestion control ``cc`` set before the SYN."""
    last: OSError | None = None
    for family, kind, proto, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            if cc:
                with contextlib.suppress(OSError):  # the kernel lacks it: the default stays
                    set_congestion_control(sock, cc)
            sock.settimeout(timeout_s)
            sock.connect(addr)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
    raise last or OSError(f"cannot resolve {host}")


class ConnPool:
    """Idle data-plane connections of one client, reused across requests."""

    def __init__(self, limit: int = 16) -> None:
        self.limit = limit
        self._idle: list[Conn] = []
        self._lock = threading.Lock()

    def take(self) -> Conn | None:
        with self._lock:
            return self._idle.pop() if self._idle else None

    def give(self, conn: Conn) -> None:
        with self._lock:
            if len(self._idle) < self.limit and not conn.closed:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def client_error(exc: BaseException, kv_id: str, resume: int | None) -> KVError:
    """A failure in a client worker thread as a contract error."""
    if isinstance(exc, KVError):
        return exc
    if isinstance(exc, ssl.SSLError) and "CERTIFICATE" in str(exc.reason or exc).upper():
        return KVError(KVErrorCode.KV_UNAUTHENTICATED, f"TLS: {exc.reason or exc}", kv_id=kv_id)
    return connection_error(exc, kv_id, resume)


def read_answer(conn: Conn, ok: Kind, kv_id: str) -> bytes:
    """The payload of an ``ok`` frame; an ERROR frame raises its KVError."""
    kind, payload = conn.recv_control(ok, Kind.ERROR)
    if kind is Kind.ERROR:
        raise error_from_payload(payload, kv_id)
    return payload


def put_stream(
    conn: Conn, header: pb.PutHeader, view: memoryview, first: int, end: int, timeout_ms: int
) -> pb.PutResponse:
    """(worker thread) One Put over the data plane: chunks ``first .. end-1``."""
    import xxhash

    request = pb.DataRequest(timeout_ms=timeout_ms, put=header)
    conn.send_frame(Kind.REQUEST, request.SerializeToString())
    size = header.chunk_size_bytes
    whole = xxhash.xxh3_64() if header.digest_in_trailer else None
    try:
        for i in range(first, end):
            part = view[i * size : (i + 1) * size]
            if whole is not None:
                whole.update(part)
            conn.send_chunk(i, digest64(part), part)
            if conn.answered():  # the store refused the stream early: read why
                break
        else:
            if whole is not None:
                trailer = pb.PutTrailer(object_digest=whole.intdigest())
                conn.send_frame(Kind.TRAILER, trailer.SerializeToString())
            conn.send_frame(Kind.END)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the store closed after an ERROR frame: read it below
    return pb.PutResponse.FromString(read_answer(conn, Kind.RESULT, ""))


def get_stream(
    conn: Conn,
    request: pb.GetRequest,
    timeout_ms: int,
    on_info: Callable[[pb.ObjectInfo], None],
    on_chunk: Callable[[int, int, int], memoryview],
    on_verified: Callable[[int, int, memoryview], None],
) -> None:
    """(worker thread) One Get over the data plane.

    ``on_info`` checks the object description; ``on_chunk(index, digest, length)``
    checks a chunk header and returns where its bytes go; ``on_verified`` is called
    after the bytes arrived.
    """
    req = pb.DataRequest(timeout_ms=timeout_ms, get=request)
    conn.send_frame(Kind.REQUEST, req.SerializeToString())
    info = pb.ObjectInfo.FromString(read_answer(conn, Kind.INFO, request.kv_id))
    on_info(info)
    end = request.to_chunk or info.num_chunks
    for i in range(request.from_chunk, end):
        head = conn.recv_header()
        assert head is not None
        kind, index, digest, length = head
        if kind is Kind.ERROR:
            raise error_from_payload(conn.recv_payload(length), request.kv_id)
        if kind is not Kind.CHUNK or index != i:
            raise FrameError(f"chunk {i}: got a {kind.name} frame for chunk {index}")
        view = on_chunk(i, digest, length)
        conn.recv_into(view)
        on_verified(i, digest, view)
