"""The gateway in front of vLLM instances (``engine: vllm``): pdx's routing over HTTP engines.

The same HTTP API, router (decode score, 429 on no capacity, short prompts local, breaker,
stickiness), metrics and responses as pdx's own pair; the instances are vLLM servers. Health
comes from each instance's ``GET /health`` (every ``router.status_poll_ms``) and KV cache
use from its ``/metrics``; ``GET /metrics`` here returns the gateway's series followed by
every instance's own, labelled ``pdx_instance``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import generate_latest

from pdx.serving.backends.tokenizer import Tokenizer
from pdx.serving.deploy_config import DeployConfig, local_prefill_threshold
from pdx.serving.engines.client import EngineClient
from pdx.serving.engines.metrics import merge, sample_lines, sample_sum
from pdx.serving.engines.vllm import VLLMEngines
from pdx.serving.gateway.app import Gateway, naming
from pdx.serving.gateway.engine_flow import EngineFlow, EngineFlowContext, EngineSettings
from pdx.serving.gateway.vllm_events import follow_vllm_events
from pdx.serving.restarts import RestartBoard
from pdx.serving.router import DecodeInstance, PrefillInstance, Router
from pdx.transfer.retry import GlobalRetryBudget

KV_SCALE = 1_000_000  # decode's KV use is a fraction; the router's score wants byte-like counts
METRICS_EVERY = 8  # KV cache use is read from /metrics every this many health polls
POLLED = ("vllm:kv_cache_usage_perc", "vllm:num_requests_waiting", "vllm:num_requests_running")


class EngineGateway(Gateway):
    """The gateway with vLLM prefill and decode instances behind it."""

    flow_factory = EngineFlow
    ctx: EngineFlowContext

    def __init__(self, *args: Any, engine: EngineSettings, vocab_size: int | None = None,
                 kv_events: dict[str, str] | None = None, **kwargs: Any) -> None:  # fmt: skip
        self.engine = engine
        #: decode name → where its KV events are published (those followed)
        self.kv_events = dict(kv_events or {})
        # break_even is pdx's engines' own: its live rates come from their timings
        self.policies = ("length", "uncached") if self.kv_events else ("length",)
        self.retry_budget = GlobalRetryBudget()
        super().__init__(*args, **kwargs)
        self.vocab_size = vocab_size
        self.session: aiohttp.ClientSession | None = None
        self._client: EngineClient | None = None
        self._polls = 0

    @property
    def client(self) -> EngineClient:
        """The HTTP client to the instances (after :meth:`connect`)."""
        assert self._client is not None, "connect() first"
        return self._client

    def connect(self) -> None:
        """One HTTP session (pooled connections) for every instance."""
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=256, keepalive_timeout=30)
        # No cookies between pdx and its engines: a dummy jar skips the per-request filtering.
        self.session = aiohttp.ClientSession(
            connector=connector, cookie_jar=aiohttp.DummyCookieJar()
        )
        self._client = EngineClient(self.session, self.engine.served_model)
        self.ctx.http = self._client

    async def start(self, host: str, port: int) -> int:
        """Serve; follow the KV events of every decode that publishes them."""
        port = await super().start(host, port)
        loop = asyncio.get_running_loop()
        for d in self.router.decodes:
            if (endpoint := self.kv_events.get(d.name)) is not None:
                watch = follow_vllm_events(d, endpoint, self.metrics.cached_blocks_changed)
                self._watchers[d.name] = loop.create_task(watch)
        return port

    def flow_context(self) -> EngineFlowContext:
        """The shared state plus the engines' settings, retry budget and client."""
        base = super().flow_context()
        return EngineFlowContext(**vars(base), engine=self.engine, retry_budget=self.retry_budget)

    async def stop(self) -> None:
        """Stop serving, then close the HTTP session."""
        await super().stop()
        if self._client is not None:
            await self._client.close()
        if self.session is not None:
            await self.session.close()

    async def poll_once(self) -> None:
        """Health of every instance; every few polls, decode's KV cache use too."""
        self._polls += 1
        with_metrics = self._polls % METRICS_EVERY == 1
        await asyncio.gather(
            *(self._poll_decode(d, with_metrics) for d in self.router.decodes),
            *(self._poll_prefill(p) for p in self.router.prefills),
        )
        self.metrics.breaker_open.set(0 if self.router.breaker.state == "closed" else 1)

    async def _poll_decode(self, d: DecodeInstance, with_metrics: bool) -> None:
        d.healthy = await self.client.healthy(d.address)
        if d.healthy and with_metrics:
            text = await self.client.metrics_text(d.address, timeout_s=1.0)
            if text is not None:
                text = sample_lines(text, *POLLED)  # one pass over ~700 lines, not three
                used = sample_sum(text, "vllm:kv_cache_usage_perc")
                d.kv_free_bytes = int(KV_SCALE * max(0.0, 1.0 - used))
                d.queue_depth = int(sample_sum(text, "vllm:num_requests_waiting"))
                d.running = int(sample_sum(text, "vllm:num_requests_running"))

    async def _poll_prefill(self, p: PrefillInstance) -> None:
        p.healthy = await self.client.healthy(p.address)

    async def prom(self, request: web.Request) -> web.Response:
        """The gateway's series, then every instance's own (label ``pdx_instance``)."""
        own = generate_latest(self.metrics.registry)
        instances: list[PrefillInstance | DecodeInstance] = [
            *self.router.prefills,
            *self.router.decodes,
        ]
        texts = await asyncio.gather(*(self.client.metrics_text(i.address) for i in instances))
        engines = merge((i.name, t) for i, t in zip(instances, texts, strict=True) if t)
        return web.Response(body=own + engines, content_type="text/plain", charset="utf-8")


