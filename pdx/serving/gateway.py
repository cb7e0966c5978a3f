"""The gateway: an OpenAI-compatible HTTP API in front of the prefill and decode services.

``POST /v1/completions`` (and ``/v1/chat/completions`` when the model has a chat template),
``stream: true`` as server-sent events ending ``data: [DONE]``, ``return_token_ids``, and the
pdx request field ``pdx_route``. Every response carries a ``pdx`` object (route, kv_bytes,
transfer_ms, retries, degraded and why). Errors map to HTTP once, in :func:`_http_error`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import signal
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdx._proto import serving_pb2, serving_pb2_grpc
from pdx.kv.codecs import is_codec_name, valid_codec_names
from pdx.serving.backends.tokenizer import Tokenizer
from pdx.serving.contract import TLSConfig
from pdx.serving.deploy_config import DeployConfig, GatewayConfig, local_prefill_threshold
from pdx.serving.router import ROUTES, Decision, DecodeInstance, PrefillInstance, Router
from pdx.serving.rpc import channel

log = logging.getLogger("pdx.gateway")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


# OpenAI request fields pdx does not implement: refused unless left at their default, so a
# client never silently gets something other than what it asked for.
UNSUPPORTED: dict[str, Any] = {"n": 1, "best_of": 1, "stop": [], "logprobs": None, "echo": False,
                               "suffix": None}  # fmt: skip


class HTTPProblem(Exception):
    """A request the gateway answers with an error status and a one-line message."""

    def __init__(self, status: int, message: str, kind: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.headers = headers or {}


def _http_error(exc: HTTPProblem) -> web.Response:
    body = {"error": {"message": exc.message, "type": exc.kind, "code": exc.status}}
    return web.json_response(body, status=exc.status, headers=exc.headers)


class GatewayMetrics:
    """Prometheus series of one gateway (its own registry, so several can live in a process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdx_gateway_requests",
            "Requests by route and outcome",
            ["route", "outcome"],
            registry=r,
        )
        self.degradations = Counter(
            "pdx_gateway_degradations", "Requests degraded to local prefill", ["reason"], registry=r
        )
        self.rejections = Counter(
            "pdx_gateway_rejections", "Requests refused before work", ["reason"], registry=r
        )
        self.client_disconnects = Counter(
            "pdx_gateway_client_disconnects",
            "Streams whose client went away before the end (generation stopped)",
            ["route"],
            registry=r,
        )
        self.ttft = Histogram(
            "pdx_gateway_ttft_seconds", "Time to first token", ["route"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            "pdx_gateway_tpot_seconds", "(E2E - TTFT) / (tokens - 1)", ["route"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.transfer = Histogram(
            "pdx_gateway_kv_transfer_seconds", "KV transfer time reported by decode",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.transfer_outcomes = Counter(
            "pdx_gateway_kv_transfers", "KV transfers by outcome", ["outcome"], registry=r
        )
        self.kv_bytes = Counter("pdx_gateway_kv_bytes", "KV bytes moved", registry=r)
        self.retries = Counter("pdx_gateway_kv_retries", "KV transfer retries", registry=r)
        self.breaker_open = Gauge(
            "pdx_gateway_circuit_open", "1 while the KV circuit breaker is not closed", registry=r
        )
        self.in_flight = Gauge(
            "pdx_gateway_in_flight", "Requests in flight per decode instance", ["instance"],
            registry=r,
        )  # fmt: skip


@dataclass
class CompletionRequest:
    """A validated completion request."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    seed: int
    stream: bool
    return_token_ids: bool
    route: str
    user: str | None
    ignore_eos: bool
    model: str
    kv_codec: str


@dataclass
class Outcome:
    """What a request produced, for the response body."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    pdx: dict[str, Any] = field(default_factory=dict)


def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise HTTPProblem(400, f"{name}: got {value!r}, expected a number", "invalid_request_error")
    if not isinstance(value, kind):
        raise HTTPProblem(
            400, f"{name}: got {value!r}, expected {_kind_name(kind)}", "invalid_request_error"
        )
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


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
            return await self._complete(request, body, self._prompt_ids(prompt), "text_completion")
        except HTTPProblem as exc:
            return _http_error(exc)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """OpenAI ``/v1/chat/completions`` (only for models with a chat template)."""
        try:
            apply = getattr(self.tokenizer, "apply_chat_template", None)
            if not self.tokenizer.chat_template or apply is None:
                raise HTTPProblem(
                    400, "this model has no chat template; use /v1/completions", "invalid_request"
                )
            body = await self._json(request)
            messages = _field(body, "messages", list, None)
            if not messages:
                raise HTTPProblem(400, "messages: required, a non-empty list", "invalid_request")
            return await self._complete(request, body, apply(messages), "chat.completion")
        except HTTPProblem as exc:
            return _http_error(exc)

    async def _json(self, request: web.Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise HTTPProblem(400, f"malformed JSON body: {exc}", "invalid_request_error") from None
        if not isinstance(body, dict):
            raise HTTPProblem(400, "request body must be a JSON object", "invalid_request_error")
        return body

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return list(prompt)
        raise HTTPProblem(
            400,
            f"prompt: got {prompt!r:.60}, expected a non-empty string or list of token ids",
            "invalid_request_error",
        )

    def _parse(self, body: dict[str, Any], ids: list[int]) -> CompletionRequest:
        bad = "invalid_request_error"
        for name, default in UNSUPPORTED.items():
            if body.get(name) not in (None, default):
                raise HTTPProblem(
                    400, f"{name}: got {body[name]!r}, only {default!r} is supported", bad
                )
        max_tokens = _field(body, "max_tokens", int, self.cfg.default_max_tokens)
        if max_tokens < 1:
            raise HTTPProblem(400, f"max_tokens: got {max_tokens}, expected >= 1", bad)
        temperature = float(_field(body, "temperature", (int, float), 0.0))
        if temperature < 0:
            raise HTTPProblem(400, f"temperature: got {temperature}, expected >= 0", bad)
        route = _field(body, "pdx_route", str, "auto")
        if route not in ROUTES:
            raise HTTPProblem(400, f"pdx_route: got {route!r}, expected one of {ROUTES}", bad)
        kv_codec = _field(body, "pdx_kv_codec", str, "")
        if kv_codec and not is_codec_name(kv_codec):
            raise HTTPProblem(
                400, f"pdx_kv_codec: got {kv_codec!r}, expected one of {valid_codec_names()}", bad
            )
        if len(ids) + max_tokens > self.max_context_tokens:
            raise HTTPProblem(
                400,
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                f"context of {self.max_context_tokens} tokens",
                bad,
            )
        return CompletionRequest(
            prompt_ids=ids,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=_field(body, "seed", int, 0),
            stream=_field(body, "stream", bool, False),
            return_token_ids=_field(body, "return_token_ids", bool, False),
            route=route,
            user=_field(body, "user", str, None),
            ignore_eos=_field(body, "ignore_eos", bool, False),
            model=_field(body, "model", str, self.model_name),
            kv_codec=kv_codec,
        )

    async def _complete(
        self, request: web.Request, body: dict[str, Any], ids: list[int], obj: str
    ) -> web.StreamResponse:
        req = self._parse(body, ids)
        decision = self.router.decide(req.route, len(ids), req.user)
        if decision is None:
            self.metrics.rejections.labels("no_decode_capacity").inc()
            raise HTTPProblem(
                429,
                "no decode capacity: every decode instance is full or unhealthy; retry later",
                "overloaded",
                {"Retry-After": str(self.cfg.retry_after_s)},
            )
        flow = _Flow(self, req, decision)
        if req.stream:
            return await self._stream(request, req, flow, obj)
        outcome = await flow.collect()
        return web.json_response(self._body(req, flow, outcome, obj))

    def _body(self, req: CompletionRequest, flow: _Flow, out: Outcome, obj: str) -> dict[str, Any]:
        text = self.tokenizer.decode(out.tokens)
        choice: dict[str, Any] = {"index": 0, "finish_reason": out.finish_reason, "logprobs": None}
        if obj == "chat.completion":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if req.return_token_ids:
            choice["token_ids"] = out.tokens
            choice["prompt_token_ids"] = req.prompt_ids
        return {
            "id": flow.id,
            "object": obj,
            "created": int(time.time()),
            "model": req.model,
            "choices": [choice],
            "usage": _usage(req, len(out.tokens)),
            "pdx": out.pdx,
        }

    async def _stream(
        self, request: web.Request, req: CompletionRequest, flow: _Flow, obj: str
    ) -> web.StreamResponse:
        events = flow.events()
        try:
            first = await anext(events)  # errors before the first token keep their HTTP status
        except StopAsyncIteration:
            first = None
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        sse = _SSE(self, req, flow, obj, resp)
        try:
            await resp.prepare(request)
            await sse.run(first, events)
        except ConnectionResetError:  # aiohttp's ClientConnectionResetError: the client left
            await self._client_gone(flow, events)
        return resp

    async def _client_gone(self, flow: _Flow, events: AsyncGenerator[int, None]) -> None:
        """A client leaving mid-stream is normal: stop its generation, count it, one log line."""
        flow.client_gone = True
        await events.aclose()  # cancels the prefill/decode calls; in-flight counters drop
        route = flow.outcome.pdx.get("route", flow.decision.route)
        self.metrics.client_disconnects.labels(route).inc()
        log.info(
            "client disconnected mid-stream: %s after %d tokens (route %s); generation stopped",
            flow.id, len(flow.outcome.tokens), route,
        )  # fmt: skip


def _usage(req: CompletionRequest, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": completion_tokens,
        "total_tokens": len(req.prompt_ids) + completion_tokens,
    }


class _SSE:
    """Writes one request's server-sent events with incremental text."""

    def __init__(
        self, gw: Gateway, req: CompletionRequest, flow: _Flow, obj: str, resp: web.StreamResponse
    ) -> None:
        self.gw, self.req, self.flow, self.resp = gw, req, flow, resp
        self.obj = "chat.completion.chunk" if obj == "chat.completion" else obj
        self.chat = obj == "chat.completion"
        self.sent_text = ""

    async def _send(self, choice: dict[str, Any], **extra: Any) -> None:
        chunk = {
            "id": self.flow.id,
            "object": self.obj,
            "created": int(time.time()),
            "model": self.req.model,
            "choices": [choice],
            **extra,
        }
        await self.resp.write(f"data: {json.dumps(chunk)}\n\n".encode())

    def _delta(self, text: str) -> dict[str, Any]:
        return {"delta": {"content": text}} if self.chat else {"text": text}

    async def tokens(self, token: int) -> None:
        """One token: the text it completes (held back while a UTF-8 character is partial)."""
        full = self.gw.tokenizer.decode(self.flow.outcome.tokens)
        text = "" if full.endswith("\ufffd") else full[len(self.sent_text) :]
        self.sent_text += text
        choice: dict[str, Any] = {"index": 0, **self._delta(text), "finish_reason": None}
        if self.req.return_token_ids:
            choice["token_ids"] = [token]
        await self._send(choice)

    async def finish(self) -> None:
        """The last event: finish reason, usage and the pdx object."""
        out = self.flow.outcome
        rest = self.gw.tokenizer.decode(out.tokens)[len(self.sent_text) :]
        choice = {"index": 0, **self._delta(rest), "finish_reason": out.finish_reason}
        await self._send(choice, usage=_usage(self.req, len(out.tokens)), pdx=out.pdx)

    async def run(self, first: int | None, events: AsyncIterator[int]) -> None:
        """Every event of the stream, then ``data: [DONE]``; a failure becomes an error event."""
        try:
            if first is not None:
                await self.tokens(first)
            async for token in events:
                await self.tokens(token)
            await self.finish()
        except HTTPProblem as exc:
            await self.error(exc)
        await self.resp.write(b"data: [DONE]\n\n")
        await self.resp.write_eof()

    async def error(self, exc: HTTPProblem) -> None:
        """An error after streaming began: one error event (the stream then ends)."""
        body = {"error": {"message": exc.message, "type": exc.kind, "code": exc.status}}
        await self.resp.write(f"data: {json.dumps(body)}\n\n".encode())


class _Flow:
    """One request through prefill (maybe) and decode, yielding tokens as they arrive."""

    def __init__(self, gw: Gateway, req: CompletionRequest, decision: Decision) -> None:
        self.gw, self.req, self.decision = gw, req, decision
        self.id = f"cmpl-{secrets.token_hex(12)}"
        self.outcome = Outcome()
        self.t0 = time.perf_counter()
        self.ttft_s: float | None = None
        self.prefill_first: serving_pb2.PrefillFirstToken | None = None
        self.prefill_reply: serving_pb2.PrefillReply | None = None
        self.marks: dict[str, float] = {}  # gateway-side intervals, seconds
        self.client_gone = False  # the streaming client disconnected before the end

    async def collect(self) -> Outcome:
        """Run to completion (non-streaming)."""
        async for _ in self.events():
            pass
        return self.outcome

    async def events(self) -> AsyncGenerator[int, None]:
        """Generated tokens in order; raises HTTPProblem on failure."""
        d = self.decision.decode
        d.in_flight += 1
        self.gw.metrics.in_flight.labels(d.name).set(d.in_flight)
        outcome_label = "error"
        try:
            gen = self._generate_request()
            # aclosing: when the client leaves, closing this generator cancels the gRPC calls
            # at once (not whenever the garbage collector finalises the inner generators).
            if self.decision.route == "disaggregated" and self.decision.prefill is not None:
                async with contextlib.aclosing(self._prefill(self.decision.prefill, gen)) as pf:
                    async for token in pf:
                        yield token
            if self.decision.degrade_reason:
                gen.degrade_reason = self.decision.degrade_reason
            async with contextlib.aclosing(self._decode(gen)) as dec:
                async for token in dec:
                    yield token
            outcome_label = "degraded" if self.outcome.pdx.get("degraded") else "ok"
        finally:
            if self.client_gone:
                outcome_label = "client_disconnect"
            d.in_flight -= 1
            self.gw.metrics.in_flight.labels(d.name).set(d.in_flight)
            route = self.outcome.pdx.get("route", self.decision.route)
            self.gw.metrics.requests.labels(route, outcome_label).inc()

    def _generate_request(self) -> serving_pb2.GenerateRequest:
        req = self.req
        sampling = serving_pb2.SamplingParams(
            max_tokens=req.max_tokens, temperature=req.temperature, seed=req.seed,
            ignore_eos=req.ignore_eos,
        )  # fmt: skip
        return serving_pb2.GenerateRequest(
            request_id=self.id, prompt_token_ids=req.prompt_ids, sampling=sampling
        )

    async def _prefill(
        self, p: PrefillInstance, gen: serving_pb2.GenerateRequest
    ) -> AsyncGenerator[int, None]:
        """Yield prefill's first token the moment it arrives; fill in the kv_id once stored.

        The client gets the first token while prefill still encodes and stores the KV, so the
        store Put is not on the time to first token. Failures degrade to local prefill.
        """
        request = serving_pb2.PrefillRequest(
            request_id=self.id, token_ids=gen.prompt_token_ids, sampling=gen.sampling,
            codec=self.req.kv_codec,
        )  # fmt: skip
        p.in_flight += 1
        sent = time.perf_counter()
        call = p.stub.PrefillStream(request, timeout=self.gw.cfg.request_timeout_s)
        try:
            async for event in call:
                if event.HasField("first"):
                    self.marks["prefill_first_event"] = time.perf_counter() - sent
                    self.prefill_first = event.first
                    gen.first_token, gen.has_first_token = event.first.first_token, True
                    self._token(gen.first_token)
                    yield gen.first_token
                elif event.HasField("stored"):
                    self.marks["prefill_stored_event"] = time.perf_counter() - sent
                    self.prefill_reply = stored = event.stored
                    gen.kv_id = stored.kv_id
                    gen.kv_endpoint = self.gw.kv_route.get(stored.kv_endpoint, stored.kv_endpoint)
        except grpc.aio.AioRpcError as exc:
            self._prefill_failed(exc, gen.has_first_token)
        finally:
            call.cancel()
            p.in_flight -= 1
        if not gen.kv_id and not self.decision.degrade_reason:
            self._degrade_to_local("prefill_no_kv")

    def _prefill_failed(self, exc: grpc.aio.AioRpcError, started: bool) -> None:
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and not started:
            raise HTTPProblem(400, exc.details() or "bad request", "invalid_request_error")
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self._degrade_to_local("prefill_overloaded")
        else:  # after the first token: the KV could not be stored; decode prefills itself
            self._degrade_to_local("kv_store_failed" if started else "prefill_unavailable")

    def _degrade_to_local(self, reason: str) -> None:
        self.decision.degrade_reason = reason
        self.decision.route = "local"

    async def _decode(self, gen: serving_pb2.GenerateRequest) -> AsyncGenerator[int, None]:
        d = self.decision.decode
        sent = time.perf_counter()
        call = d.stub.Generate(gen, timeout=self.gw.cfg.request_timeout_s)
        # Prefill's first token went out already; decode echoes it first, skipped here.
        skip = 1 if gen.has_first_token else 0
        try:
            async for chunk in call:
                self.marks.setdefault("decode_first_chunk", time.perf_counter() - sent)
                for token in chunk.token_ids:
                    if skip:
                        skip -= 1
                        continue
                    self._token(token)
                    yield token
                if chunk.finish_reason:
                    self._finish(chunk)
        except grpc.aio.AioRpcError as exc:
            raise self._decode_problem(exc, bool(self.outcome.tokens)) from None
        finally:
            call.cancel()
        if not self.outcome.finish_reason:
            raise HTTPProblem(502, f"decode {d.name} ended the stream early", "decode_failed")

    def _decode_problem(self, exc: grpc.aio.AioRpcError, started: bool) -> HTTPProblem:
        d, code = self.decision.decode, exc.code()
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and not started:
            self.gw.metrics.rejections.labels("decode_full").inc()
            return HTTPProblem(
                429, f"decode {d.name}: {exc.details()}", "overloaded",
                {"Retry-After": str(self.gw.cfg.retry_after_s)},
            )  # fmt: skip
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return HTTPProblem(400, exc.details() or "bad request", "invalid_request_error")
        d.healthy = False  # until the next successful status poll
        where = f"after {len(self.outcome.tokens)} tokens" if started else "before the first token"
        return HTTPProblem(
            502,
            f"decode instance {d.name} failed {where}: {code.name}: {exc.details()}",
            "decode_failed",
        )

    def _token(self, token: int) -> None:
        if self.ttft_s is None:
            self.ttft_s = time.perf_counter() - self.t0
        elif len(self.outcome.tokens) == 1:
            self.marks["first_to_second_token"] = time.perf_counter() - self.t0 - self.ttft_s
        self.outcome.tokens.append(token)

    def _finish(self, chunk: serving_pb2.GenerateChunk) -> None:
        st, m = chunk.stats, self.gw.metrics
        self.outcome.finish_reason = chunk.finish_reason
        degraded = st.degraded or bool(self.decision.degrade_reason)
        reason = st.degrade_reason or self.decision.degrade_reason
        if degraded:
            m.degradations.labels(reason.split(":")[0]).inc()
        if st.transfer_outcome:
            ok = st.transfer_outcome == "ok"
            m.transfer_outcomes.labels(st.transfer_outcome).inc()
            self.gw.router.breaker.record(ok, st.transfer_ms)
            if ok:
                m.transfer.observe(st.transfer_ms / 1e3)
                m.kv_bytes.inc(st.kv_bytes)
        m.retries.inc(st.retries)
        e2e_s = time.perf_counter() - self.t0
        route = st.route or self.decision.route
        if self.ttft_s is not None:
            m.ttft.labels(route).observe(self.ttft_s)
            n = len(self.outcome.tokens)
            if n > 1:
                m.tpot.labels(route).observe((e2e_s - self.ttft_s) / (n - 1))
        self.outcome.pdx = self._pdx(st, route, degraded, reason, e2e_s)

    def _pdx(
        self, st: serving_pb2.GenerateStats, route: str, degraded: bool, reason: str, e2e_s: float
    ) -> dict[str, Any]:
        pr = self.prefill_reply
        return {
            "route": route,
            "requested_route": self.req.route,
            "synthetic": self.gw.synthetic,
            "degraded": degraded,
            "degrade_reason": reason or None,
            "kv_bytes": st.kv_bytes,
            "transfer_ms": round(st.transfer_ms, 3),
            "retries": st.retries,
            "transfer_outcome": st.transfer_outcome or None,
            "decode_instance": st.instance or self.decision.decode.name,
            "prefill_instance": self.decision.prefill.name
            if pr and self.decision.prefill
            else None,
            "kv_id": pr.kv_id if pr else None,
            "timings_ms": self._timings(st, e2e_s),
        }

    def _timings(self, st: serving_pb2.GenerateStats, e2e_s: float) -> dict[str, float | None]:
        """Where the time went (ms): prefill and decode figures plus gateway-side intervals."""
        pf, pr = self.prefill_first, self.prefill_reply

        def ms(value: float | None) -> float | None:
            return None if value is None else round(value, 3)

        return {
            "ttft": ms((self.ttft_s or 0.0) * 1e3),
            "e2e": ms(e2e_s * 1e3),
            "prefill_queue": ms(pf.queue_ms) if pf else None,
            "prefill": ms(pf.prefill_ms) if pf else None,
            "kv_store": ms(pr.store_ms) if pr else None,
            "decode_kv_ready": ms(st.queue_ms),
            "local_prefill": ms(st.local_prefill_ms),
            "first_decode_step": ms(st.first_step_ms),
            **{k: ms(self.marks[k] * 1e3) if k in self.marks else None for k in MARKS},
        }


# Gateway-side intervals in every response's timings_ms (see docs/deploy.md).
MARKS = ("prefill_first_event", "prefill_stored_event", "decode_first_chunk",
         "first_to_second_token")  # fmt: skip


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


async def _serve_standalone(args: Any) -> None:
    from pdx.serving.backends.tokenizer import ByteTokenizer
    from pdx.serving.deploy_config import load_deploy_config
    from pdx.serving.prefill import tls_for

    cfg = load_deploy_config(args.config)
    gw = build_gateway(
        cfg,
        [(f"prefill-{i}", a) for i, a in enumerate(args.prefill)],
        [(f"decode-{i}", a) for i, a in enumerate(args.decode)],
        tls=tls_for(args.cert_dir, "gateway"),
        tokenizer=ByteTokenizer(),
        max_context_tokens=args.max_context_tokens,
        model_name=cfg.model.checkpoint or cfg.model.preset,
        synthetic=cfg.model.backend == "synthetic",
    )
    await gw.start(
        args.host or cfg.gateway.host, cfg.gateway.port if args.port is None else args.port
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await gw.stop()


def main() -> None:
    """Standalone gateway (one per site, e.g. in Kubernetes) over fixed instance addresses."""
    import argparse
    from pathlib import Path

    p = argparse.ArgumentParser(prog="python -m pdx.serving.gateway")
    p.add_argument("config")
    p.add_argument("--prefill", action="append", default=[], help="host:port (repeatable)")
    p.add_argument("--decode", action="append", default=[], help="host:port (repeatable)")
    p.add_argument("--cert-dir", type=Path)
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--max-context-tokens", type=int, default=1024)
    asyncio.run(_serve_standalone(p.parse_args()))


if __name__ == "__main__":
    main()
