"""Shared by the tests that run real vLLM instances: skip reasons, one pair per module.

A module asks for :func:`vllm_deployment` once (module-scoped fixture): ``pdx deploy``'s
Deployment with ``engine: vllm``, serving from a thread of its own so tests can block on it.
Without the vLLM environment (``make vllm``) every such test skips with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import urllib.request
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from local_app import serving

from pdx.serving.deploy_config import load_deploy_config
from pdx.serving.engines.env import VENV_NAME, EngineUnavailable, discover
from pdx.serving.supervisor import Deployment

ROOT = Path(__file__).resolve().parents[2]

# Enough for every test of a module: 128 MiB of KV per instance, one core each. Eager (no
# torch.compile): these pairs test pdx's side of the P/D protocol, not vLLM's compiler, and an
# eager instance is ready in half the time (about 60 s instead of 120 s, a restart too, on two
# busy cores). The playbook test (test_vllm_accept.py) runs the compiled default.
PAIR_SETTINGS = ["engine=vllm", "gateway.port=0", "vllm.kv_cache_bytes=134217728",
                 "vllm.ready_timeout_s=420", "router.local_prefill_max_tokens=64",
                 "vllm.args=[--enforce-eager]"]  # fmt: skip


def engine_or_skip() -> None:
    """Skip the calling test (or fixture) when no working vLLM environment exists."""
    try:
        discover()
    except EngineUnavailable as exc:
        why = ROOT / f"{VENV_NAME}.skipped"
        built = f" (make test: {why.read_text().strip()})" if why.is_file() else ""
        pytest.skip(f"vLLM environment unavailable: {exc}{built}")


@contextlib.contextmanager
def vllm_deployment(overrides: list[str]) -> Iterator[Deployment]:
    """A started vLLM pair with its gateway; every process stopped by handle on exit."""
    engine_or_skip()
    loop = asyncio.new_event_loop()
    dep = Deployment(load_deploy_config(dotted=[*PAIR_SETTINGS, *overrides]))
    runner = ThreadPoolExecutor(1)
    try:
        loop.run_until_complete(dep.start())
        stop = asyncio.Event()
        serving = runner.submit(loop.run_until_complete, stop.wait())
        try:
            yield dep
        finally:
            loop.call_soon_threadsafe(stop.set)
            serving.result(30)
    finally:
        loop.run_until_complete(dep.stop())
        loop.close()
        runner.shutdown()


_used: set[int] = set()


def unique_prompt(length: int, seed: int) -> list[int]:
    """Token ids no other request of the session used (decode caches pulled KV by prompt)."""
    rng = random.Random(seed * 1_000_003 + length)
    while True:
        ids = [rng.randint(4, 259) for _ in range(length)]
        if hash(tuple(ids[:8])) not in _used:
            _used.add(hash(tuple(ids[:8])))
            return ids


def post(url: str, body: dict[str, Any], timeout_s: float = 60.0) -> tuple[int, dict[str, Any]]:
    """POST JSON, return (status, body) without raising on an error status."""
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def metrics_text(url: str) -> str:
    """An instance's (or the gateway's) Prometheus text."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return str(r.read().decode())


@contextlib.asynccontextmanager
async def side_channel_cut(prefill: str) -> AsyncIterator[str]:
    """A relay in front of prefill that sends decode to a NIXL side channel nobody listens on
    (port 9, an engine id no prefill has): decode's KV load fails; its URL."""

    async def relay(request: web.Request) -> web.Response:
        body = await request.json()
        async with (
            aiohttp.ClientSession() as s,
            s.post(prefill + "/v1/completions", json=body) as r,
        ):
            data = await r.json()
        params = data.get("kv_transfer_params") or {}
        params.update(remote_port=9, remote_engine_id="unreachable-prefill")
        return web.json_response(data)

    app = web.Application()
    app.router.add_post("/v1/completions", relay)
    app.router.add_get("/health", lambda _: web.json_response({}))
    async with serving(app) as url:
        yield url


def engine_gateway(prefill: str, decode: str, model: str) -> Any:
    """pdx's engine gateway over one prefill and one decode URL (not started)."""
    from pdx.serving.backends.tokenizer import ByteTokenizer
    from pdx.serving.gateway.engine_app import build_engine_gateway

    cfg = load_deploy_config(dotted=["engine=vllm", f"vllm.decode_urls=[{decode}]"])
    return build_engine_gateway(
        cfg, [("prefill-0", prefill)], [("decode-0", decode)], tokenizer=ByteTokenizer(),
        max_context_tokens=2048, model_name=model, served_model=model,
        kv_bytes_for=lambda n: 0, vocab_size=260,
    )  # fmt: skip
