"""pdx.serving.engines.http1 against a real aiohttp server on 127.0.0.1: answers whole and
streamed, keep-alive reuse, aborts, timeouts, stale pooled connections, bad peers."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import web

from pdx.serving.engines.http1 import HTTP1Client, HTTPConnectionError, Origin, origin_of
from pdx.tls import client_ssl_context, init_certs, server_ssl_context, tls_for


class Upstream:
    """A tiny engine-like server that records what it saw."""

    def __init__(self) -> None:
        self.peers: set[tuple[str, int]] = set()
        self.aborted = asyncio.Event()
        self.bodies: list[object] = []
        self.site: web.TCPSite | None = None
        self.runner: web.AppRunner | None = None

    async def echo(self, request: web.Request) -> web.Response:
        self.peers.add(request.transport.get_extra_info("peername"))  # type: ignore[union-attr]
        body = orjson.loads(await request.read())
        self.bodies.append(body)
        return web.json_response({"got": body})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        n = int(request.query.get("n", "5"))
        delay = float(request.query.get("delay", "0"))
        size = int(request.query.get("size", "8"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(n):
                await resp.write(b"data: " + str(i).encode() + b"x" * size + b"\n\n")
                if delay:
                    await asyncio.sleep(delay)
        except (ConnectionResetError, asyncio.CancelledError):
            self.aborted.set()
            raise
        await resp.write_eof()
        return resp

    async def refuse(self, request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"error": {"message": "no such model"}}, status=404)

    async def slow(self, request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.json_response({})

    async def start(self) -> int:
        app = web.Application()
        app.router.add_post("/echo", self.echo)
        app.router.add_post("/stream", self.stream)
        app.router.add_post("/refuse", self.refuse)
        app.router.add_post("/slow", self.slow)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        self.site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await self.site.start()
        return self.runner.addresses[0][1]

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[Upstream, Origin]]:
    up = Upstream()
    port = await up.start()
    yield up, Origin("127.0.0.1", port)
    await up.stop()


async def _post_json(c: HTTP1Client, origin: Origin, path: str, body: object) -> object:
    async with c.post(origin, path, orjson.dumps(body), timeout_s=5) as r:
        assert r.status == 200
        return orjson.loads(await r.read())


async def test_answers_whole_and_reuses_one_connection(upstream) -> None:
    up, origin = upstream
    c = HTTP1Client()
    for i in range(20):
        assert await _post_json(c, origin, "/echo", {"i": i, "ids": list(range(300))}) == {
            "got": {"i": i, "ids": list(range(300))}
        }
    assert len(up.peers) == 1  # twenty requests, one keep-alive connection
    # concurrent requests each take a connection of their own, returned to the pool after
    await asyncio.gather(*(_post_json(c, origin, "/echo", {"k": k}) for k in range(8)))
    assert 2 <= len(up.peers) <= 8
    await c.close()


async def test_a_stream_arrives_in_pieces_and_in_order(upstream) -> None:
    _, origin = upstream
    c = HTTP1Client()
    async with c.post(origin, "/stream?n=50&delay=0.002", b"{}", timeout_s=5) as r:
        assert r.status == 200
        data = b"".join([piece async for piece in r.iter_any()])
    events = [e for e in data.split(b"\n\n") if e]
    assert [int(e[6:].rstrip(b"x")) for e in events] == list(range(50))
    # the connection went back to the pool: the next call reuses it
    assert await _post_json(c, origin, "/echo", {}) == {"got": {}}
    await c.close()


async def test_a_large_stream_is_read_through_pauses(upstream) -> None:
    # 64 events of 64 KiB, read slowly: the client pauses reading past its limit and resumes
    _, origin = upstream
    c = HTTP1Client()
    total = 0
    async with c.post(origin, "/stream?n=64&size=65536", b"{}", timeout_s=20) as r:
        async for piece in r.iter_any():
            total += len(piece)
            await asyncio.sleep(0.001)
    assert total == sum(len(f"data: {i}".encode()) + 65536 + 2 for i in range(64))
    await c.close()


async def test_leaving_a_stream_early_aborts_it_at_the_server(upstream) -> None:
    up, origin = upstream
    c = HTTP1Client()
    async with c.post(origin, "/stream?n=1000&delay=0.01", b"{}", timeout_s=20) as r:
        async for _ in r.iter_any():
            break
    await asyncio.wait_for(up.aborted.wait(), 5)
    assert not c._open  # the aborted connection is not pooled
    assert await _post_json(c, origin, "/echo", {"after": 1}) == {"got": {"after": 1}}
    await c.close()


async def test_an_error_status_comes_with_its_body(upstream) -> None:
    _, origin = upstream
    c = HTTP1Client()
    async with c.post(origin, "/refuse", b"{}", timeout_s=5) as r:
        assert r.status == 404
        assert orjson.loads(await r.read())["error"]["message"] == "no such model"
    await c.close()


async def test_the_deadline_covers_the_whole_call(upstream) -> None:
    _, origin = upstream
    c = HTTP1Client()
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(TimeoutError):
        async with c.post(origin, "/slow", b"{}", timeout_s=0.3) as r:
            await r.read()
    assert asyncio.get_running_loop().time() - t0 < 2
    with pytest.raises(TimeoutError):  # mid-stream too
        async with c.post(origin, "/stream?n=100&delay=0.05", b"{}", timeout_s=0.3) as r:
            async for _ in r.iter_any():
                pass
    await c.close()


async def test_refused_and_closed_peers_raise_connection_errors() -> None:
    c = HTTP1Client()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(HTTPConnectionError, match=r"connect to 127\.0\.0\.1"):
            async with c.post(Origin("127.0.0.1", port), "/x", b"{}", timeout_s=2):
                pass

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.5)
        writer.close()

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        writer.close()

    for handler, match in ((garbage, "not an HTTP answer"), (hang_up, "closed")):
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(HTTPConnectionError, match=match):
            async with c.post(Origin("127.0.0.1", port), "/x", b"{}", timeout_s=2):
                pass
        server.close()
        await server.wait_closed()
    await c.close()


async def _three_posts(handler: Any, pause_s: float) -> None:
    """Three requests, ``pause_s`` apart, through one client to a raw server running ``handler``."""
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    origin = Origin("127.0.0.1", server.sockets[0].getsockname()[1])
    c = HTTP1Client()
    for _ in range(3):
        assert await _post_json(c, origin, "/x", {}) == {}
        await asyncio.sleep(pause_s)
    server.close()
    await server.wait_closed()
    await c.close()


@pytest.mark.parametrize("when", ["idle", "racing"])
async def test_a_pooled_connection_the_server_closed_is_replaced(when: str) -> None:
    """The instance drops idle keep-alive connections (uvicorn after 5 s): a request that
    meets one gets a fresh connection instead of an error, whether the close arrived while
    the connection was idle or only after the next request was written on it."""
    served = heads = 0

    async def one_answer_then_close(reader: asyncio.StreamReader,
                                    writer: asyncio.StreamWriter) -> None:  # fmt: skip
        nonlocal served, heads
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await reader.readuntil(b"\r\n\r\n")
            heads += 1
            await reader.readexactly(2)
            served += 1
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()
            if when == "racing":  # the next request is read, then the connection closed
                await reader.readuntil(b"\r\n\r\n")
                heads += 1
            else:
                await asyncio.sleep(0.05)
        writer.close()  # keep-alive promised, then closed

    await _three_posts(one_answer_then_close, 0.1)
    assert served == 3
    # racing: requests 2 and 3 each met a closing connection first and were sent again
    assert heads == (5 if when == "racing" else 3)


async def test_bytes_on_an_idle_connection_retire_it() -> None:
    """A server that answers, then writes again while the connection sits in the pool (an
    unasked 408, say): that connection is never handed to the next request."""
    heads = 0

    async def answer_then_babble(reader: asyncio.StreamReader,
                                 writer: asyncio.StreamWriter) -> None:  # fmt: skip
        nonlocal heads
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                await reader.readuntil(b"\r\n\r\n")
                heads += 1
                await reader.readexactly(2)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                await asyncio.sleep(0.05)
                writer.write(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()

    await _three_posts(answer_then_babble, 0.15)
    assert heads == 3  # each on a fresh connection: none read the stray 408 as its answer


def test_origins() -> None:
    assert origin_of("http://127.0.0.1:8100") == (Origin("127.0.0.1", 8100), "")
    assert origin_of("http://[::1]:9000/") == (Origin("::1", 9000), "")
    assert origin_of("http://[::1]") == (Origin("::1", 80), "")
    assert origin_of("http://engine") == (Origin("engine", 80), "")
    assert origin_of("https://engine.example/prefill-a/") == (
        Origin("engine.example", 443, tls=True),
        "/prefill-a",
    )
    with pytest.raises(ValueError, match="http:// or https://"):
        origin_of("ftp://127.0.0.1:1")


async def test_https_and_a_path_prefix(tmp_path) -> None:
    """An instance behind TLS (its certificate checked against the CA given) under a path."""
    init_certs(tmp_path, ["engine", "gateway"])
    seen: list[str] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(request.path)
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/a/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0,
                       ssl_context=server_ssl_context(tls_for(tmp_path, "engine")))  # fmt: skip
    await site.start()
    port = runner.addresses[0][1]
    origin, prefix = origin_of(f"https://127.0.0.1:{port}/a")
    c = HTTP1Client(tls=client_ssl_context(tls_for(tmp_path, "gateway")))
    assert await _post_json(c, origin, prefix + "/v1/completions", {}) == {"ok": True}
    assert seen == ["/a/v1/completions"]
    await c.close()
    untrusted = HTTP1Client()  # the system's trust store does not know this CA
    with pytest.raises(HTTPConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        await _post_json(untrusted, origin, prefix + "/v1/completions", {})
    await untrusted.close()
    await runner.cleanup()
