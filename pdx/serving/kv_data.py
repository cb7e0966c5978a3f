"""The KV data plane: Put and Get with raw chunk payloads over a plain or TLS 1.3 socket.

Why a second socket next to gRPC: gRPC Python copies every payload byte about three
times on the way in and out (bench_transfer measured 0.36-0.49x of iperf3 with every
channel option tried). Here a chunk is received straight into its own buffer with
``recv_into`` and sent from the caller's memory with ``sendmsg``: the kernel's copy is
the only one. Framing, kinds and message types are specified in
``contracts/kv_transfer.proto`` (section "Bulk data plane"); the rules (TTL, budget,
checksums, resume, errors, audit) are the same as over gRPC because every store action
runs in the gRPC service's own coroutines (:meth:`KVService.data_put`,
:meth:`KVService.data_get`) on the store's event loop. Sockets are blocking and each
lives in one thread (connection threads on the store, worker threads on the client):
``recv_into``, ``sendmsg``, TLS and xxHash all release the interpreter lock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import heapq
import logging
import mmap
import select
import socket
import ssl
import struct
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pdx._proto import kv_transfer_pb2 as pb
from pdx.serving.contract import KVError, KVErrorCode
from pdx.serving.kv_wire import digest64

if TYPE_CHECKING:
    from pdx.serving.kv_server import KVService
    from pdx.serving.store import StoredObject

log = logging.getLogger(__name__)

VERSION = "pdx.kv.v1"
FRAME = struct.Struct("<B3xIQQ")  # kind, index, digest, length
MAX_CONTROL_BYTES = 16 * 1024 * 1024  # ObjectInfo lists up to 2**20 chunk digests
HANDSHAKE_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 60.0  # the store closes a connection with no request for this long
DEFAULT_REQUEST_TIMEOUT_S = 300.0  # a request that names no deadline


class Kind(enum.IntEnum):
    """Frame kinds (see kv_transfer.proto)."""

    HELLO = 1
    REQUEST = 3
    CHUNK = 4
    TRAILER = 5
    END = 6
    RESULT = 7
    INFO = 9
    ERROR = 10


class FrameError(Exception):
    """The byte stream does not follow the framing (garbled or out of step)."""


class PeerClosed(ConnectionError):
    """The other side closed the connection."""


class DataPlaneUnreachable(KVError):
    """The data plane could not be dialed, nothing moved yet (``KV_UNAVAILABLE``, or
    ``KV_TIMEOUT`` when the deadline passed while dialing)."""


def new_buffer(nbytes: int) -> memoryview:
    """A writable buffer for received bytes, not zero-filled first (they are overwritten)."""
    return memoryview(np.empty(nbytes, dtype=np.uint8)).cast("B")  # type: ignore[arg-type]


class BufferPool:
    """Whole-object receive buffers, handed back automatically once nobody uses them.

    Fresh memory costs a page fault per 4 KiB on first touch: receiving 1 GB into new
    memory took about as much CPU as the transfer itself on a 2-core test box. Each
    buffer is an anonymous mapping viewed through a numpy array; when the last view
    of that array is gone, the mapping (its pages still faulted in) returns here for
    the next object of about the same size. Free mappings are bounded in bytes.
    """

    MIN_BYTES = 1 << 20  # smaller objects: plain heap memory
    GRAIN = 1 << 20

    def __init__(self, max_free_bytes: int = 1 << 30) -> None:
        self.max_free_bytes = max_free_bytes
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self.reused = 0
        self.allocated = 0

    def get(self, nbytes: int) -> memoryview:
        """A buffer of exactly ``nbytes`` (contents undefined)."""
        if nbytes < self.MIN_BYTES:
            return new_buffer(nbytes)
        with self._lock:
            fits = [m for m in self._free if nbytes <= len(m) <= 2 * nbytes]
            area = min(fits, key=len) if fits else None
            if area is not None:
                self._free.remove(area)
                self.reused += 1
        if area is None:
            area = mmap.mmap(-1, -(-nbytes // self.GRAIN) * self.GRAIN)
            self.allocated += 1
        arr = np.frombuffer(area, dtype=np.uint8, count=nbytes)
        weakref.finalize(arr, self._give_back, area)
        return memoryview(arr).cast("B")  # type: ignore[arg-type]

    def _give_back(self, area: mmap.mmap) -> None:
        with self._lock:
            self._free.append(area)
            self._free.sort(key=len)
            while sum(len(m) for m in self._free) > self.max_free_bytes:
                self._free.pop(0)  # keep the large ones: they cost the most to fault in


BUFFERS = BufferPool()


class Watchdog:
    """Ends socket calls that run past their deadline, for every connection in the process.

    Data-plane sockets are blocking with no per-call timeout: a timeout makes Python
    poll before every read, and TLS reads come one 16 KiB record at a time, so per-call
    timeouts cost about a tenth of the throughput. Instead one thread keeps the
    deadlines in a heap and shuts a connection down when its deadline passes; the
    blocked call returns at once and the connection reports ``TimeoutError``.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Conn, int]] = []
        self._cv = threading.Condition()
        self._seq = 0
        self._thread: threading.Thread | None = None

    def watch(self, deadline: float, conn: Conn, token: int) -> None:
        with self._cv:
            self._seq += 1
            heapq.heappush(self._heap, (deadline, self._seq, conn, token))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="pdx-kv-watchdog", daemon=True
                )
                self._thread.start()
            if self._heap[0][2] is conn:
                self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap:
                    self._cv.wait()
                deadline, _, conn, token = self._heap[0]
                left = deadline - time.monotonic()
                if left > 0:
                    self._cv.wait(left)
                    continue
                heapq.heappop(self._heap)
            conn.expire(token)


