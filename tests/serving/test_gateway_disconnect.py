"""A streaming client that goes away mid-stream: generation stops, it is counted, no traceback.

Prefill, decode and gateway run in this process (real gRPC and HTTP on loopback, real tiny
model). The client reads the first server-sent event and drops the connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from inprocess_pair import inprocess_pair

from pdx.serving.decode import DecodeNode
from pdx.serving.gateway import Gateway

SETS = ["router.local_prefill_max_tokens=8"]
PROMPT = "a prompt long enough to ship over the link"
MAX_TOKENS = 600  # far more than can stream before the disconnect is seen


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Gateway, DecodeNode]]:
    async with inprocess_pair(SETS) as (gw, _prefill, decode):
        yield gw, decode


def sample(gw: Gateway, name: str, **labels: str) -> float:
    value = gw.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def until(check: Any, timeout_s: float = 10.0) -> None:
    """Poll ``check()`` until true (bounded)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("route", ["disaggregated", "local"])
async def test_client_disconnect_mid_stream_stops_generation(
    pair: tuple[Gateway, DecodeNode], route: str, caplog: pytest.LogCaptureFixture
) -> None:
    gw, decode = pair
    engine = decode.engine
    assert engine is not None
    caplog.set_level(logging.INFO)
    url = f"http://127.0.0.1:{gw.port}/v1/completions"
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "pdx_route": route}  # fmt: skip
    async with aiohttp.ClientSession() as s:
        r = await s.post(url, json=body)
        assert r.status == 200
        first = await r.content.readline()
        assert first.startswith(b"data: {")
        r.close()  # drop the connection after the first event

        await until(lambda: sample(gw, "pdx_gateway_client_disconnects_total", route=route) == 1)
        await until(lambda: gw.router.decodes[0].in_flight == 0 and engine.admitted == 0)
        # the cancelled sequence leaves the running batch at the next step boundary
        await until(lambda: not engine.running and not engine.joining)
        assert sample(gw, "pdx_gateway_in_flight", instance="decode-0") == 0
        assert sample(gw, "pdx_gateway_requests_total", route=route,
                      outcome="client_disconnect") == 1  # fmt: skip
        assert all(p.in_flight == 0 for p in gw.router.prefills)

        # The next request is served in full.
        again = {**body, "stream": False, "max_tokens": 5}
        async with s.post(url, json=again) as r2:
            assert r2.status == 200
            data = await r2.json()
            assert data["usage"]["completion_tokens"] == 5

    assert "Traceback" not in caplog.text
    assert not [rec for rec in caplog.records if rec.exc_info or rec.levelno >= logging.ERROR]
    gone = [rec for rec in caplog.records if "client disconnected mid-stream" in rec.message]
    assert len(gone) == 1 and gone[0].levelno == logging.INFO
    assert any(f"{n} tokens" in gone[0].message for n in range(1, MAX_TOKENS))


async def test_a_half_open_probe_whose_client_leaves_does_not_hold_the_breaker_open(
    pair: tuple[Gateway, DecodeNode],
) -> None:
    """5 % of a reference run's clients cancel after the first token: the one that carried the
    breaker's probe must not leave the breaker open (and every request local) for good."""
    gw, _decode = pair
    breaker = gw.router.breaker
    breaker.cfg = breaker.cfg.model_copy(update={"breaker_open_s": 0.05})
    breaker._open("transfer_p99")
    await asyncio.sleep(0.1)
    url = f"http://127.0.0.1:{gw.port}/v1/completions"
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as s:
        r = await s.post(url, json=body)  # granted the half-open probe
        assert r.status == 200 and (await r.content.readline()).startswith(b"data: {")
        assert breaker.state == "half_open"
        r.close()
        await until(lambda: gw.router.decodes[0].in_flight == 0)
        again = {**body, "stream": False, "max_tokens": 3}
        async with s.post(url, json=again) as r2:
            data = await r2.json()
    assert data["pdx"]["route"] == "disaggregated", data["pdx"]  # the next request probed
    assert breaker.state == "closed"
