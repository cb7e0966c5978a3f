"""Hostile and malformed input at the gateway (rows M1 and the gateway's part of L): 400 naming
the field, never 5xx, never unhealthy.

Prefill, decode and gateway run in this process (real gRPC and HTTP on loopback, real model).
Every body below once reached the model or the protobuf encoder and failed there (a 502 with
a torch message, a 500); the connection-level limits bound what a slow client can hold.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import pytest
from inprocess_pair import inprocess_pair

from pdx._proto import serving_pb2, serving_pb2_grpc
from pdx.serving.gateway import Gateway

SETS = ["router.local_prefill_max_tokens=8", "gateway.idle_timeout_s=0.5",
        "gateway.body_timeout_s=0.5", "gateway.max_body_bytes=262144"]  # fmt: skip


@pytest.fixture
async def gw() -> AsyncIterator[Gateway]:
    async with inprocess_pair(SETS) as (gateway, _prefill, _decode):
        yield gateway


async def post(gw: Gateway, raw: bytes, path: str = "/v1/completions") -> tuple[int, Any]:
    url = f"http://127.0.0.1:{gw.port}{path}"
    async with aiohttp.ClientSession() as s, s.post(url, data=raw) as r:
        return r.status, await r.json()


def deep(n: int) -> bytes:
    return b'{"prompt": "hi", "metadata": ' + b"[" * n + b"]" * n + b"}"


BAD: list[tuple[bytes, str, str]] = [
    (b'{"prompt": "hi", "temperature": NaN}', "temperature", "/v1/completions"),
    (b'{"prompt": "hi", "temperature": Infinity}', "temperature", "/v1/completions"),
    (b'{"prompt": "hi", "top_p": -Infinity}', "top_p", "/v1/completions"),
    (b'{"prompt": "hi", "temperature": 1e-38}', "temperature", "/v1/completions"),
    (b'{"prompt": "hi", "temperature": 1e-44}', "temperature", "/v1/completions"),
    (b'{"prompt": "hi", "frequency_penalty": NaN}', "frequency_penalty", "/v1/completions"),
    (b'{"prompt": "hi", "logit_bias": {"5": NaN}}', "logit_bias", "/v1/completions"),
    (b'{"prompt": "hi", "seed": 18446744073709551616}', "seed", "/v1/completions"),
    (b'{"prompt": "hi", "seed": -9223372036854775809}', "seed", "/v1/completions"),
    (b'{"prompt": "hi", "seed": -1}', "seed", "/v1/completions"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "seed": -1}', "seed",
     "/v1/chat/completions"),
    (b'{"prompt": [1099511627776]}', "prompt", "/v1/completions"),
    (b'{"prompt": [-1]}', "prompt", "/v1/completions"),
    (b'{"prompt": [5, 4000]}', "prompt", "/v1/completions"),
    (b'{"prompt": "hi", "logit_bias": {"2147483648": 1}}', "logit_bias", "/v1/completions"),
    # digits to str.isdigit(), not to int(): superscript two, Arabic-Indic three
    ('{"prompt": "hi", "logit_bias": {"\u00b2": 1}}'.encode(), "logit_bias", "/v1/completions"),
    ('{"prompt": "hi", "logit_bias": {"\u0663": 1}}'.encode(), "logit_bias", "/v1/completions"),
    (b'{"prompt": "hi", "max_tokens": 4294967297}', "max_tokens", "/v1/completions"),
    (b'{"prompt": "\\ud800"}', "prompt", "/v1/completions"),
    (b'{"prompt": "hi", "user": "\\udfff"}', "user", "/v1/completions"),
    (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content",
     "/v1/chat/completions"),
    (b'{"messages": [{"role": "tool", "content": "x"}]}', "messages[0].role",
     "/v1/chat/completions"),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
     "messages[0].content", "/v1/chat/completions"),
    (deep(20), "metadata", "/v1/completions"),
    (deep(100_000), "body", "/v1/completions"),
    (b'{"prompt": "hi"', "body", "/v1/completions"),
    (b"\xff\xfe", "body", "/v1/completions"),
]  # fmt: skip


@pytest.mark.parametrize(("raw", "param", "path"), BAD)
async def test_out_of_domain_values_are_400_naming_the_field(
    gw: Gateway, raw: bytes, param: str, path: str
) -> None:
    status, body = await post(gw, raw, path)
    assert status == 400, body
    err = body["error"]
    assert err["type"] == "invalid_request_error" and err["param"].startswith(param), err
    assert len(err["message"].splitlines()) == 1


SEED_BODIES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "hi"},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
}


async def test_seed_outside_unsigned_64_bits_is_400_and_its_edges_are_served(gw: Gateway) -> None:
    for path, base in SEED_BODIES.items():
        for seed, expected in ((-1, "greater than or equal to 0"), (2**64, f"less than {2**64}")):
            raw = json.dumps({**base, "seed": seed, "max_tokens": 1}).encode()
            status, body = await post(gw, raw, path)
            assert status == 400, (path, seed, body)
            err = body["error"]
            assert err["param"] == "seed" and err["code"] == "invalid_value", err
            assert err["message"].startswith("seed: ") and f"got {seed}" in err["message"], err
            assert expected in err["message"], err
        for seed in (0, 2**64 - 1):
            raw = json.dumps({**base, "seed": seed, "max_tokens": 1, "temperature": 1}).encode()
            status, body = await post(gw, raw, path)
            assert status == 200, (path, seed, body)


async def test_an_attacker_looping_bad_input_leaves_decode_healthy(gw: Gateway) -> None:
    decode = gw.router.decodes[0]
    legit = json.dumps({"prompt": "a long enough prompt", "max_tokens": 3}).encode()
    bad = [raw for raw, _, path in BAD if path == "/v1/completions"]
    stop = time.monotonic() + 5.0  # the attack ran 15 s; 5 s of it, bounded

    async def attacker() -> int:
        sent = 0
        while time.monotonic() < stop and sent < 2000:
            status, _ = await post(gw, bad[sent % len(bad)])
            assert status == 400
            sent += 1
        return sent

    async def user() -> tuple[list[int], list[float]]:
        statuses, latencies = [], []
        while time.monotonic() < stop:
            t0 = time.monotonic()
            statuses.append((await post(gw, legit))[0])
            latencies.append(time.monotonic() - t0)
            assert decode.healthy
            await asyncio.sleep(0.1)
        return statuses, latencies

    sent, (statuses, latencies) = await asyncio.gather(attacker(), user())
    latencies.sort()
    print(
        f"M1: {sent} bad requests in 5 s, all 400; legitimate {statuses.count(200)}/"
        f"{len(statuses)} served, median {latencies[len(latencies) // 2] * 1e3:.0f} ms"
    )
    assert statuses and set(statuses) == {200}
    assert decode.healthy


async def test_decode_and_prefill_refuse_bad_sampling_themselves(gw: Gateway) -> None:
    """A gRPC client past the gateway gets INVALID_ARGUMENT, not a failed batch step."""
    decode = serving_pb2_grpc.DecodeStub(gw._channels[0])
    prefill = serving_pb2_grpc.PrefillStub(gw._channels[1])
    sampling = serving_pb2.SamplingParams(max_tokens=3, temperature=float("nan"))
    gen = serving_pb2.GenerateRequest(request_id="x", prompt_token_ids=[5, 6], sampling=sampling)
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        async for _ in decode.Generate(gen, timeout=10):
            pass
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature" in (exc.value.details() or "")
    req = serving_pb2.PrefillRequest(request_id="x", token_ids=[5, 6], sampling=sampling)
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await prefill.Prefill(req, timeout=10)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = await decode.Status(serving_pb2.DecodeStatusRequest(), timeout=5)
    assert status.healthy


def _closed_within(sock: socket.socket, limit_s: float, trickle: bytes = b"") -> float:
    """Seconds until the server closed ``sock`` (sending ``trickle`` now and then)."""
    t0 = time.monotonic()
    sock.settimeout(0.1)
    while time.monotonic() - t0 < limit_s:
        try:
            if trickle:
                sock.sendall(trickle)
            if sock.recv(65536) == b"":
                return time.monotonic() - t0
        except TimeoutError:
            continue
        except OSError:  # reset by the server
            return time.monotonic() - t0
    raise AssertionError(f"connection still open after {limit_s} s")


async def test_partial_headers_and_idle_connections_are_closed(gw: Gateway) -> None:
    def partial_headers() -> float:
        with socket.create_connection(("127.0.0.1", gw.port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            return _closed_within(s, 10, trickle=b"X-A: b\r\n")  # one header line per 0.1 s

    def idle_after_a_request() -> float:
        with socket.create_connection(("127.0.0.1", gw.port)) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert b"200 OK" in s.recv(65536)
            return _closed_within(s, 10)

    assert await asyncio.to_thread(partial_headers) < 5
    assert await asyncio.to_thread(idle_after_a_request) < 5


async def test_slow_body_is_408_and_large_body_413_both_json(gw: Gateway) -> None:
    def slow_body() -> bytes:
        with socket.create_connection(("127.0.0.1", gw.port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                      b"Content-Type: application/json\r\n\r\n{\"prompt\"")  # fmt: skip
            s.settimeout(10)
            return s.recv(65536)

    reply = await asyncio.to_thread(slow_body)
    assert reply.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in reply
    status, body = await post(gw, b'{"prompt": "' + b"a" * 300_000 + b'"}')
    assert status == 413 and body["error"]["code"] == "request_too_large"