WATCHDOG = Watchdog()


class Conn:
    """One data-plane socket with framing helpers. Blocking; one thread uses it at a time.

    :meth:`set_deadline` bounds everything that follows: at the deadline the
    :class:`Watchdog` shuts the socket down and the blocked call raises ``TimeoutError``,
    so a stalled peer never makes a hang.
    """

    def __init__(self, sock: socket.socket) -> None:
        sock.settimeout(None)
        self.sock = sock
        self.tls = False
        self.who = "anonymous"  # store side: the audited identity of the peer
        self.peer = _peer_name(sock)
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN)
        self._hdr = bytearray(FRAME.size)
        self.closed = False
        self.expired = False
        self._token = 0

    def set_deadline(self, deadline: float | None) -> None:
        """Bound every later call by ``deadline`` (``time.monotonic()``; None = no bound)."""
        self._token += 1
        if deadline is not None:
            WATCHDOG.watch(deadline, self, self._token)

    def expire(self, token: int) -> None:
        """(watchdog) The deadline set with ``token`` passed: end the connection.

        First only the reading side is shut, which wakes a blocked read and still lets
        this side say why (an ERROR frame); a call still blocked half a second later
        (a send to a peer that stopped reading) gets the whole socket shut.
        """
        if token != self._token or self.closed:
            return
        if not self.expired:
            self.expired = True
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RD)
            WATCHDOG.watch(time.monotonic() + 0.5, self, token)
        else:
            self.abort()

    def _arm(self) -> None:
        if self.expired:
            raise TimeoutError("deadline passed")

    def _failed(self, exc: OSError) -> OSError:
        """What a socket error means: a timeout if the watchdog ended the connection."""
        return TimeoutError("deadline passed") if self.expired else exc

    # --- sending ----------------------------------------------------------------------

    def send_frame(
        self, kind: Kind, payload: bytes = b"", *, index: int = 0, digest: int = 0
    ) -> None:
        """One frame with a control payload (a serialised message, or nothing)."""
        self._arm()
        try:
            self._send(FRAME.pack(kind, index, digest, len(payload)) + payload)
        except OSError as exc:
            raise self._failed(exc) from None

    def _send(self, *parts: bytes | memoryview) -> None:
        for part in parts:
            self.sock.sendall(part)

    def _recv_some(self, view: memoryview, n: int) -> int:
        return self.sock.recv_into(view, n)

    def send_chunk(self, index: int, digest: int, data: memoryview) -> None:
        """A CHUNK frame sent from ``data`` itself (no copy into a message)."""
        header = FRAME.pack(Kind.CHUNK, index, digest, len(data))
        self._arm()
        try:
            if self.tls:
                self._send(header, data)
                return
            parts: list[memoryview] = [memoryview(header), data]
            while parts:
                sent = self.sock.sendmsg(parts)
                while parts and sent >= len(parts[0]):
                    sent -= len(parts[0])
                    parts.pop(0)
                if parts and sent:
                    parts[0] = parts[0][sent:]
        except OSError as exc:
            raise self._failed(exc) from None

    def answered(self) -> bool:
        """Whether the peer has sent something (an early ERROR during a Put)."""
        return bool(self._poll.poll(0))

    # --- receiving --------------------------------------------------------------------

    def recv_into(self, view: memoryview) -> None:
        """Fill ``view`` exactly from the socket."""
        got, n = 0, len(view)
        recv = self._recv_some
        self._arm()
        try:
            while got < n:  # TLS hands out one 16 KiB record per call: keep this loop lean
                k = recv(view[got:], n - got)
                if not k:
                    break
                got += k
        except OSError as exc:
            raise self._failed(exc) from None
        if got < n:
            self._arm()
            raise PeerClosed("connection closed mid-frame")

    def recv_header(self, *, eof_ok: bool = False) -> tuple[Kind, int, int, int] | None:
        """The next frame header; None at a clean end of stream when ``eof_ok``."""
        view = memoryview(self._hdr)
        self._arm()
        try:
            k = self._recv_some(view, len(view))
        except OSError as exc:
            raise self._failed(exc) from None
        if not k:
            self._arm()
            if eof_ok:
                return None
            raise PeerClosed("connection closed")
        if k < len(view):
            self.recv_into(view[k:])
        kind, index, digest, length = FRAME.unpack(self._hdr)
        try:
            return Kind(kind), index, digest, length
        except ValueError:
            raise FrameError(f"unknown frame kind {kind}") from None

    def recv_payload(self, length: int) -> bytes:
        """A control payload of ``length`` bytes (bounded)."""
        if length > MAX_CONTROL_BYTES:
            raise FrameError(f"control frame of {length} bytes")
        buf = bytearray(length)
        self.recv_into(memoryview(buf))
        return bytes(buf)

    def recv_control(self, *expected: Kind) -> tuple[Kind, bytes]:
        """The next frame, which must be one of ``expected`` control kinds."""
        head = self.recv_header()
        assert head is not None
        kind, _, _, length = head
        if kind not in expected:
            raise FrameError(
                f"got a {kind.name} frame, expected {'/'.join(k.name for k in expected)}"
            )
        return kind, self.recv_payload(length)

    # --- closing ----------------------------------------------------------------------

    def abort(self) -> None:
        """Wake any thread blocked on this socket and close it (from any thread)."""
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()

    close = abort