def kv_sizer(
    config: dict[str, Any], block_size: int, device: str, dtype: str
) -> Callable[[int], int]:
    """Prompt tokens → bytes of the whole blocks vLLM's connector moves (measure-kv's rule)."""
    from pdx.errors import PdxError
    from pdx.kv.engines import vllm_kv_bytes

    @lru_cache(maxsize=4096)
    def size(tokens: int) -> int:
        if tokens <= 0:
            return 0
        try:
            return vllm_kv_bytes(config, tokens, block_size, device=device, dtype=dtype).total_bytes
        except (PdxError, KeyError, TypeError, ValueError):
            return 0

    return size


def build_engine_gateway(
    cfg: DeployConfig,
    prefills: list[tuple[str, str]],
    decodes: list[tuple[str, str]],
    *,
    tokenizer: Tokenizer,
    max_context_tokens: int,
    model_name: str,
    served_model: str,
    kv_bytes_for: Callable[[int], int],
    vocab_size: int | None,
    restarts: RestartBoard | None = None,
    kv_events: dict[str, str] | None = None,
) -> EngineGateway:
    """A gateway over named (name, base URL) vLLM prefill and decode instances
    (``kv_events``: decode name → its KV events endpoint, for those it follows)."""
    router = Router(cfg.router, local_prefill_threshold(cfg))
    router.prefills = [PrefillInstance(name, url) for name, url in prefills]
    router.decodes = [
        DecodeInstance(
            name,
            url,
            max_batch=cfg.decode.max_batch,
            max_queue=cfg.decode.max_queue,
            kv_budget_bytes=KV_SCALE,
            kv_free_bytes=KV_SCALE,
        )
        for name, url in decodes
    ]
    settings = EngineSettings(
        served_model=served_model,
        prefill_timeout_s=cfg.vllm.prefill_timeout_s,
        retry_budget=cfg.kv.kv_retry_budget,
        kv_load_timeout_s=cfg.vllm.kv_load_timeout_s,
        kv_bytes_for=kv_bytes_for,
    )
    return EngineGateway(
        cfg.gateway,
        router,
        tokenizer,
        **naming(cfg, model_name, max_context_tokens),
        tls=None,
        engine=settings,
        vocab_size=vocab_size,
        restarts=restarts,
        kv_events=kv_events,
    )


async def gateway_for_engines(
    cfg: DeployConfig, engines: VLLMEngines, *, restarts: RestartBoard | None = None
) -> EngineGateway:
    """The gateway ``pdx deploy`` runs in front of prepared (and started) engine instances
    (``restarts``: the supervisor's view of them, for /readyz, /metrics and 503s)."""
    from pdx.serving.backends.tokenizer import HFTokenizer

    model = engines.model
    assert model is not None
    tokenizer = HFTokenizer(await asyncio.to_thread(_auto_tokenizer, model.path))
    served = model.served_name
    insts = list(engines.instances.values())
    if cfg.vllm.external and not cfg.vllm.served_model_name:
        served = await _served_name(insts[-1].url) or served  # a decode instance's own name
        engines.model = model = dataclasses.replace(model, served_name=served)
    text = model.config.get("text_config") or model.config
    sizer = kv_sizer(model.config, engines.block_size, engines.device, model.kv_dtype)
    return build_engine_gateway(
        cfg,
        [(i.name, i.url) for i in insts if i.role == "prefill"],
        [(i.name, i.url) for i in insts if i.role == "decode"],
        tokenizer=tokenizer,
        max_context_tokens=model.max_context_tokens,
        model_name=served,
        served_model=served,
        kv_bytes_for=sizer,
        vocab_size=int(text["vocab_size"]) if text.get("vocab_size") else None,
        restarts=restarts,
        kv_events={i.name: ep for i in insts if (ep := engines.kv_events_endpoint(i))},
    )


def _auto_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


async def _served_name(url: str) -> str | None:
    async with aiohttp.ClientSession() as session:
        names = await EngineClient(session, "").served_models(url)
    return names[0] if names else None
