"""The gateway's HTTP application: routes, lifecycle, decode health polling.

OpenAI request parsing is in :mod:`.protocol`, one request's path through prefill and
decode in :mod:`.flow`, response bodies and streams in :mod:`.responses`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import grpc
from aiohttp import web
from prometheus_client import generate_latest

from pdx._proto import serving_pb2, serving_pb2_grpc
from pdx.serving.backends.tokenizer import Tokenizer
from pdx.serving.deploy_config import DeployConfig, GatewayConfig, local_prefill_threshold
from pdx.serving.gateway.cache_watch import watch_cache
from pdx.serving.gateway.context import FlowContext
from pdx.serving.gateway.flow import Flow
from pdx.serving.gateway.metrics import GatewayMetrics
from pdx.serving.gateway.openapi import openapi_document
from pdx.serving.gateway.protocol import (
    ChatCompletionBody,
    CompletionBody,
    CompletionRequest,
    HTTPProblem,
    ModelCard,
    ModelList,
    ServedModel,
    bad_request,
    parse_json,
    prompt_ids,
    resolve,
    validate_body,
)
from pdx.serving.gateway.responses import SSEResponse, SSEWriter, completion_body, created_now
from pdx.serving.restarts import RestartBoard
from pdx.serving.router import DecodeInstance, PrefillInstance, Router
from pdx.serving.rpc import channel
from pdx.tls import TLSConfig

log = logging.getLogger("pdx.gateway")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


METRICS = web.AppKey("metrics", GatewayMetrics)


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error in OpenAI's shape: aiohttp's own (404, 405, 413), ours, and the unexpected;
    each error status counted (``pdx_gateway_http_errors_total``), so a misbehaving client
    shows on /metrics."""
    response = await _answer(request, handler)
    if response.status >= 400 and METRICS in request.app:
        request.app[METRICS].http_errors.labels(str(response.status)).inc()
    return response


