"""The gateway's HTTP application: routes, lifecycle, decode health polling.

OpenAI request parsing is in :mod:`.protocol`, one request's path through prefill and
decode in :mod:`.flow`, response bodies and streams in :mod:`.responses`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator
from typing import Any

import grpc
from aiohttp import web
from prometheus_client import generate_latest

from pdx._proto import serving_pb2, serving_pb2_grpc
from pdx.serving.backends.tokenizer import Tokenizer
from pdx.serving.deploy_config import DeployConfig, GatewayConfig, local_prefill_threshold
from pdx.serving.gateway.flow import Flow
from pdx.serving.gateway.metrics import GatewayMetrics
from pdx.serving.gateway.protocol import (
    CompletionRequest,
    HTTPProblem,
    body_field,
    http_error,
    parse_completion,
    prompt_ids,
)
from pdx.serving.gateway.responses import SSEWriter, completion_body
from pdx.serving.router import DecodeInstance, PrefillInstance, Router
from pdx.serving.rpc import channel
from pdx.tls import TLSConfig

log = logging.getLogger("pdx.gateway")


class Gateway:
    """The HTTP front door; owns the router, the gRPC channels and the metrics."""

    def __init__(
        self,
        cfg: GatewayConfig,
        router: Router,
        tokenizer: Tokenizer,
        *,
        max_context_tokens: int,
        model_name: str,
        tls: TLSConfig | None,
        poll_interval_s: float = 0.25,
        synthetic: bool = False,
    ) -> None:
        self.cfg = cfg
        self.router = router
        self.tokenizer = tokenizer
        self.max_context_tokens = max_context_tokens
        self.model_name = model_name
        self.synthetic = synthetic  # labelled in every response
        self.tls = tls
        self.poll_interval_s = poll_interval_s
        self.metrics = GatewayMetrics()
        self.kv_route: dict[str, str] = {}  # kv endpoint → address to use (e.g. a fault proxy)
        self._channels: list[grpc.aio.Channel] = []
        self._poller: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0

    # --- lifecycle -----------------------------------------------------------------

    def connect(self) -> None:
        """Open channels to every instance the router knows."""
        for d in self.router.decodes:
            ch = channel(d.address, self.tls)
            self._channels.append(ch)
            d.stub = serving_pb2_grpc.DecodeStub(ch)
        for p in self.router.prefills:
            ch = channel(p.address, self.tls)
            self._channels.append(ch)
            p.stub = serving_pb2_grpc.PrefillStub(ch)

    def app(self) -> web.Application:
        """The aiohttp application."""
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.prom)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        return app

    async def start(self, host: str, port: int) -> int:
        """Connect, poll decode status, serve HTTP on host:port (0 = ephemeral); return port."""
        self.connect()
        await self.poll_once()
        self._poller = asyncio.get_running_loop().create_task(self._poll_forever())
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        server = site._server
        assert server is not None and server.sockets  # type: ignore[attr-defined]
        self.port = int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]
        return self.port

    async def stop(self) -> None:
        """Stop serving and close channels."""
        if self._poller:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self._runner:
            await self._runner.cleanup()
        for ch in self._channels:
            await ch.close()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            await self.poll_once()

    async def poll_once(self) -> None:
        """Refresh every decode instance's health, queue depth and free memory."""
        await asyncio.gather(*(self._poll(d) for d in self.router.decodes))
        self.metrics.breaker_open.set(0 if self.router.breaker.state == "closed" else 1)

    async def _poll(self, d: DecodeInstance) -> None:
        try:
            st = await d.stub.Status(serving_pb2.DecodeStatusRequest(), timeout=1.0)
        except grpc.aio.AioRpcError:
            d.healthy = False
            return
        d.healthy, d.queue_depth, d.running = st.healthy, st.queue_depth, st.running
        d.max_batch, d.max_queue = st.max_batch, st.max_queue
        d.kv_budget_bytes, d.kv_free_bytes = st.kv_budget_bytes, st.kv_free_bytes

    # --- small endpoints -----------------------------------------------------------

    async def prom(self, request: web.Request) -> web.Response:
        """Prometheus text exposition."""
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    async def healthz(self, request: web.Request) -> web.Response:
        """Liveness: the gateway process answers."""
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        """Readiness: at least one healthy decode instance."""
        healthy = [d.name for d in self.router.decodes if d.healthy]
        body = {"ready": bool(healthy), "decode_healthy": healthy}
        return web.json_response(body, status=200 if healthy else 503)

    async def models(self, request: web.Request) -> web.Response:
        """The one model served."""
        model = {"id": self.model_name, "object": "model", "synthetic": self.synthetic}
        data = [{**model, "max_model_len": self.max_context_tokens}]
        return web.json_response({"object": "list", "data": data})

    # --- completions ---------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """OpenAI ``/v1/completions``."""
        try:
            body = await self._json(request)
            prompt = body.get("prompt")
            ids = prompt_ids(self.tokenizer, prompt)
            return await self._complete(request, body, ids, "text_completion")
        except HTTPProblem as exc:
            return http_error(exc)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """OpenAI ``/v1/chat/completions`` (only for models with a chat template)."""
        try:
            apply = getattr(self.tokenizer, "apply_chat_template", None)
            if not self.tokenizer.chat_template or apply is None:
                raise HTTPProblem(
                    400, "this model has no chat template; use /v1/completions", "invalid_request"
                )
            body = await self._json(request)
            messages = body_field(body, "messages", list, None)
            if not messages:
                raise HTTPProblem(400, "messages: required, a non-empty list", "invalid_request")
            return await self._complete(request, body, apply(messages), "chat.completion")
        except HTTPProblem as exc:
            return http_error(exc)

    async def _json(self, request: web.Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise HTTPProblem(400, f"malformed JSON body: {exc}", "invalid_request_error") from None
        if not isinstance(body, dict):
            raise HTTPProblem(400, "request body must be a JSON object", "invalid_request_error")
        return body

    async def _complete(
        self, request: web.Request, body: dict[str, Any], ids: list[int], obj: str
    ) -> web.StreamResponse:
        req = parse_completion(
            body,
            ids,
            default_max_tokens=self.cfg.default_max_tokens,
            max_context_tokens=self.max_context_tokens,
            model_name=self.model_name,
        )
        decision = self.router.decide(req.route, len(ids), req.user)
        if decision is None:
            self.metrics.rejections.labels("no_decode_capacity").inc()
            raise HTTPProblem(
                429,
                "no decode capacity: every decode instance is full or unhealthy; retry later",
                "overloaded",
                {"Retry-After": str(self.cfg.retry_after_s)},
            )
        flow = Flow(self, req, decision)
        if req.stream:
            return await self._stream(request, req, flow, obj)
        outcome = await flow.collect()
        return web.json_response(completion_body(self.tokenizer, req, flow, outcome, obj))

    async def _stream(
        self, request: web.Request, req: CompletionRequest, flow: Flow, obj: str
    ) -> web.StreamResponse:
        events = flow.events()
        try:
            first = await anext(events)  # errors before the first token keep their HTTP status
        except StopAsyncIteration:
            first = None
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        sse = SSEWriter(self.tokenizer, req, flow, obj, resp)
        try:
            await resp.prepare(request)
            await sse.run(first, events)
        except ConnectionResetError:  # aiohttp's ClientConnectionResetError: the client left
            await self._client_gone(flow, events)
        return resp

    async def _client_gone(self, flow: Flow, events: AsyncGenerator[int, None]) -> None:
        """A client leaving mid-stream is normal: stop its generation, count it, one log line."""
        flow.client_gone = True
        await events.aclose()  # cancels the prefill/decode calls; in-flight counters drop
        route = flow.outcome.pdx.get("route", flow.decision.route)
        self.metrics.client_disconnects.labels(route).inc()
        log.info(
            "client disconnected mid-stream: %s after %d tokens (route %s); generation stopped",
            flow.id, len(flow.outcome.tokens), route,
        )  # fmt: skip


def build_gateway(
    cfg: DeployConfig,
    prefills: list[tuple[str, str]],
    decodes: list[tuple[str, str]],
    *,
    tls: TLSConfig | None,
    tokenizer: Tokenizer,
    max_context_tokens: int,
    model_name: str,
    synthetic: bool = False,
) -> Gateway:
    """A gateway over named (name, host:port) prefill and decode instances."""
    router = Router(cfg.router, local_prefill_threshold(cfg))
    router.prefills = [PrefillInstance(name, addr) for name, addr in prefills]
    router.decodes = [DecodeInstance(name, addr) for name, addr in decodes]
    return Gateway(
        cfg.gateway,
        router,
        tokenizer,
        max_context_tokens=max_context_tokens,
        model_name=model_name,
        tls=tls,
        poll_interval_s=cfg.router.status_poll_ms / 1e3,
        synthetic=synthetic,
    )