class TLSConn(Conn):
    """A data-plane connection under TLS, with OpenSSL working on memory buffers.

    Why not ``ssl.SSLSocket``: it makes OpenSSL read each 16 KiB record with two small
    ``read`` calls and write it with one ``write``, about 200 system calls per MiB each
    way. Here whole MiB-sized reads and writes go to the socket and OpenSSL en- and
    decrypts between memory buffers: one extra memory copy per side, far fewer system
    calls; about 20 % more goodput on the 2-core test box (raw stream, 1 GiB, 1 MiB
    writes: 1.65-1.78 against 1.33-1.41 GB/s).
    """

    READ_BYTES = 1 << 20

    def __init__(self, sock: socket.socket, tls: ssl.SSLObject, inc: ssl.MemoryBIO,
                 out: ssl.MemoryBIO) -> None:  # fmt: skip
        super().__init__(sock)
        self.tls = True
        self.tls_object = tls
        self._in = inc
        self._out = out
        self._raw = memoryview(bytearray(self.READ_BYTES))

    def _flush(self) -> None:
        if self._out.pending:
            self.sock.sendall(self._out.read())

    def _send(self, *parts: bytes | memoryview) -> None:
        for part in parts:
            self.tls_object.write(part)
        self._flush()

    def _recv_some(self, view: memoryview, n: int) -> int:
        while True:
            try:
                return self.tls_object.read(n, view)  # type: ignore[return-value]  # an int with a buffer
            except ssl.SSLWantReadError:
                k = self.sock.recv_into(self._raw)
                if not k:
                    return 0
                self._in.write(self._raw[:k])
            except ssl.SSLZeroReturnError:  # the peer's close_notify
                return 0

    def getpeercert(self) -> Any:
        """The verified peer certificate (as ``SSLSocket.getpeercert``)."""
        return self.tls_object.getpeercert()


def tls_handshake(
    sock: socket.socket,
    ctx: ssl.SSLContext,
    *,
    server_side: bool,
    hostname: str | None = None,
    timeout_s: float = HANDSHAKE_TIMEOUT_S,
) -> TLSConn:
    """Run the TLS handshake over ``sock`` (bounded by ``timeout_s``); a :class:`TLSConn`.

    A failure raises ``ssl.SSLError`` after the alert (e.g. "certificate required") has
    been sent to the peer, so the other side learns why.
    """
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(inc, out, server_side=server_side, server_hostname=hostname)
    sock.settimeout(timeout_s)
    while True:
        try:
            tls.do_handshake()
            break
        except ssl.SSLWantReadError:
            if out.pending:
                sock.sendall(out.read())
            data = sock.recv(65536)
            if not data:
                raise ConnectionResetError("closed during the TLS handshake") from None
            inc.write(data)
        except ssl.SSLError:
            if out.pending:  # the alert that tells the peer why
                with contextlib.suppress(OSError):
                    sock.sendall(out.read())
            raise
    if out.pending:
        sock.sendall(out.read())
    return TLSConn(sock, tls, inc, out)