async def _answer(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except HTTPProblem as exc:
        return http_error(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
        problem = HTTPProblem(exc.status, exc.reason if exc.status != 413 else exc.text or "",
                              codes.get(exc.status), headers=headers)  # fmt: skip
        return http_error(problem)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        return http_error(HTTPProblem(500, "internal error (logged by the gateway)", "internal"))


def http_error(exc: HTTPProblem) -> web.Response:
    """The JSON error response for ``exc``."""
    return web.json_response(exc.body(), status=exc.status, headers=exc.headers)


class Gateway:
    """The HTTP front door; owns the router, the gRPC channels and the metrics."""

    flow_factory: type[Flow] = Flow  # one choice's path (engine gateways use their own)
    #: the offload policies a request may ask for (``pdx_offload.policy``): the cache-aware
    #: ones need the router to see the decodes' prefix caches
    policies: tuple[str, ...] = ("length", "uncached", "break_even")

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
        model_aliases: list[str] | None = None,
        threshold_for: Callable[[float], int] | None = None,
        restarts: RestartBoard | None = None,
    ) -> None:
        self.cfg = cfg
        self.router = router
        self.tokenizer = tokenizer
        self.max_context_tokens = max_context_tokens
        self.model_name = model_name
        self.model_names = [model_name, *[a for a in model_aliases or [] if a != model_name]]
        self.synthetic = synthetic  # labelled in every response
        self.tls = tls
        self.poll_interval_s = poll_interval_s
        self.metrics = GatewayMetrics(model_name)
        self.restarts = restarts  # the supervisor's view of its children (pdx deploy)
        if restarts is not None:
            restarts.export(self.metrics.registry)
        self.kv_route: dict[str, str] = {}  # kv endpoint → address to use (e.g. a fault proxy)
        self.vocab_size: int | None = None  # learnt from decode's Status
        self.threshold_for = threshold_for  # measured prefill TFLOP/s → local-prefill threshold
        self.created = created_now()
        self.ctx = self.flow_context()
        self._channels: list[grpc.aio.Channel] = []
        self._poller: asyncio.Task[None] | None = None
        self._watchers: dict[str, asyncio.Task[None]] = {}  # decode name → its cache watch
        self._runner: web.AppRunner | None = None
        self._openapi: dict[str, Any] | None = None
        self.port = 0

    def flow_context(self) -> FlowContext:
        """What every flow of this gateway may use of it."""
        return FlowContext(cfg=self.cfg, router=self.router, tokenizer=self.tokenizer,
                           metrics=self.metrics, synthetic=self.synthetic,
                           kv_route=self.kv_route)  # fmt: skip

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
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[openai_errors])
        app[METRICS] = self.metrics
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_get("/metrics", self.prom)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        return app

    async def start(self, host: str, port: int) -> int:
        """Connect, poll decode status, serve HTTP on host:port (0 = ephemeral); return port."""
        self.connect()
        await self.poll_once()
        self._poller = asyncio.get_running_loop().create_task(self._poll_forever())
        # keepalive_timeout also bounds a connection whose request headers never complete:
        # aiohttp arms it when the connection opens and only a whole request disarms it.
        self._runner = web.AppRunner(
            self.app(), access_log=None, keepalive_timeout=self.cfg.idle_timeout_s
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        server = site._server
        assert server is not None and server.sockets  # type: ignore[attr-defined]
        self.port = int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]
        return self.port

    async def stop(self) -> None:
        """Stop serving and close channels."""
        for task in [*self._watchers.values(), *([self._poller] if self._poller else [])]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
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
        d.kv_bytes_per_token = st.kv_bytes_per_token
        d.polled(st.kv_budget_bytes, st.kv_free_bytes)
        if st.vocab_size:
            self.vocab_size = st.vocab_size
        if st.prefix_block_tokens and d.name not in self._watchers:
            watch = watch_cache(d, self.metrics.cached_blocks_changed)
            self._watchers[d.name] = asyncio.get_running_loop().create_task(watch)
        if st.prefill_tflops > 0 and self.threshold_for is not None:
            # Once: the break-even from decode's measured prefill speed (decode is where a
            # short prompt would be recomputed).
            self.router.local_prefill_max_tokens = self.threshold_for(st.prefill_tflops)
            self.threshold_for = None

    # --- small endpoints -----------------------------------------------------------

    async def prom(self, request: web.Request) -> web.Response:
        """Prometheus text exposition."""
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    async def healthz(self, request: web.Request) -> web.Response:
        """Liveness: the gateway process answers."""
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        """Readiness: at least one healthy decode instance; under a supervisor, also each
        child's state and, for a role with none up, when its next restart is."""
        self._note_restarts()
        healthy = [d.name for d in self.router.decodes if d.healthy and not d.down]
        body: dict[str, Any] = {"ready": bool(healthy), "decode_healthy": healthy}
        if self.restarts is not None:
            down = self.restarts.roles_down()
            body["roles_down"] = [
                {"role": role, "next_attempt_in_s": _round(self.restarts.next_attempt_in_s(role))}
                for role in down
            ]
            body["children"] = self.restarts.describe()
        headers = {} if healthy else {"Retry-After": str(self._retry_after_s("decode"))}
        return web.json_response(body, status=200 if healthy else 503, headers=headers)

    def _note_restarts(self) -> None:
        """Take the supervisor's word on which instances' processes are down right now."""
        board = self.restarts
        if board is None:
            return
        for d in self.router.decodes:
            d.down = board.is_down(d.name)
        for p in self.router.prefills:
            p.down = board.is_down(p.name)

    def _retry_after_s(self, role: str) -> int:
        """Whole seconds until ``role``'s next restart attempt, else ``retry_after_s``."""
        wait = self.restarts.next_attempt_in_s(role) if self.restarts is not None else None
        return max(1, math.ceil(wait)) if wait is not None else self.cfg.retry_after_s

    def _card(self, name: str) -> ModelCard:
        return ModelCard(id=name, object="model", created=self.created, owned_by="pdx",
                         root=self.model_name, max_model_len=self.max_context_tokens,
                         synthetic=self.synthetic)  # fmt: skip

    async def models(self, request: web.Request) -> web.Response:
        """Every served name (the model, then its aliases)."""
        cards = ModelList(object="list", data=[self._card(n) for n in self.model_names])
        return web.json_response(cards.model_dump(mode="json"))

    async def model(self, request: web.Request) -> web.Response:
        """One served model, or 404 ``model_not_found``."""
        name = request.match_info["model"]
        if name not in self.model_names:
            raise HTTPProblem(404, f"The model `{name}` does not exist", "model_not_found",
                              param="model")  # fmt: skip
        return web.json_response(self._card(name).model_dump(mode="json"))

    async def openapi(self, request: web.Request) -> web.Response:
        """The OpenAPI 3 document of every route and field."""
        if self._openapi is None:
            self._openapi = openapi_document(self.model_names)
        return web.json_response(self._openapi)

    # --- completions ---------------------------------------------------------------

    def served(self) -> ServedModel:
        """What requests are checked against."""
        return ServedModel(self.model_names, self.max_context_tokens, self.vocab_size,
                           self.cfg.default_max_tokens)  # fmt: skip

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """OpenAI ``/v1/completions``."""
        body = validate_body(CompletionBody, await self._json(request))
        ids = prompt_ids(self.tokenizer, body.prompt)
        text = body.prompt if isinstance(body.prompt, str) else ""
        req = resolve(body, ids, self.served(), seed=secrets.randbits(63), chat=False,
                      prompt_text=text)  # fmt: skip
        return await self._complete(request, req)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """OpenAI ``/v1/chat/completions`` through the model's chat template."""
        body = validate_body(ChatCompletionBody, await self._json(request))
        if not self.tokenizer.chat_template:
            raise HTTPProblem(400, "this model has no chat template; use /v1/completions",
                              "no_chat_template", param="messages")  # fmt: skip
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            ids = self.tokenizer.apply_chat_template(messages)
        except Exception as exc:  # a template may raise on messages it does not accept
            raise HTTPProblem(400, f"messages: the chat template refused them: {exc}",
                              "invalid_value", param="messages") from None  # fmt: skip
        if not ids:
            raise HTTPProblem(400, "messages: the chat template produced an empty prompt",
                              "invalid_value", param="messages")  # fmt: skip
        req = resolve(body, ids, self.served(), seed=secrets.randbits(63), chat=True)
        return await self._complete(request, req)

    async def _json(self, request: web.Request) -> dict[str, Any]:
        if request.content.is_eof():  # the whole body came with the headers: nothing to wait for
            return parse_json(await request.read())
        try:
            async with asyncio.timeout(self.cfg.body_timeout_s):
                raw = await request.read()
        except TimeoutError:
            raise HTTPProblem(
                408,
                f"request body not received within {self.cfg.body_timeout_s} s",
                "request_timeout",
            ) from None
        return parse_json(raw)

    async def _complete(self, request: web.Request, req: CompletionRequest) -> web.StreamResponse:
        rid = f"{'chatcmpl' if req.chat else 'cmpl'}-{secrets.token_hex(12)}"
        flows: list[Flow] = []
        self._note_restarts()
        tokens = len(req.prompt_ids) + req.max_tokens
        if (over := self.router.too_large(tokens)) is not None:
            raise HTTPProblem(
                400,
                f"the request's KV needs {over[0]} bytes (prompt {len(req.prompt_ids)} + "
                f"max_tokens {req.max_tokens} tokens): more than any decode instance's whole "
                f"KV budget (decode.kv_budget_bytes, largest {over[1]}); lower max_tokens or "
                "shorten the prompt",
                "kv_budget_exceeded",
                param="max_tokens",
            )
        policy = req.offload.policy if req.offload is not None else None
        if policy is not None and policy not in self.policies:
            raise bad_request("pdx_offload.policy", f"pdx_offload.policy: got {policy!r}, "
                              f"expected one of {', '.join(self.policies)} (what this "
                              "gateway's engines let it decide on)")  # fmt: skip
        for index in range(req.n):
            decision = self.router.decide(
                req.route, len(req.prompt_ids), req.user, req.max_tokens, req.prompt_ids,
                req.offload, req.cache_salt,
            )  # fmt: skip
            if decision is None:
                for flow in flows:
                    flow.release()
                raise self._refusal()
            flows.append(self.flow_factory(self.ctx, req, decision, request_id=rid, index=index))
        created = created_now()
        if req.stream:
            return await self._stream(request, req, flows, rid, created)
        try:
            await _collect_all(flows)
        finally:
            for flow in flows:
                flow.release()
        return web.json_response(completion_body(self.tokenizer, req, flows, rid, created))

    async def _stream(
        self, request: web.Request, req: CompletionRequest, flows: list[Flow], rid: str,
        created: int,
    ) -> web.StreamResponse:  # fmt: skip
        events = [flow.events() for flow in flows]
        try:  # errors before the first token keep their HTTP status
            if len(events) == 1:  # the usual case, without a task per choice
                firsts: list[int | None] = [await _first(events[0])]
            else:
                firsts = list(await asyncio.gather(*(_first(e) for e in events)))
        except BaseException:
            await asyncio.gather(*(e.aclose() for e in events), return_exceptions=True)
            for flow in flows:
                flow.release()
            raise
        resp = SSEResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        sse = SSEWriter(self.tokenizer, req, flows, rid, created, resp)
        try:
            await resp.prepare(request)
            await sse.run(firsts, events)
        except ConnectionResetError:  # aiohttp's ClientConnectionResetError: the client left
            for flow, ev in zip(flows, events, strict=True):
                await self._client_gone(flow, ev)
        finally:
            for flow in flows:
                flow.release()
        return resp

    def _refusal(self) -> HTTPProblem:
        """No decode instance can take a request: 503 while none is up, else 429 (all full)."""
        if not any(d.healthy and not d.down for d in self.router.decodes):
            self.metrics.rejections.labels("decode_unavailable").inc()
            return HTTPProblem(
                503, "no decode instance is up (restarting); retry after Retry-After seconds",
                "decode_unavailable",
                headers={"Retry-After": str(self._retry_after_s("decode"))},
            )  # fmt: skip
        self.metrics.rejections.labels("no_decode_capacity").inc()
        return HTTPProblem(
            429, "no decode capacity: every decode instance is full; retry later", "overloaded",
            headers={"Retry-After": str(self.cfg.retry_after_s)},
        )  # fmt: skip

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


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


