"""A lean HTTP/1.1 client for the engine gateway's two calls per request.

Every request through ``engine: vllm`` makes two upstream calls (prefill's POST, decode's
streamed POST). Through aiohttp's client each cost about as much CPU as the rest of the
request together (its request and response objects, URL and header handling, a payload
writer task, cookie and redirect machinery): measured with ``benchmarks/bench_gateway.py``,
it was the largest single part of the gateway's CPU per request. What these calls need is
narrow: POST a JSON body to a few known instances over keep-alive connections, read a JSON
answer or a stream of server-sent events, abort a stream by closing its connection. This
module does only that, over asyncio's transports with httptools' C parser (llhttp, the
parser uvicorn uses); each request is one socket write. Everything else pdx sends over HTTP
(health polls, /metrics, the CLI's clients) stays on aiohttp.

Bounded against a misbehaving instance: a response body is read up to ``max_body`` bytes,
a stream pauses reading while ``pause_bytes`` are unread, and every wait ends at the call's
deadline.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import httptools

MAX_BODY = 64 << 20  # a whole (non-streamed) answer, at most
PAUSE_BYTES = 1 << 20  # a stream stops reading from the socket while this much is unread
IDLE_PER_ORIGIN = 256  # keep-alive connections kept per instance (more are closed after use)


class Origin(NamedTuple):
    """Where an instance listens: its connections are pooled by this."""

    host: str
    port: int
    tls: bool = False  # https: TLS with the system's trust store, the host's name verified


class HTTPConnectionError(ConnectionError):
    """The connection failed, closed early, or the answer was not HTTP."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection and the response being read on it."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.reused = False
        self.idle = False  # in the pool: no byte may arrive now
        self._reset()
        self.broken: BaseException | None = None

    def _reset(self) -> None:
        self.status = 0
        self.headers_done = False
        self.complete = False
        self.keep_alive = True
        self.received = 0  # body bytes of this response so far
        self.chunks: collections.deque[bytes] = collections.deque()
        self.unread = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.any_bytes = False  # any byte of this response arrived (a reuse race has none)

    # asyncio.Protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.any_bytes = True
        if self.idle:  # an answer nobody asked for (a 408 before an idle close, say)
            self._fail(HTTPConnectionError("bytes from the instance on an idle connection"))
            if self.transport is not None:
                self.transport.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(HTTPConnectionError(f"not an HTTP answer: {exc}"))
            if self.transport is not None:
                self.transport.close()

    def eof_received(self) -> bool:
        self._fail(HTTPConnectionError("the instance closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(HTTPConnectionError(f"connection lost: {exc}" if exc else "connection closed"))

    # httptools callbacks ----------------------------------------------------------------------

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.unread += len(body)
        self.received += len(body)
        if self.unread > PAUSE_BYTES and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # ------------------------------------------------------------------------------------------

    def _fail(self, exc: BaseException) -> None:
        if self.broken is None:
            self.broken = exc
        self.keep_alive = False
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self, deadline: float) -> None:
        """Until something arrives (headers, body, the end, a failure) or the deadline."""
        loop = asyncio.get_running_loop()
        self.waiter = w = loop.create_future()
        timer = loop.call_at(deadline, _expire, w)
        try:
            await w
        finally:
            timer.cancel()
            self.waiter = None

    def take(self) -> bytes:
        """Every body byte read so far (and reading resumed if it was paused)."""
        data = self.chunks.popleft() if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks.clear()
        self.unread = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    @property
    def usable(self) -> bool:
        """Idle and open: may carry another request."""
        t = self.transport
        return self.broken is None and t is not None and not t.is_closing()

    def close(self) -> None:
        """Drop the connection (the instance sees the request aborted)."""
        self.keep_alive = False
        if self.transport is not None:
            self.transport.close()


def _expire(w: asyncio.Future[None]) -> None:
    if not w.done():
        w.set_exception(TimeoutError())


class Response:
    """An answer being read: its status, then its body whole or chunk by chunk."""

    def __init__(self, client: HTTP1Client, origin: Origin, conn: _Conn,
                 deadline: float) -> None:  # fmt: skip
        self._client, self._origin, self._conn, self.deadline = client, origin, conn, deadline
        self.status = conn.status
        self._done = False

    async def read(self, max_body: int = MAX_BODY) -> bytes:
        """The whole body (at most ``max_body`` bytes)."""
        parts = []
        async for data in self.iter_any():
            parts.append(data)
            if self._conn.received > max_body:
                self.close()
                raise HTTPConnectionError(f"an answer over {max_body} bytes")
        return b"".join(parts)

    async def iter_any(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive, one piece per network read (chunked encoding undone)."""
        conn = self._conn
        while True:
            if conn.unread:
                yield conn.take()
                continue
            if conn.complete:
                self._finish()
                return
            if conn.broken is not None:
                self.close()
                raise conn.broken
            await conn.wait(self.deadline)

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._client._release(self._origin, self._conn)

    def close(self) -> None:
        """Abort: the connection is closed unless the answer was already read to its end."""
        if self._done:
            return
        self._done = True
        if self._conn.complete and not self._conn.unread:
            self._client._release(self._origin, self._conn)
        else:
            self._client._drop(self._conn)


class HTTP1Client:
    """POSTs over pooled keep-alive connections, one per request in flight."""

    def __init__(
        self, *, idle_per_origin: int = IDLE_PER_ORIGIN, tls: ssl.SSLContext | None = None
    ) -> None:
        self._idle: dict[Origin, list[_Conn]] = {}
        self._idle_max = idle_per_origin
        self._open: set[_Conn] = set()
        self._closed = False
        self._tls = tls  # for https origins; None: the system's trust store, made when needed

    async def _connect(self, origin: Origin, deadline: float) -> _Conn:
        loop = asyncio.get_running_loop()
        tls = None
        if origin.tls:
            tls = self._tls = self._tls or ssl.create_default_context()
        try:
            async with asyncio.timeout_at(deadline):
                _, conn = await loop.create_connection(
                    _Conn, origin.host, origin.port, ssl=tls,
                    server_hostname=origin.host if tls else None,
                )  # fmt: skip
        except (OSError, ssl.SSLError) as exc:
            raise HTTPConnectionError(f"connect to {origin.host}:{origin.port}: {exc}") from None
        self._open.add(conn)
        return conn

    def _checkout(self, origin: Origin) -> _Conn | None:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()
            if conn.usable:
                conn.reused, conn.idle = True, False
                return conn
            self._open.discard(conn)
        return None

    def _drop(self, conn: _Conn) -> None:
        conn.close()
        self._open.discard(conn)

    def _release(self, origin: Origin, conn: _Conn) -> None:
        idle = self._idle.setdefault(origin, [])
        if self._closed or not conn.keep_alive or not conn.usable or len(idle) >= self._idle_max:
            self._drop(conn)
            return
        conn._reset()
        conn.idle = True
        idle.append(conn)

    @contextlib.asynccontextmanager
    async def post(
        self, origin: Origin, path: str, body: bytes, *, timeout_s: float,
        connect_timeout_s: float = 3.0,
    ) -> AsyncIterator[Response]:  # fmt: skip
        """POST ``body`` (JSON) to ``path``; the response once its headers are in.

        Leaving the block before the body's end closes the connection (aborting the request
        at the instance). A connection reused from the pool that closes before any byte of
        the answer (the instance's idle timeout raced the request) is replaced once by a new
        one. Raises :class:`HTTPConnectionError` or ``TimeoutError``.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        host = f"[{origin.host}]" if ":" in origin.host else origin.host
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{origin.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode("latin-1")
        conn: _Conn | None = None
        for attempt in (0, 1):
            conn = self._checkout(origin) if attempt == 0 else None
            if conn is None:
                conn = await self._connect(origin, min(deadline, loop.time() + connect_timeout_s))
            assert conn.transport is not None
            conn.transport.write(head + body)
            while not conn.headers_done and conn.broken is None:
                try:
                    await conn.wait(deadline)
                except BaseException:
                    self._drop(conn)
                    raise
            if conn.broken is not None and not conn.headers_done:
                self._drop(conn)
                if conn.reused and not conn.any_bytes and attempt == 0:
                    continue  # a stale keep-alive connection: once more, on a fresh one
                raise conn.broken
            break
        assert conn is not None
        resp = Response(self, origin, conn, deadline)
        try:
            yield resp
        finally:
            resp.close()

    async def close(self) -> None:
        """Close every connection."""
        self._closed = True
        for conn in list(self._open):
            conn.close()
        self._open.clear()
        self._idle.clear()


def origin_of(base_url: str) -> tuple[Origin, str]:
    """``http(s)://host[:port][/prefix]`` → its origin and path prefix (``""`` or ``/prefix``)."""
    scheme, sep, rest = base_url.partition("://")
    if not sep or scheme not in ("http", "https"):
        raise ValueError(f"{base_url!r}: expected an http:// or https:// instance URL")
    hostport, slash, prefix = rest.partition("/")
    host, colon, port = hostport.rpartition(":")
    if host.startswith("[") and not host.endswith("]"):  # [::1] without a port
        host, colon = hostport, ""
    if not colon or not (port.isascii() and port.isdigit()):
        host, port = hostport, ("443" if scheme == "https" else "80")
    path = ("/" + prefix).rstrip("/") if slash else ""
    return Origin(host.strip("[]"), int(port), scheme == "https"), path


__all__: list[Any] = ["HTTP1Client", "HTTPConnectionError", "Origin", "Response", "origin_of"]