def _peer_name(sock: socket.socket) -> str:
    """``ipv4:HOST:PORT`` / ``ipv6:[HOST]:PORT``, as gRPC names peers in the audit log."""
    try:
        addr = sock.getpeername()
    except OSError:
        return "unknown"
    if sock.family == socket.AF_INET6:
        return f"ipv6:[{addr[0]}]:{addr[1]}"
    return f"ipv4:{addr[0]}:{addr[1]}"


def error_payload(exc: KVError) -> bytes:
    """A DataError for ``exc``."""
    msg = pb.DataError(code=pb.KVErrorCode.Value(exc.code.value), message=exc.message)
    if exc.resume_chunk is not None:
        msg.has_resume_chunk = True
        msg.resume_chunk = exc.resume_chunk
    return msg.SerializeToString()


def error_from_payload(payload: bytes, kv_id: str) -> KVError:
    """The KVError a DataError frame carries."""
    msg = pb.DataError.FromString(payload)
    try:
        code = KVErrorCode(pb.KVErrorCode.Name(msg.code))
    except ValueError:
        code = KVErrorCode.KV_INTERNAL
    resume = msg.resume_chunk if msg.has_resume_chunk else None
    return KVError(code, msg.message, kv_id=kv_id, resume_chunk=resume)


# --- store side ---------------------------------------------------------------------------


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
    ) -> None:
        self.service = service
        self.loop = loop
        self.ssl_context = ssl_context
        self.max_connections = max_connections
        self.max_frame_bytes = max_frame_bytes
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
        peer = _peer_name(sock)
        who = "anonymous"
        try:
            conn: Conn
            if self.ssl_context is not None:
                conn = tls_handshake(sock, self.ssl_context, server_side=True)
                from pdx.serving.tls import peer_common_name

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
        with self._lock:
            if self._stopping:
                conn.close()
                return None
            self._conns.add(conn)
        return conn

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
            outcome.error = _connection_error(
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
            outcome.error = _connection_error(exc, request.kv_id, None)
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


def _connection_error(exc: BaseException, kv_id: str, resume: int | None) -> KVError:
    """A socket failure mid-transfer as the contract error the caller can act on."""
    if isinstance(exc, TimeoutError):
        return KVError(KVErrorCode.KV_TIMEOUT, "deadline passed mid-transfer", kv_id=kv_id)
    if isinstance(exc, FrameError):
        return KVError(KVErrorCode.KV_CORRUPT, str(exc), kv_id=kv_id, resume_chunk=resume)
    if isinstance(exc, ssl.SSLError):
        return KVError(KVErrorCode.KV_UNAVAILABLE, f"TLS: {exc.reason or exc}", kv_id=kv_id)
    return KVError(KVErrorCode.KV_UNAVAILABLE, f"connection lost: {exc}", kv_id=kv_id)


# --- client side ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    """Where a store's data plane listens, as this client dials it."""

    host: str
    port: int
    ssl_context: ssl.SSLContext | None
    client_id: str

    def connect(self, deadline: float) -> Conn:
        """Dial, handshake (TLS), say HELLO. Errors map to contract errors."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise KVError(KVErrorCode.KV_TIMEOUT, "deadline passed before connecting")
        try:
            sock = socket.create_connection((self.host, self.port), timeout=left)
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
            conn: Conn
            if self.ssl_context is not None:
                left = max(0.001, deadline - time.monotonic())
                conn = tls_handshake(
                    sock, self.ssl_context, server_side=False, hostname=self.host, timeout_s=left
                )
            else:
                conn = Conn(sock)
            conn.set_deadline(deadline)
            hello = pb.DataHello(version=VERSION, client_id=self.client_id)
            conn.send_frame(Kind.HELLO, hello.SerializeToString())
            return conn
        except ssl.SSLError as exc:
            sock.close()
            raise KVError(KVErrorCode.KV_UNAUTHENTICATED, f"TLS: {exc.reason or exc}") from None
        except TimeoutError:
            sock.close()
            raise KVError(KVErrorCode.KV_TIMEOUT, "TLS handshake timed out") from None
        except OSError as exc:
            sock.close()
            raise KVError(KVErrorCode.KV_UNAVAILABLE, f"data plane: {exc}") from None


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
    return _connection_error(exc, kv_id, resume)


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