async def _first(events: AsyncGenerator[int, None]) -> int | None:
    try:
        return await anext(events)
    except StopAsyncIteration:
        return None


async def _collect_all(flows: list[Flow]) -> None:
    """Run every choice to the end; the first failure cancels the others and is raised."""
    tasks = [asyncio.ensure_future(flow.collect()) for flow in flows]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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
    restarts: RestartBoard | None = None,
) -> Gateway:
    """A gateway over named (name, host:port) prefill and decode instances."""
    router = Router(cfg.router, local_prefill_threshold(cfg))
    router.prefills = [PrefillInstance(name, addr) for name, addr in prefills]
    router.decodes = [DecodeInstance(name, addr) for name, addr in decodes]
    fixed = cfg.router.local_prefill_max_tokens, cfg.router.offload.threshold_tokens
    auto = fixed == (None, None) and cfg.model.backend != "synthetic"
    return Gateway(
        cfg.gateway,
        router,
        tokenizer,
        **naming(cfg, model_name, max_context_tokens),
        tls=tls,
        synthetic=synthetic,
        restarts=restarts,
        threshold_for=(lambda tflops: local_prefill_threshold(cfg, tflops)) if auto else None,
    )


def naming(cfg: DeployConfig, model_name: str, max_context_tokens: int) -> dict[str, Any]:
    """The keyword arguments both gateways take from the deploy config alike."""
    return {
        "max_context_tokens": max_context_tokens,
        "model_name": cfg.gateway.served_model_name or model_name,
        "model_aliases": cfg.gateway.model_aliases,
        "poll_interval_s": cfg.router.status_poll_ms / 1e3,
    }
