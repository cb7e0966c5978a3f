"""The store's data-plane listener: one thread accepts, one thread per connection.

Each request runs through the gRPC service's own coroutines (budget, TTL, upload tokens,
slots, audit, metrics) via :class:`Handoff`; the connection thread only moves and checks
bytes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import socket
import ssl
import struct
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from google.protobuf.message import DecodeError

from pdx._proto import kv_transfer_pb2 as pb
from pdx.tcp import available_congestion_controls, buffer_limits, set_congestion_control
from pdx.tls import peer_common_name
from pdx.transfer.audit import AuditLog
from pdx.transfer.contract import KVError, KVErrorCode
from pdx.transfer.dataplane.framing import (
    DEFAULT_REQUEST_TIMEOUT_S,
    FRAME,
    HANDSHAKE_TIMEOUT_S,
    IDLE_TIMEOUT_S,
    MAX_HELLO_BYTES,
    MAX_REQUEST_BYTES,
    MAX_TRAILER_BYTES,
    VERSION,
    Conn,
    FrameError,
    Kind,
    connection_error,
    error_payload,
    new_buffer,
    peer_name,
    tls_handshake,
)
from pdx.transfer.dataplane.handoff import GetOutcome, Handoff, PutOutcome
from pdx.transfer.metrics import KVMetrics
from pdx.transfer.store import StoredObject
from pdx.transfer.wire import digest64

log = logging.getLogger(__name__)


class DataHandler(Protocol):
    """What the data plane hands each request to: the store's service, on the event loop
    (:class:`pdx.transfer.service.KVService` is one). It gets the request and a
    :class:`Handoff`; it gives the connection thread the object (or what to send) through
    it, and gets back a :class:`PutOutcome` / :class:`GetOutcome`."""

    audit: AuditLog
    metrics: KVMetrics

    def data_put(
        self, header: pb.PutHeader, who: str, peer: str, timeout_s: float | None, handoff: Handoff
    ) -> Coroutine[Any, Any, pb.PutResponse]:
        """A Put whose chunks a connection thread receives (it is handed the StoredObject)."""
        ...

    def data_get(
        self, request: pb.GetRequest, who: str, peer: str, timeout_s: float | None, handoff: Handoff
    ) -> Coroutine[Any, Any, None]:
        """A Get whose chunks a connection thread sends (it is handed info and chunks)."""
        ...


@dataclass(frozen=True)
class DataLimits:
    """What the data plane grants a peer before and after it is trusted (KVStoreConfig)."""

    max_connections: int = 256
    max_unauthenticated: int = 64
    max_connections_per_peer: int = 64
    max_unauthenticated_per_peer: int = 8
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S
    max_request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    stall_timeout_s: float = 10.0


class Admission:
    """Connection counts per source address: a small pool for connections that have not yet
    passed TLS and HELLO, per-peer caps on both, and the rest for authenticated ones, so a
    flood from one address neither exhausts the store nor starves other peers."""

    def __init__(self, limits: DataLimits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self.total = 0
        self.unauthenticated = 0
        self._per_peer: dict[str, list[int]] = {}  # ip -> [all, unauthenticated]

    def admit(self, ip: str) -> str | None:
        """Count a new connection from ``ip``; why it is refused, or None."""
        lim = self.limits
        with self._lock:
            mine = self._per_peer.setdefault(ip, [0, 0])
            why = None
            if self.total >= lim.max_connections:
                why = f"{self.total} connections open (max_connections)"
            elif self.unauthenticated >= lim.max_unauthenticated:
                why = f"{self.unauthenticated} not yet authenticated (max_unauthenticated)"
            elif mine[0] >= lim.max_connections_per_peer:
                why = f"{mine[0]} connections from it (max_connections_per_peer)"
            elif mine[1] >= lim.max_unauthenticated_per_peer:
                why = f"{mine[1]} of its connections not yet authenticated"
            if why is not None:
                if mine == [0, 0]:
                    del self._per_peer[ip]
                return why
            mine[0] += 1
            mine[1] += 1
            self.total += 1
            self.unauthenticated += 1
            return None

    def authenticated(self, ip: str) -> None:
        """The connection passed TLS and HELLO."""
        with self._lock:
            self._per_peer[ip][1] -= 1
            self.unauthenticated -= 1

    def leave(self, ip: str, *, authenticated: bool) -> None:
        """The connection ended."""
        with self._lock:
            mine = self._per_peer[ip]
            mine[0] -= 1
            self.total -= 1
            if not authenticated:
                mine[1] -= 1
                self.unauthenticated -= 1
            if mine == [0, 0]:
                del self._per_peer[ip]


class _Every:
    """At most ``per_s`` events a second pass; :meth:`take` says how many were left out."""

    def __init__(self, per_s: int) -> None:
        self.per_s = per_s
        self._second = 0
        self._count = 0
        self._left_out = 0
        self._lock = threading.Lock()

    def take(self) -> int | None:
        """None: leave this one out; else how many were left out since the last one passed."""
        with self._lock:
            now = int(time.monotonic())
            if now != self._second:
                self._second, self._count = now, 0
            if self._count >= self.per_s:
                self._left_out += 1
                return None
            self._count += 1
            left_out, self._left_out = self._left_out, 0
            return left_out


class _OneLine:
    """Log a recurring problem once a second at most (never a traceback per frame)."""

    def __init__(self) -> None:
        self._every = _Every(1)

    def note(self, message: str) -> None:
        left_out = self._every.take()
        if left_out is not None:
            log.warning("%s%s", message, f" ({left_out} more like it)" if left_out else "")


REJECTS_PER_S = 20


SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)  # Linux; bytes per second


class LinkPacer:
    """Keeps the store's Gets under ``max_get_gbps``: each connection sending a Get is paced
    at the cap divided by the connections sending at once, re-divided as Gets start and end.

    The kernel paces (``SO_MAX_PACING_RATE``: TCP's own pacing, or the fq qdisc where it is
    the root), so packets leave evenly spaced at the rate; a sleep between writes in Python
    would still let each write leave as a line-rate burst of a whole socket buffer, which is
    what takes the headroom a link verdict assumed.
    """

    def __init__(self, max_get_gbps: float | None, metrics: KVMetrics) -> None:
        self.bytes_per_s = (max_get_gbps or 0.0) * 1e9 / 8
        self.metrics = metrics
        self._sending: set[Conn] = set()
        self._lock = threading.Lock()
        metrics.link_cap.set(self.bytes_per_s * 8)

    @contextlib.contextmanager
    def sending(self, conn: Conn) -> Iterator[None]:
        """Pace ``conn`` (and re-pace the others) while it sends one Get."""
        if not self.bytes_per_s:
            yield
            return
        with self._lock:
            self._sending.add(conn)
            self._pace()
        try:
            yield
        finally:
            with self._lock:
                self._sending.discard(conn)
                self._pace()

    def _pace(self) -> None:
        self.metrics.paced.set(len(self._sending))
        if not self._sending:
            return
        rate = max(1, int(self.bytes_per_s / len(self._sending)))
        value = struct.pack("Q" if rate > 0xFFFFFFFE else "I", rate)
        for conn in self._sending:
            with contextlib.suppress(OSError):  # a socket closing under us
                conn.sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, value)


class DataServer:
    """The store's data-plane listener: one thread accepts, one thread per connection."""

    def __init__(
        self,
        service: DataHandler,
        loop: asyncio.AbstractEventLoop,
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
        max_frame_bytes: int,
        congestion_control: str = "system",
        max_send_buffer_bytes: int = 0,
        max_get_gbps: float | None = None,
        limits: DataLimits | None = None,
    ) -> None:
        self.service = service
        self.loop = loop
        self.ssl_context = ssl_context
        self.limits = limits or DataLimits()
        self.max_connections = self.limits.max_connections
        self.admission = Admission(self.limits)
        self.max_frame_bytes = max_frame_bytes
        self.available_cc = set(available_congestion_controls())
        self.congestion_control = (
            congestion_control if congestion_control in self.available_cc else None
        )
        self.max_send_buffer_bytes = max_send_buffer_bytes
        self.pacer = LinkPacer(max_get_gbps, service.metrics)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(128)
        self.port: int = self._listener.getsockname()[1]
        self._conns: set[Conn] = set()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._stopping = False
        self._acceptor = threading.Thread(target=self._accept_loop, name="pdx-kv-data", daemon=True)
        self._reject_audit = _Every(REJECTS_PER_S)
        self._refused = _OneLine()

    def start(self) -> None:
        """Start accepting."""
        self._acceptor.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop accepting, abort every connection, wait (bounded) for their threads."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
        for conn in conns:
            conn.abort()
        end = time.monotonic() + timeout_s
        for t in [self._acceptor, *threads]:
            if t.is_alive():
                t.join(max(0.0, end - time.monotonic()))

    def _accept_loop(self) -> None:
        while not self._stopping:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return  # listener closed
            ip = str(addr[0])
            why = self.admission.admit(ip)
            if why is not None:
                self._refused.note(f"data plane: refused a connection from {ip}: {why}")
                self.service.metrics.errors.labels(code="KV_OVERLOADED", side="store").inc()
                self._refuse(sock, why)
                continue
            t = threading.Thread(
                target=self._serve, args=(sock, ip), name="pdx-kv-conn", daemon=True
            )
            with self._lock:
                self._threads.add(t)
            t.start()

    def _refuse(self, sock: socket.socket, why: str) -> None:
        """Close a connection over the limits; a plaintext peer first reads why (one frame,
        never waited for: the accept loop must not block on a peer that does not read)."""
        with contextlib.suppress(OSError):
            if self.ssl_context is None:
                msg = f"data plane refused the connection: {why}"
                err = KVError(KVErrorCode.KV_UNAVAILABLE, msg)
                payload = error_payload(err)
                sock.setblocking(False)
                sock.send(FRAME.pack(Kind.ERROR, 0, 0, len(payload)) + payload)
        sock.close()

    # --- one connection -----------------------------------------------------------------

    def _serve(self, sock: socket.socket, ip: str) -> None:
        conn: Conn | None = None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.congestion_control:
                with contextlib.suppress(OSError):
                    set_congestion_control(sock, self.congestion_control)
            conn = self._open(sock)
            if conn is not None:
                self.admission.authenticated(ip)
                self._requests(conn)
        except Exception:  # a bug must not kill the listener; the client sees the close
            log.exception("data plane connection failed")
        finally:
            self.admission.leave(ip, authenticated=conn is not None)
            if conn is not None:
                with self._lock:
                    self._conns.discard(conn)
                conn.close()
            else:
                with contextlib.suppress(OSError):
                    sock.close()
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _open(self, sock: socket.socket) -> Conn | None:
        """TLS handshake (if any) and HELLO; rejected peers are audited and closed."""
        peer = peer_name(sock)
        who = "anonymous"
        # One deadline for TLS and HELLO together: a peer trickling a byte at a time cannot
        # hold an unauthenticated slot longer than handshake_timeout_s.
        deadline = time.monotonic() + self.limits.handshake_timeout_s
        try:
            conn: Conn
            if self.ssl_context is not None:
                conn = tls_handshake(
                    sock, self.ssl_context, server_side=True,
                    timeout_s=self.limits.handshake_timeout_s,
                )  # fmt: skip
                cn = peer_common_name(conn)
                if cn:
                    who = "cn=" + cn
            else:
                conn = Conn(sock)
            conn.set_deadline(deadline)
            _, payload = conn.recv_control(Kind.HELLO, limit=MAX_HELLO_BYTES)
            hello = pb.DataHello.FromString(payload)
        except ssl.SSLError as exc:
            self._audit_reject(peer, KVErrorCode.KV_UNAUTHENTICATED, f"TLS: {exc.reason or exc}")
            return None
        except (OSError, FrameError, ValueError, DecodeError) as exc:
            self._audit_reject(peer, KVErrorCode.KV_INVALID, f"no HELLO: {exc}")
            return None
        if hello.version != VERSION:
            err = KVError(KVErrorCode.KV_INVALID, f"version {hello.version!r}, expected {VERSION}")
            with contextlib.suppress(OSError, TimeoutError):
                conn.send_frame(Kind.ERROR, error_payload(err))
            self._audit_reject(peer, err.code, err.message)
            conn.close()
            return None
        if who == "anonymous" and hello.client_id:
            who = "client=" + hello.client_id[:128]
        conn.who = who
        self._tune(conn, hello)
        with self._lock:
            if self._stopping:
                conn.close()
                return None
            self._conns.add(conn)
        return conn

    def _tune(self, conn: Conn, hello: pb.DataHello) -> None:
        """What the client asked for its connection: the algorithm the store sends with (if
        this kernel has it) and a send buffer for the path's BDP (capped by the store)."""
        if hello.congestion_control in self.available_cc:
            with contextlib.suppress(OSError):
                set_congestion_control(conn.sock, hello.congestion_control)
        want = min(hello.send_buffer_bytes, self.max_send_buffer_bytes)
        auto = buffer_limits().tcp_wmem_max
        if want and auto is not None and want > auto:
            with contextlib.suppress(OSError):
                conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, want)

    def _audit_reject(self, peer: str, code: KVErrorCode, reason: str) -> None:
        """Audit a refused peer; past ``REJECTS_PER_S`` a second the rest are only counted,
        and the next record says how many were left out (a flood cannot grow the log)."""
        self.service.metrics.errors.labels(code=code.value, side="store").inc()
        left_out = self._reject_audit.take()
        if left_out is None:
            return
        self.loop.call_soon_threadsafe(
            lambda: self.service.audit.record(
                "connect",
                who="anonymous",
                peer=peer,
                transport="data",
                outcome=code.value,
                reason=reason,
                left_out=left_out or None,
            )
        )

    def _requests(self, conn: Conn) -> None:
        """Serve requests one after another until the client leaves or an error ends it."""
        while not self._stopping:
            conn.set_deadline(time.monotonic() + IDLE_TIMEOUT_S)
            try:
                head = conn.recv_header(eof_ok=True)
                if head is None:
                    return
                kind, _, _, length = head
                if kind is not Kind.REQUEST:
                    raise FrameError(f"got a {kind.name} frame, expected REQUEST")
                request = pb.DataRequest.FromString(conn.recv_payload(length, MAX_REQUEST_BYTES))
            except DecodeError:
                self._refused.note(f"data plane: a DataRequest from {conn.peer} did not parse")
                self._send_error(conn, KVError(KVErrorCode.KV_INVALID, "not a DataRequest"))
                return
            except (OSError, FrameError, ValueError):
                return  # idle timeout, client gone, or garbage: nothing to answer
            # The client's deadline, never more than the store allows (a peer that names
            # 49 days cannot hold a slot that long).
            cap_s = self.limits.max_request_timeout_s
            timeout_s = min(request.timeout_ms / 1000, cap_s) if request.timeout_ms else cap_s
            deadline = time.monotonic() + timeout_s
            conn.request_deadline = deadline
            conn.set_deadline(deadline + 0.5)  # the client gives up first
            op = request.WhichOneof("op")
            if op == "put":
                ok = self._put(conn, request.put, timeout_s)
            elif op == "get":
                ok = self._get(conn, request.get, timeout_s)
            else:
                self._send_error(conn, KVError(KVErrorCode.KV_INVALID, "empty DataRequest"))
                ok = False
            if not ok:
                return

    def _progress(self, conn: Conn) -> None:
        """Stall detection: the next frame must move within ``stall_timeout_s`` (and the whole
        request within its deadline), else the watchdog ends the connection. The deadline is
        pushed forward at most every second, not per chunk."""
        now = time.monotonic()
        stall = self.limits.stall_timeout_s
        if now + stall - conn.stall_deadline < 1.0:
            return
        conn.stall_deadline = min(now + stall, conn.request_deadline + 0.5)
        conn.set_deadline(conn.stall_deadline)

    def _stalled(self, conn: Conn, kv_id: str, resume: int | None) -> KVError | None:
        """The watchdog ended a request before its deadline: it made no progress."""
        if not conn.expired or time.monotonic() >= conn.request_deadline:
            return None
        stall = self.limits.stall_timeout_s
        return KVError(KVErrorCode.KV_TIMEOUT, f"no progress for {stall:g} s", kv_id=kv_id,
                       resume_chunk=resume)  # fmt: skip

    def _send_error(self, conn: Conn, exc: BaseException) -> None:
        if not isinstance(exc, KVError):
            exc = KVError(KVErrorCode.KV_INTERNAL, f"{type(exc).__name__}: {exc}")
        payload = error_payload(exc)
        with contextlib.suppress(OSError):
            # Not send_frame: this also runs after the deadline expired the reads.
            conn._send(FRAME.pack(Kind.ERROR, 0, 0, len(payload)) + payload)
            # Let the client read the error before the close: stop sending, drain briefly.
            conn.sock.shutdown(socket.SHUT_WR)
            conn.set_deadline(time.monotonic() + 1.0)
            scratch = memoryview(bytearray(1 << 20))
            for _ in range(256):
                if not conn.sock.recv_into(scratch):
                    break

    def _call(self, coro: Any) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def _put(self, conn: Conn, header: pb.PutHeader, timeout_s: float | None) -> bool:
        handoff = Handoff(self.loop)
        who = conn.who
        call = self._call(self.service.data_put(header, who, conn.peer, timeout_s, handoff))
        try:
            obj = handoff.wait(call, timeout_s or DEFAULT_REQUEST_TIMEOUT_S)
        except BaseException as exc:
            handoff.abandon(_as_kv_error(exc))
            self._send_error(conn, _as_kv_error(exc))
            return False
        outcome = PutOutcome()
        try:
            self._receive(conn, obj, header, outcome)
        except KVError as exc:
            outcome.error = exc
        except (OSError, FrameError) as exc:
            resume = header.start_chunk + len(outcome.chunks)
            outcome.error = self._stalled(conn, obj.kv_id, resume) or connection_error(
                exc, obj.kv_id, resume
            )
        handoff.deliver(outcome)
        try:
            response = call.result(timeout=30)
        except BaseException as exc:
            self._send_error(conn, _as_kv_error(exc))
            return False
        try:
            conn.send_frame(Kind.RESULT, response.SerializeToString())
        except (OSError, TimeoutError):
            return False
        return True

    def _receive(
        self, conn: Conn, obj: StoredObject, header: pb.PutHeader, out: PutOutcome
    ) -> None:
        """CHUNK frames from ``start_chunk`` on, each checked, then END (and a trailer)."""
        index = header.start_chunk
        while True:
            self._progress(conn)
            head = conn.recv_header()
            assert head is not None
            kind, got_index, digest, length = head
            if kind is Kind.END:
                return
            if kind is Kind.TRAILER and header.digest_in_trailer and out.trailer_digest is None:
                try:
                    out.trailer_digest = pb.PutTrailer.FromString(
                        conn.recv_payload(length, MAX_TRAILER_BYTES)
                    ).object_digest
                except DecodeError:
                    raise _corrupt(obj.kv_id, index, "the trailer did not parse") from None
                continue
            if kind is not Kind.CHUNK or out.trailer_digest is not None:
                raise _corrupt(obj.kv_id, index, f"got a {kind.name} frame, expected a chunk")
            if got_index != index or index >= obj.num_chunks or length != obj.chunk_len(index):
                raise _corrupt(obj.kv_id, index, f"got chunk {got_index} of {length} bytes")
            if obj.data[index] is None and obj.buffer is not None:  # straight into the object
                offset = index * obj.chunk_size_bytes
                view = obj.buffer[offset : offset + length]
            else:  # a chunk the store already holds (a retried stream): never overwrite it
                view = new_buffer(length)
            conn.recv_into(view)
            if digest64(view) != digest:
                self.service.metrics.corrupt.labels(side="store").inc()
                raise _corrupt(obj.kv_id, index, "digest mismatch")
            out.chunks.append((digest, view))
            out.nbytes += length
            obj.hash_verified(index, view)  # while the chunk is still in cache
            index += 1

    def _get(self, conn: Conn, request: pb.GetRequest, timeout_s: float | None) -> bool:
        handoff = Handoff(self.loop)
        who = conn.who
        call = self._call(self.service.data_get(request, who, conn.peer, timeout_s, handoff))
        try:
            info, chunks, last_leaves = handoff.wait(call, timeout_s or DEFAULT_REQUEST_TIMEOUT_S)
        except BaseException as exc:
            handoff.abandon(_as_kv_error(exc))
            self._send_error(conn, _as_kv_error(exc))
            return False
        outcome = GetOutcome()
        try:
            # The store records the Get just before its last frame leaves (the audit log then
            # holds every byte the client can have read): last_leaves(bytes, chunks).
            if not chunks:
                last_leaves(0, 0)
            with self.pacer.sending(conn):
                conn.send_frame(Kind.INFO, info.SerializeToString())
                for n, (index, digest, data) in enumerate(chunks, 1):
                    self._progress(conn)
                    if n == len(chunks):
                        last_leaves(outcome.nbytes + len(data), n)
                    conn.send_chunk(index, digest, data)
                    outcome.nbytes += len(data)
                    outcome.chunks += 1
        except (OSError, TimeoutError) as exc:
            outcome.error = self._stalled(conn, request.kv_id, None) or connection_error(
                exc, request.kv_id, None
            )
        handoff.deliver(outcome)
        with contextlib.suppress(BaseException):
            call.result(timeout=30)
        return outcome.error is None


def _corrupt(kv_id: str, index: int, why: str) -> KVError:
    return KVError(KVErrorCode.KV_CORRUPT, f"chunk {index}: {why}", kv_id=kv_id, resume_chunk=index)


def _as_kv_error(exc: BaseException) -> KVError:
    if isinstance(exc, KVError):
        return exc
    if isinstance(exc, TimeoutError | concurrent.futures.TimeoutError):
        return KVError(KVErrorCode.KV_TIMEOUT, "deadline passed in the store")
    if isinstance(exc, concurrent.futures.CancelledError | asyncio.CancelledError):
        return KVError(KVErrorCode.KV_UNAVAILABLE, "store shutting down")
    return KVError(KVErrorCode.KV_INTERNAL, f"{type(exc).__name__}: {exc}")
