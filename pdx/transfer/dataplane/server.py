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
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdx._proto import kv_transfer_pb2 as pb
from pdx.tcp import available_congestion_controls, buffer_limits, set_congestion_control
from pdx.transfer.contract import KVError, KVErrorCode
from pdx.transfer.dataplane.framing import (
    DEFAULT_REQUEST_TIMEOUT_S,
    FRAME,
    HANDSHAKE_TIMEOUT_S,
    IDLE_TIMEOUT_S,
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
from pdx.transfer.wire import digest64

if TYPE_CHECKING:
    from pdx.transfer.service import KVService
    from pdx.transfer.store import StoredObject

log = logging.getLogger(__name__)


class Handoff:
    """Hands a store object from the loop to a connection thread and the result back.

    The service coroutine calls :meth:`exchange` (on the loop) once it holds the object;
    the connection thread waits for it with :meth:`wait`, moves the bytes, and answers
    with :meth:`deliver`.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.given: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._answer: asyncio.Future[Any] | None = None
        self._abandoned: BaseException | None = None

    async def exchange(self, value: Any) -> Any:
        """(loop) Give ``value`` to the thread; wait for what it delivers."""
        if self._abandoned is not None:  # the thread stopped waiting for us
            raise self._abandoned
        self._answer = self.loop.create_future()
        self.given.set_result(value)
        return await self._answer

    def abandon(self, exc: BaseException) -> None:
        """(thread) Stop waiting: an :meth:`exchange` now or later raises ``exc``.

        Without this, a request whose store side got going only after the connection
        thread gave up would wait for an answer forever, holding its slot.
        """

        def mark() -> None:
            self._abandoned = exc
            if self._answer is not None and not self._answer.done():
                self._answer.set_exception(exc)

        self.loop.call_soon_threadsafe(mark)

    def wait(self, call: concurrent.futures.Future[Any], timeout_s: float) -> Any:
        """(thread) The value given, or the call's own outcome if it ended before giving one."""
        done, _ = concurrent.futures.wait(
            [self.given, call], timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED
        )
        if self.given in done:
            return self.given.result()
        if call in done:
            call.result()  # raises the store's error (e.g. KV_NOT_FOUND)
            raise KVError(KVErrorCode.KV_INTERNAL, "request ended without an answer")
        raise TimeoutError("store did not answer in time")

    def deliver(self, value: Any) -> None:
        """(thread) Send the result back to the waiting coroutine."""

        def put() -> None:
            if self._answer is not None and not self._answer.done():
                self._answer.set_result(value)

        self.loop.call_soon_threadsafe(put)


@dataclass
class PutOutcome:
    """What a connection thread received for one Put stream."""

    chunks: list[tuple[int, memoryview]] = field(default_factory=list)
    nbytes: int = 0
    trailer_digest: int | None = None
    error: KVError | None = None


@dataclass
class GetOutcome:
    """What a connection thread sent for one Get."""

    nbytes: int = 0
    chunks: int = 0
    error: KVError | None = None


class DataServer:
    """The store's data-plane listener: one thread accepts, one thread per connection."""

    def __init__(
        self,
        service: KVService,
        loop: asyncio.AbstractEventLoop,
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
        max_connections: int = 256,
        max_frame_bytes: int,
        congestion_control: str = "system",
        max_send_buffer_bytes: int = 0,
    ) -> None:
        self.service = service
        self.loop = loop
        self.ssl_context = ssl_context
        self.max_connections = max_connections
        self.max_frame_bytes = max_frame_bytes
        self.available_cc = set(available_congestion_controls())
        self.congestion_control = (
            congestion_control if congestion_control in self.available_cc else None
        )
        self.max_send_buffer_bytes = max_send_buffer_bytes
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
                sock, _ = self._listener.accept()
            except OSError:
                return  # listener closed
            with self._lock:
                full = len(self._threads) >= self.max_connections
            if full:
                log.warning("data plane: %d connections open, refusing one", self.max_connections)
                sock.close()
                continue
            t = threading.Thread(target=self._serve, args=(sock,), name="pdx-kv-conn", daemon=True)
            with self._lock:
                self._threads.add(t)
            t.start()

    # --- one connection -----------------------------------------------------------------

    def _serve(self, sock: socket.socket) -> None:
        conn: Conn | None = None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.congestion_control:
                with contextlib.suppress(OSError):
                    set_congestion_control(sock, self.congestion_control)
            conn = self._open(sock)
            if conn is not None:
                self._requests(conn)
        except Exception:  # a bug must not kill the listener; the client sees the close
            log.exception("data plane connection failed")
        finally:
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
        try:
            conn: Conn
            if self.ssl_context is not None:
                conn = tls_handshake(sock, self.ssl_context, server_side=True)
                from pdx.tls import peer_common_name

                cn = peer_common_name(conn)
                if cn:
                    who = "cn=" + cn
            else:
                conn = Conn(sock)
            conn.set_deadline(time.monotonic() + HANDSHAKE_TIMEOUT_S)
            _, payload = conn.recv_control(Kind.HELLO)
            hello = pb.DataHello.FromString(payload)
        except ssl.SSLError as exc:
            self._audit_reject(peer, KVErrorCode.KV_UNAUTHENTICATED, f"TLS: {exc.reason or exc}")
            return None
        except (OSError, FrameError, ValueError) as exc:
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
        self.service.metrics.errors.labels(code=code.value, side="store").inc()
        self.loop.call_soon_threadsafe(
            lambda: self.service.audit.record(
                "connect",
                who="anonymous",
                peer=peer,
                transport="data",
                outcome=code.value,
                reason=reason,
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
                request = pb.DataRequest.FromString(conn.recv_payload(length))
            except (OSError, FrameError, ValueError):
                return  # idle timeout, client gone, or garbage: nothing to answer
            timeout_s = request.timeout_ms / 1000 if request.timeout_ms else None
            deadline = time.monotonic() + (timeout_s or DEFAULT_REQUEST_TIMEOUT_S)
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
            outcome.error = connection_error(
                exc, obj.kv_id, header.start_chunk + len(outcome.chunks)
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
            head = conn.recv_header()
            assert head is not None
            kind, got_index, digest, length = head
            if kind is Kind.END:
                return
            if kind is Kind.TRAILER and header.digest_in_trailer and out.trailer_digest is None:
                out.trailer_digest = pb.PutTrailer.FromString(
                    conn.recv_payload(length)
                ).object_digest
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
            info, chunks = handoff.wait(call, timeout_s or DEFAULT_REQUEST_TIMEOUT_S)
        except BaseException as exc:
            handoff.abandon(_as_kv_error(exc))
            self._send_error(conn, _as_kv_error(exc))
            return False
        outcome = GetOutcome()
        try:
            conn.send_frame(Kind.INFO, info.SerializeToString())
            for index, digest, data in chunks:
                conn.send_chunk(index, digest, data)
                outcome.nbytes += len(data)
                outcome.chunks += 1
        except (OSError, TimeoutError) as exc:
            outcome.error = connection_error(exc, request.kv_id, None)
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
