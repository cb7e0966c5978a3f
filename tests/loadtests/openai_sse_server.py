"""A small real OpenAI-compatible streaming server for load and acceptance tests.

It listens on 127.0.0.1 (port 0), streams ``max_tokens`` completion chunks as server-sent events
with a configurable first-token delay and per-token gap, a final ``usage`` chunk, a ``pdx``
object like the pdx gateway's, and ``data: [DONE]``. ``GET /metrics`` exposes its real request
counts in Prometheus text. It runs its own event loop in a background thread.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class StreamServerConfig:
    """Timing and behaviour of the test server."""

    first_token_delay_s: float = 0.01
    token_gap_s: float = 0.002
    usage: bool = True
    fail_every: int = 0  # every Nth request answers HTTP 500 (0 = never)


@dataclass
class StreamServerStats:
    """What the server really did (read by tests)."""

    requests: int = 0
    completed: int = 0
    failed: int = 0
    aborted: int = 0
    tokens: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)


class OpenAIStreamServer:
    """Start with ``start()`` (returns the base URL), stop with ``stop()``."""

    def __init__(self, cfg: StreamServerConfig | None = None) -> None:
        self.cfg = cfg or StreamServerConfig()
        self.stats = StreamServerStats()
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.stats.requests += 1
        self.stats.bodies.append(body)
        n = int(body.get("max_tokens", 16))
        prompt = body.get("prompt", "")
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        if self.cfg.fail_every and self.stats.requests % self.cfg.fail_every == 0:
            self.stats.failed += 1
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            await self._stream(resp, n, prompt_tokens)
        except ConnectionResetError:  # the client went away (e.g. Locust stopped mid-stream)
            self.stats.aborted += 1
        return resp

    async def _stream(self, resp: web.StreamResponse, n: int, prompt_tokens: int) -> None:
        await asyncio.sleep(self.cfg.first_token_delay_s)
        for i in range(n):
            if i:
                await asyncio.sleep(self.cfg.token_gap_s)
            chunk = {"object": "text_completion", "choices": [{"index": 0, "text": f" t{i}"}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.stats.tokens += n
        last: dict[str, Any] = {"choices": [], "pdx": {"route": "local", "retries": 0}}
        if self.cfg.usage:
            last["usage"] = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": n,
                "total_tokens": prompt_tokens + n,
            }
        await resp.write(f"data: {json.dumps(last)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        self.stats.completed += 1

    async def _metrics(self, _request: web.Request) -> web.Response:
        s = self.stats
        text = (
            "# TYPE pdx_requests_total counter\n"
            f'pdx_requests_total{{outcome="ok"}} {s.completed}\n'
            f'pdx_requests_total{{outcome="error"}} {s.failed}\n'
            "# TYPE pdx_generated_tokens_total counter\n"
            f"pdx_generated_tokens_total {s.tokens}\n"
        )
        return web.Response(text=text, content_type="text/plain")

    async def _serve(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/readyz", lambda _r: web.Response(text="ready"))
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        self._ready.set()

    def start(self) -> str:
        """Start serving in a background thread; return the base URL once listening."""
        self._loop = asyncio.new_event_loop()

        def run() -> None:
            assert self._loop is not None
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._serve())
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="openai-sse-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("test SSE server did not start")
        return self.url

    def stop(self) -> None:
        """Shut the server down and join its thread."""
        if self._loop is None or self._runner is None:
            return
        fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        fut.result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        self._loop.close()
