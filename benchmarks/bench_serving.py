"""TTFT and TPOT of the disaggregated pair vs colocated serving of the same tiny model, same run.

Five paths, one request at a time (latency, not throughput), the same prompt, interleaved:
  colocated      the model in this process: TTFT = prefill forward + pick; TPOT = decode step.
  colocated_http one process holding the model behind a minimal HTTP/SSE endpoint (no gRPC):
                 what a colocated server pays for HTTP on top of the forward pass.
  local          pdx deploy, ``pdx_route: local``: gateway → decode, which prefills itself.
  disagg         pdx deploy, ``pdx_route: disaggregated``: gateway → prefill, whose first
                 token is streamed at once while the KV is stored; decode then fetches it.
  direct_grpc    the same two gRPC calls (PrefillStream, then decode's Generate with the
                 kv_id) made by the benchmark itself on the same instances: no gateway. The
                 gateway's own cost is the per-round difference disagg − direct_grpc (goal:
                 median <= 1 ms by its interval, p99 difference <= 3 ms).
  bare_forwarder the least an aiohttp + grpc.aio front does for the same request, in the
                 gateway's own process and event loop, on its own channels (same mutual TLS):
                 read the body, one orjson parse, PrefillStream, the first token's event,
                 decode's Generate, one event per chunk. No validation, routing, metrics or
                 text. bare_forwarder − direct_grpc is what the stack costs (two more
                 process wake-ups, HTTP in and out); disagg − bare_forwarder is pdx's own
                 code, so each run says which of the two a missed goal is made of.
The deployment runs in a child process, gateway included, as ``pdx deploy`` runs it; this
process is the client of every path, the HTTP ones through a lean client (pooled keep-alive,
llhttp's C parser) as the gRPC one goes through grpc's C core, so neither side's client work
lands on the other's event loop or is charged to the gateway.
TTFT is measured by the client to the first streamed token; TPOT = (E2E - TTFT) / (tokens - 1);
the first→second token gap is reported on its own (disaggregation moves work there).
Each served TTFT is broken down from the per-request ``pdx.timings_ms`` (gateway HTTP, gateway
routing, gRPC hop, prefill queueing, prefill compute) and so is the gap to the second token
(KV encode + Put, Generate hop, transfer + rebuild, first decode step).
Goal: disaggregated TTFT overhead <= transfer time + 5 ms, against each baseline.

Usage: python benchmarks/bench_serving.py [--prompt-tokens 512] [--max-tokens 16]
       [--requests 15] [--codec raw] [--no-tls] [--json]

``--streamed-kv`` measures streamed KV (kv.streaming) instead: the synthetic backend sized as
an 8B-class model (llama-3.1-8b), 3,072-token prompts (384 MiB of KV: a 30-request run
within ~6 minutes on a shared 2-core box), the KV link through the fault proxy with
10 ms RTT and a 1 Gbit/s rate cap (loopback; the packet-level WAN needs the netns setup of
docs/deploy.md), the disaggregated path with streaming off ("whole") and on ("streamed"), each
on its own deployment, both running. The rules of the fight:
  same writer    both modes store prefill's KV into the store that prefill's own process
                 holds through one in-process writer (pdx.transfer.local.LocalWriter), not a
                 loopback Put on one side only; the store's audit names the transport of
                 every Put, and the run prints the count per mode.
  busy prefill   model.synthetic_compute=spin: the roofline's prefill (and decode step) time
                 keeps a core busy on matrix products, the GIL released inside each as torch
                 releases it for a real forward pass, instead of sleeping: the streamed
                 transfer competes for the CPU with the prefill it overlaps.
  30 requests    per mode by default, after one warm-up each, in rounds that interleave the
                 modes with the order alternated (whole first in even rounds, streamed first
                 in odd ones), so drift and neighbours on a shared box hit both alike.
  intervals      each mode's median arrival → second token with distribution-free bounds
                 (order statistics, pdx.accept.judge.confidence.quantile_bounds, each one-sided at
                 95 %: together a 90 % interval); the streamed/whole ratio is the median of
                 the per-round ratios, with the same bounds.
Goal: arrival → second token <= max(prefill, transfer) + one decode step + 3 RTT with streaming
on, its terms the medians of streamed prefill, whole-object transfer (measured with streaming
off) and streamed first step: MET when the streamed median's upper bound is below the goal,
MISSED when its lower bound is above it, UNDECIDED otherwise. The fraction of the transfer
hidden behind prefill is reported. What differs by design stays in the figures, and the gap
whole − streamed is split into its parts: the transfer hidden behind prefill, and what the
whole-object path does that the streamed one does not: encoding the KV into one payload
before writing it ("store"; the streamed path hands each layer's tensors over as they exist)
and joining the received object before rebuilding the tensors on decode ("rebuild"; the
streamed path rebuilds each tensor as its bytes arrive).

Usage: python benchmarks/bench_serving.py --streamed-kv [--prompt-tokens 3072]
       [--requests 30] [--compute spin|sleep] [--rtt-ms 10] [--rate-mbps 1000] [--no-tls]
       [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

GOAL_SLACK_MS = 5.0
# The gateway's own cost over pdx's two gRPC calls made directly: median and p99 of TTFT.
GATEWAY_GOAL_MS, GATEWAY_P99_GOAL_MS = 1.0, 3.0
BASELINES = ("colocated", "colocated_http", "local")
LATENCIES = ("ttft_ms", "second_token_gap_ms", "tpot_ms")


def median(values: list[float]) -> float:
    """Median, NaN when empty."""
    return statistics.median(values) if values else float("nan")


class Colocated:
    """The same model in this process: no network, no serialization."""

    def __init__(self) -> None:
        from pdx.serving.backends import BackendConfig, create_backend

        self.backend = create_backend(BackendConfig())

    def once(self, prompt: list[int], max_tokens: int) -> dict[str, float]:
        """TTFT = prefill forward + pick; TPOT = mean decode step."""
        stamps = [time.perf_counter()]
        for _ in self.tokens(prompt, max_tokens):
            stamps.append(time.perf_counter())
        return _latencies(stamps)

    def tokens(self, prompt: list[int], max_tokens: int) -> Any:
        """Greedy tokens, one at a time."""
        from pdx.serving.backends.sampling import pick_token

        state, logits = self.backend.prefill(prompt)
        token = pick_token(logits, 0, 0, 0)
        yield token
        for _ in range(max_tokens - 1):
            (state,), logits = self.backend.decode_step([state], [token])
            token = pick_token(logits[0], 0, 0, 0)
            yield token


async def serve_colocated() -> None:
    """Child mode: one process, the model behind ``POST /v1/completions`` streaming SSE.

    Written for the benchmark only (the smallest honest colocated server: model calls on one
    worker thread, tokens written as they come); prints ``PORT <n>`` when listening.
    """
    from concurrent.futures import ThreadPoolExecutor

    from aiohttp import web

    colo, pool = Colocated(), ThreadPoolExecutor(1)
    loop = asyncio.get_running_loop()

    async def completions(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        gen = colo.tokens(body["prompt"], body["max_tokens"])
        while (token := await loop.run_in_executor(pool, next, gen, None)) is not None:
            event = {"choices": [{"index": 0, "token_ids": [token]}]}
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        await resp.write(b'data: {"choices": [{"index": 0}], "pdx": {}}\n\ndata: [DONE]\n\n')
        return resp

    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(f"PORT {site._server.sockets[0].getsockname()[1]}", flush=True)  # type: ignore[union-attr]
    await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes our stdin
    await runner.cleanup()


async def start_colocated_server() -> tuple[asyncio.subprocess.Process, str]:
    """Start the colocated HTTP server as a child; return (process, completions URL)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--serve-colocated",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), timeout=120)
    if not line.startswith(b"PORT "):
        proc.kill()
        raise SystemExit(f"colocated server did not start: {line!r}")
    return proc, f"http://127.0.0.1:{int(line.split()[1])}/v1/completions"


async def stop_child(proc: asyncio.subprocess.Process, timeout: float = 10) -> None:
    """Close the child's stdin (it exits), kill it if it lingers."""
    assert proc.stdin is not None
    proc.stdin.close()
    try:
        await asyncio.wait_for(proc.wait(), timeout=timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()


async def one_request(client: Any, url: str, body: bytes, timeout_s: float = 60) -> dict[str, Any]:
    """Stream one completion; client-side TTFT/TPOT plus the server's pdx timings.

    The client is lean (pdx.serving.engines.http1: pooled keep-alive, one write per request,
    llhttp's C parser), as grpc's C core is on the direct gRPC path: an aiohttp client spends
    ~0.3 ms more of its own on the way to the first token, which would be charged to the
    gateway in the gateway-over-direct difference."""
    from pdx.serving.engines.http1 import origin_of

    origin, prefix = origin_of(url)
    stamps = [time.perf_counter()]  # request sent, then one per token
    last: dict[str, Any] = {}
    buf = b""
    async with client.post(origin, prefix, body, timeout_s=timeout_s) as r:
        if r.status != 200:
            raise SystemExit(f"HTTP {r.status}: {(await r.read()).decode(errors='replace')}")
        async for piece in r.iter_any():
            buf += piece
            *events, buf = buf.split(b"\n\n")
            for raw in events:
                if not raw.startswith(b"data: ") or raw == b"data: [DONE]":
                    continue
                event = json.loads(raw[6:])
                if "error" in event:
                    raise SystemExit(f"stream error: {event['error']}")
                now = time.perf_counter()
                stamps += [now] * len(event["choices"][0].get("token_ids", []))
                last = event
    assert len(stamps) > 2 and "pdx" in last, last
    return {**_latencies(stamps), "pdx": last["pdx"]}


def _latencies(stamps: list[float]) -> dict[str, float]:
    """TTFT, first→second token gap and TPOT (ms) from [start, token 1, token 2, ...] times."""
    t0, first, second, end = stamps[0], stamps[1], stamps[2], stamps[-1]
    return {
        "ttft_ms": (first - t0) * 1e3,
        "second_token_gap_ms": (second - first) * 1e3,
        "tpot_ms": (end - first) * 1e3 / (len(stamps) - 2),
    }


async def serve_deployment(sets: list[str]) -> None:
    """Child mode: ``pdx deploy``'s Deployment (gateway in this process, as the command runs
    it); prints ``DEPLOYMENT <json>`` (gateway URL, instance addresses, TLS directory, the
    gateway's KV routes) when serving, and stops when the parent closes our stdin."""
    from pdx.serving.deploy_config import load_deploy_config
    from pdx.serving.supervisor import Deployment

    dep = Deployment(load_deploy_config(dotted=sets))
    await dep.start()
    try:
        router = dep.gateway.router
        info = {"gateway": dep.endpoints().gateway, "tls_dir": dep.endpoints().tls_dir,
                "prefill": router.prefills[0].address, "decode": router.decodes[0].address,
                "kv_route": dict(dep.gateway.kv_route)}  # fmt: skip
        bare = await start_bare_forwarder(info)
        info["bare_forwarder"] = bare.url
        print("DEPLOYMENT " + json.dumps(info), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await bare.stop()
    finally:
        await dep.stop()


async def start_bare_forwarder(info: dict[str, Any]) -> BareForwarder:
    """The reference front, serving on a free loopback port."""
    from aiohttp import web

    bare = BareForwarder(info)
    await bare.runner.setup()
    site = web.TCPSite(bare.runner, "127.0.0.1", 0)
    await site.start()
    bare.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1/completions"  # type: ignore[union-attr]
    return bare


async def start_deployment(sets: list[str]) -> tuple[asyncio.subprocess.Process, dict[str, Any]]:
    """Start the deployment as a child; return (process, what it printed)."""
    argv = [sys.executable, __file__, "--serve-deployment", *[f"--set={s}" for s in sets]]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(180):
            while line := await proc.stdout.readline():
                if line.startswith(b"DEPLOYMENT "):
                    # what the deployment prints later goes on to our stderr, so its pipe
                    # never fills and stalls it
                    DRAINS.add(asyncio.ensure_future(_drain(proc.stdout)))
                    return proc, json.loads(line[len(b"DEPLOYMENT ") :])
                sys.stderr.buffer.write(line)
    proc.kill()
    raise SystemExit("the deployment did not start (its output is above)")


DRAINS: set[asyncio.Future[None]] = set()


async def _drain(stream: asyncio.StreamReader) -> None:
    while line := await stream.readline():
        sys.stderr.buffer.write(line)


class DirectClient:
    """pdx's own two gRPC calls made by the benchmark's process, no gateway: its own channels
    to the deployment's instances, with the gateway's certificate (the same mutual TLS)."""

    def __init__(self, info: dict[str, Any]) -> None:
        from pdx._proto import serving_pb2_grpc
        from pdx.serving.rpc import channel
        from pdx.tls import tls_for

        tls = tls_for(Path(info["tls_dir"]), "gateway") if info["tls_dir"] else None
        self.channels = [channel(info["prefill"], tls), channel(info["decode"], tls)]
        self.prefill = serving_pb2_grpc.PrefillStub(self.channels[0])
        self.decode = serving_pb2_grpc.DecodeStub(self.channels[1])
        self.kv_route: dict[str, str] = info["kv_route"]

    def take_stored(self, gen: Any, stored: Any) -> None:
        """Decode's request given prefill's stored KV (its address as the gateway routes it)."""
        gen.kv_id = stored.kv_id
        gen.kv_endpoint = self.kv_route.get(stored.kv_endpoint, stored.kv_endpoint)

    async def close(self) -> None:
        for ch in self.channels:
            await ch.close()


class BareForwarder(DirectClient):
    """The reference front (``bare_forwarder`` above): aiohttp in, grpc.aio out, nothing else.
    Its channels (the direct client's) and server are its own; it shares the gateway's
    process and event loop."""

    def __init__(self, info: dict[str, Any]) -> None:
        from aiohttp import web

        super().__init__(info)
        self.count = 0
        app = web.Application(client_max_size=16 << 20)
        app.router.add_post("/v1/completions", self.completions)
        self.runner = web.AppRunner(app, access_log=None)
        self.url = ""

    async def completions(self, request: Any) -> Any:
        import orjson
        from aiohttp import web

        from pdx._proto import serving_pb2

        body = orjson.loads(await request.read())
        self.count += 1
        rid = f"bare-{self.count}"
        sampling = serving_pb2.SamplingParams(max_tokens=body["max_tokens"], temperature=0.0,
                                              ignore_eos=True)  # fmt: skip
        prompt = body["prompt"]
        call = self.prefill.PrefillStream(
            serving_pb2.PrefillRequest(request_id=rid, token_ids=prompt, sampling=sampling),
            timeout=60,
        )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        gen = serving_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                          sampling=sampling)  # fmt: skip
        async for event in call:
            if event.HasField("first"):
                await resp.prepare(request)
                await resp.write(b'data: {"choices":[{"index":0,"token_ids":[%d]}]}\n\n'
                                 % event.first.first_token)  # fmt: skip
                gen.first_token, gen.has_first_token = event.first.first_token, True
            elif event.HasField("stored"):
                self.take_stored(gen, event.stored)
        skip = 1  # decode echoes prefill's first token first
        async for chunk in self.decode.Generate(gen, timeout=60):
            ids = list(chunk.token_ids)[skip:]
            skip = 0
            if ids:
                await resp.write(b'data: {"choices":[{"index":0,"token_ids":%s}]}\n\n'
                                 % orjson.dumps(ids))  # fmt: skip
        await resp.write(b'data: {"choices":[{"index":0}],"pdx":{}}\n\ndata: [DONE]\n\n')
        return resp

    async def stop(self) -> None:
        await self.runner.cleanup()
        await self.close()


async def served(args: argparse.Namespace, prompt: list[int]) -> dict[str, list[dict[str, Any]]]:
    """Run every path ``args.requests`` times (after warm-up), interleaved.

    The deployment (gateway included) runs in a child process, as ``pdx deploy`` would, and
    this process is the client of every path: the HTTP client's own work (sending, reading
    and parsing the stream) is not done on the gateway's event loop, and the direct gRPC
    client, in this process too, pays its client side alike."""
    from pdx.serving.engines.http1 import HTTP1Client

    sets = ["gateway.port=0", "kv.kv_transfer_timeout_ms=5000", f"kv.codec={args.codec}"]
    if args.no_tls:
        sets.append("tls.enabled=false")
    dep_proc, info = await start_deployment(sets)
    child, colo_url = await start_colocated_server()
    direct, http = DirectClient(info), HTTP1Client()
    url = info["gateway"] + "/v1/completions"
    colo = Colocated()
    bodies = {route: json.dumps(_body(prompt, args, route)).encode()
              for route in ("", "local", "disaggregated")}  # fmt: skip
    bodies["bare"] = json.dumps({"prompt": prompt, "max_tokens": args.max_tokens}).encode()
    calls: dict[str, Callable[[], Any]] = {
        "colocated": lambda: asyncio.to_thread(colo.once, prompt, args.max_tokens),
        "colocated_http": lambda: one_request(http, colo_url, bodies[""]),
        "local": lambda: one_request(http, url, bodies["local"]),
        "disaggregated": lambda: one_request(http, url, bodies["disaggregated"]),
        "direct_grpc": lambda: direct_grpc(direct, prompt, args.max_tokens),
        "bare_forwarder": lambda: one_request(http, info["bare_forwarder"], bodies["bare"]),
    }
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in calls}
    try:
        for i in range(3 + args.requests):  # 3 warm-ups: connections, TLS, allocator
            # interleaved, so drift hits every path alike; the order reversed every other
            # round, so no path always follows the same one
            order = list(calls) if i % 2 == 0 else list(reversed(calls))
            for name in order:
                result = await calls[name]()
                if i >= 3:
                    out[name].append(result)
    finally:
        await http.close()
        await direct.close()
        await stop_child(child)
        await stop_child(dep_proc, timeout=60)
    return out


async def direct_grpc(direct: DirectClient, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """pdx's own two calls made by the benchmark itself, no gateway: PrefillStream (first
    token, then the stored kv_id), then decode's Generate with it: the floor the
    disaggregated path's HTTP gateway adds to."""
    from pdx._proto import serving_pb2

    sampling = serving_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                          ignore_eos=True)  # fmt: skip
    rid = f"direct-{time.monotonic_ns()}"
    gen = serving_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling)
    stamps = [time.perf_counter()]
    call = direct.prefill.PrefillStream(
        serving_pb2.PrefillRequest(request_id=rid, token_ids=prompt, sampling=sampling),
        timeout=60,
    )
    async for event in call:
        if event.HasField("first"):
            stamps.append(time.perf_counter())
            gen.first_token, gen.has_first_token = event.first.first_token, True
        elif event.HasField("stored"):
            direct.take_stored(gen, event.stored)
    skip = 1  # decode echoes prefill's first token first
    async for chunk in direct.decode.Generate(gen, timeout=60):
        for _ in chunk.token_ids:
            if skip:
                skip -= 1
                continue
            stamps.append(time.perf_counter())
    assert gen.kv_id and len(stamps) > 2, (gen.kv_id, len(stamps))
    return _latencies(stamps)


def _body(prompt: list[int], args: argparse.Namespace, route: str) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": args.max_tokens, "stream": True, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    return {**body, "pdx_route": route} if route else body


def _timing(r: dict[str, Any], key: str) -> float:
    return float(r["pdx"]["timings_ms"].get(key) or 0.0)


def disaggregated_breakdown(rs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Medians of where the disaggregated TTFT and the gap to the second token go (ms)."""

    def m(fn: Callable[[dict[str, Any]], float]) -> float:
        return round(median([fn(r) for r in rs]), 3)

    ttft = {
        "gateway_http_ms": m(lambda r: r["ttft_ms"] - _timing(r, "ttft")),
        "gateway_routing_ms": m(lambda r: _timing(r, "ttft") - _timing(r, "prefill_first_event")),
        "prefill_grpc_hop_ms": m(
            lambda r: (
                _timing(r, "prefill_first_event")
                - _timing(r, "prefill_queue")
                - _timing(r, "prefill")
            )
        ),
        "prefill_queue_ms": m(lambda r: _timing(r, "prefill_queue")),
        "prefill_ms": m(lambda r: _timing(r, "prefill")),
    }
    after = {
        "kv_encode_put_ms": m(lambda r: _timing(r, "kv_store")),
        "kv_stored_after_first_token_ms": m(
            lambda r: _timing(r, "prefill_stored_event") - _timing(r, "prefill_first_event")
        ),
        "decode_grpc_hop_ms": m(lambda r: _timing(r, "decode_first_chunk")),
        "transfer_ms": m(lambda r: float(r["pdx"]["transfer_ms"])),
        "kv_ready_on_decode_ms": m(lambda r: _timing(r, "decode_kv_ready")),
        "first_decode_step_ms": m(lambda r: _timing(r, "first_decode_step")),
        "first_to_second_token_ms": m(lambda r: _timing(r, "first_to_second_token")),
    }
    return {"ttft": ttft, "second_token": after}


def local_breakdown(rs: list[dict[str, Any]]) -> dict[str, float]:
    """Medians of where the local path's TTFT goes (ms)."""

    def m(fn: Callable[[dict[str, Any]], float]) -> float:
        return round(median([fn(r) for r in rs]), 3)

    return {
        "gateway_http_ms": m(lambda r: r["ttft_ms"] - _timing(r, "ttft")),
        "gateway_routing_ms": m(lambda r: _timing(r, "ttft") - _timing(r, "decode_first_chunk")),
        "decode_grpc_hop_ms": m(
            lambda r: _timing(r, "decode_first_chunk") - _timing(r, "local_prefill")
        ),
        "local_prefill_ms": m(lambda r: _timing(r, "local_prefill")),
    }


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians per path, the breakdowns, and the goal check against every baseline."""
    paths = {
        route: {key: median([r[key] for r in rs]) for key in LATENCIES}
        for route, rs in runs.items()
    }
    dis = runs["disaggregated"]
    assert all(not r["pdx"]["degraded"] for r in dis), "a disaggregated request degraded"
    # the gateway's own cost: per round, the disaggregated path through it against pdx's two
    # gRPC calls made directly (same instances, same round), median with a 90 % interval
    gw = {
        key: median_bounds([a[key] - b[key] for a, b in zip(dis, runs["direct_grpc"],
                                                            strict=True)])
        for key in ("ttft_ms", "tpot_ms")
    }  # fmt: skip
    # ... and split: the stack's floor (the bare forwarder over direct) and pdx's own code
    # (the gateway over the bare forwarder), the same way
    split = {
        name: median_bounds([a["ttft_ms"] - b["ttft_ms"] for a, b in zip(runs[x], runs[y],
                                                                         strict=True)])
        for name, x, y in (("bare_forwarder_over_direct_grpc_ms", "bare_forwarder", "direct_grpc"),
                           ("gateway_over_bare_forwarder_ms", "disaggregated", "bare_forwarder"))
    }  # fmt: skip
    p99 = {route: p99_bounds([r["ttft_ms"] for r in rs]) for route, rs in runs.items()}
    gw_p99 = p99_difference(p99["disaggregated"], p99["direct_grpc"])
    gw_goal = {"median": judge(gw["ttft_ms"], GATEWAY_GOAL_MS),
               "p99": judge(gw_p99, GATEWAY_P99_GOAL_MS)}  # fmt: skip
    transfer = median([float(r["pdx"]["transfer_ms"]) for r in dis])
    goal = transfer + GOAL_SLACK_MS
    overhead = {b: paths["disaggregated"]["ttft_ms"] - paths[b]["ttft_ms"] for b in BASELINES}
    return {
        "paths": paths,
        "disaggregated_breakdown_ms": disaggregated_breakdown(dis),
        "local_breakdown_ms": local_breakdown(runs["local"]),
        "kv_bytes": int(median([float(r["pdx"]["kv_bytes"]) for r in dis])),
        "transfer_ms": transfer,
        "goal_ms": goal,
        "ttft_overhead_ms": overhead,
        "goal_met": {b: v <= goal for b, v in overhead.items()},
        "tpot_ratio_disagg_to_local": paths["disaggregated"]["tpot_ms"] / paths["local"]["tpot_ms"],
        "gateway_over_direct_grpc_ms": gw,
        **split,
        "ttft_p99_ms": p99,
        "gateway_over_direct_grpc_p99_ms": gw_p99,
        "gateway_goal": gw_goal,
    }


def p99_bounds(values: list[float]) -> dict[str, float | None]:
    """The p99 (nearest rank) and its distribution-free bounds, each one-sided at
    ``CONFIDENCE``: the upper one needs 299 values, the lower one 5."""
    from pdx.accept.judge.confidence import quantile_bounds

    ordered = sorted(values)
    b = quantile_bounds(ordered, 0.99, CONFIDENCE)
    rank = min(len(ordered), int(0.99 * len(ordered) + 0.999999))
    return {"p99": round(ordered[rank - 1], 3),
            "low": None if b.low is None else round(b.low, 3),
            "high": None if b.high is None else round(b.high, 3)}  # fmt: skip


def p99_difference(a: dict[str, float | None], b: dict[str, float | None]) -> dict[str, Any]:
    """p99(a) − p99(b) with bounds from each side's (a's low − b's high, a's high − b's low:
    together at least a 90 % interval when each side's bounds are)."""
    from pdx.accept.judge.confidence import Bounds, difference_bounds

    assert a["p99"] is not None and b["p99"] is not None
    d = difference_bounds(Bounds(a["low"], a["high"]), Bounds(b["low"], b["high"]))
    return {"median": round(a["p99"] - b["p99"], 3),
            "low": None if d.low is None else round(d.low, 3),
            "high": None if d.high is None else round(d.high, 3)}  # fmt: skip


BASELINE_WORDS = {
    "colocated": "colocated in-process (model call only, no HTTP, no RPC)",
    "colocated_http": "colocated server (one process, same HTTP/SSE, no gRPC)",
    "local": "local route (same gateway, decode prefills)",
}


def render(result: dict[str, Any]) -> None:
    """Print the result for a terminal."""
    for name, v in result["paths"].items():
        gap, tpot = v["second_token_gap_ms"], v["tpot_ms"]
        print(f"{name:>14}: TTFT {v['ttft_ms']:7.2f} ms   first→second token {gap:6.2f} ms   "
              f"TPOT {tpot:6.2f} ms (median)")  # fmt: skip
    print(f"KV per request {result['kv_bytes']} B, codec {result['codec']}, TLS {result['tls']}")
    dis = result["disaggregated_breakdown_ms"]
    for title, parts in (
        ("disaggregated TTFT", dis["ttft"]),
        ("disaggregated, after the first token", dis["second_token"]),
        ("local TTFT", result["local_breakdown_ms"]),
    ):
        print(f"{title} (median ms): " + ", ".join(
            f"{k.removesuffix('_ms')} {v:.2f}" for k, v in parts.items()
        ))  # fmt: skip
    verdict = {True: "MET", False: "NOT MET"}
    print(f"goal: TTFT overhead <= transfer + {GOAL_SLACK_MS:.0f} ms = {result['goal_ms']:.2f} ms")
    for b, words in BASELINE_WORDS.items():
        over = result["ttft_overhead_ms"][b]
        print(f"  vs {words}: {over:.2f} ms {verdict[result['goal_met'][b]]}")
    print(f"TPOT ratio disaggregated / local: {result['tpot_ratio_disagg_to_local']:.3f}")
    gw = result["gateway_over_direct_grpc_ms"]
    ttft, tpot = gw["ttft_ms"], gw["tpot_ms"]
    print(
        "gateway over pdx's two gRPC calls made directly (per-round median, 90 % interval): "
        f"TTFT {_interval(ttft, '{:+.2f}')} ms, "
        f"TPOT {_interval(tpot, '{:+.3f}')} ms"
    )
    print(
        "  of it: the bare forwarder (aiohttp + grpc.aio, nothing else) over direct TTFT "
        f"{_interval(result['bare_forwarder_over_direct_grpc_ms'], '{:+.2f}')} ms (the stack), "
        f"the gateway over the bare forwarder "
        f"{_interval(result['gateway_over_bare_forwarder_ms'], '{:+.2f}')} ms (pdx's own code)"
    )
    goal, p99 = result["gateway_goal"], result["ttft_p99_ms"]
    print(
        f"  goal median <= {GATEWAY_GOAL_MS:g} ms: {goal['median']} (by its interval); "
        f"TTFT p99 {p99['disaggregated']['p99']:.2f} ms through the gateway, "
        f"{p99['direct_grpc']['p99']:.2f} direct: difference "
        f"{_interval(result['gateway_over_direct_grpc_p99_ms'], '{:+.2f}')} ms, "
        f"goal <= {GATEWAY_P99_GOAL_MS:g}: {goal['p99']}"
        + (
            " (a p99's upper bound needs 299 rounds)"
            if p99["disaggregated"]["high"] is None
            else ""
        )
    )


STREAM_GOAL_RTTS = 3
STREAM_MODES = ("whole", "streamed")
CONFIDENCE = 0.95  # each bound one-sided at this level: together a 90 % interval


async def streamed_kv(
    args: argparse.Namespace, prompt: list[int], audit_root: Path
) -> dict[str, list[dict[str, Any]]]:
    """The disaggregated path with kv.streaming off and on, each on its own deployment
    (running at once, requests interleaved, order alternated), the KV link through a
    rate-capped, delayed proxy; each prefill store's audit under ``audit_root/<mode>``."""
    from pdx.faults.toxics import Bandwidth, Latency
    from pdx.serving.deploy_config import load_deploy_config
    from pdx.serving.engines.http1 import HTTP1Client
    from pdx.serving.supervisor import Deployment

    sets = ["gateway.port=0", "model.backend=synthetic", f"model.preset={args.preset}",
            f"model.synthetic_compute={args.compute}",
            f"kv.via_proxy={not args.no_proxy}", "kv.kv_transfer_timeout_ms=60000",
            f"kv.codec={args.codec}",
            f"kv.chunk_size_kb={args.chunk_kb}",
            "decode.kv_budget_bytes=8589934592", "kv.store_budget_bytes=8589934592",
            "router.local_prefill_max_tokens=1", "router.breaker_min_samples=1000",
            "gateway.request_timeout_s=300"]  # fmt: skip
    if args.no_tls:
        sets.append("tls.enabled=false")
    deps: dict[str, Deployment] = {}
    for mode in STREAM_MODES:
        (audit_root / mode).mkdir(parents=True, exist_ok=True)
        mode_sets = [f"kv.streaming={mode == 'streamed'}", f"kv.audit_dir={audit_root / mode}"]
        deps[mode] = Deployment(load_deploy_config(dotted=[*sets, *mode_sets]))
    out: dict[str, list[dict[str, Any]]] = {mode: [] for mode in deps}
    http = HTTP1Client()
    try:
        for dep in deps.values():
            await dep.start()
            for proxy in dep.proxies:  # half the RTT each way, the rate cap each way (if any)
                proxy.add_toxic(Latency(name="rtt", latency_ms=args.rtt_ms / 2))
                proxy.add_toxic(Bandwidth(name="rate", rate_mbps=args.rate_mbps))
        body = json.dumps(_body(prompt, args, "disaggregated")).encode()
        for i in range(1 + args.requests):  # 1 warm-up: connections, TLS, the KV bytes
            # Order alternated: neither mode always runs right after the other.
            for mode in STREAM_MODES if i % 2 == 0 else STREAM_MODES[::-1]:
                url = deps[mode].endpoints().gateway + "/v1/completions"
                result = await one_request(http, url, body, timeout_s=600)
                result["arrival_to_second_token_ms"] = (
                    result["ttft_ms"] + result["second_token_gap_ms"]
                )
                if i >= 1:
                    out[mode].append(result)
    finally:
        await http.close()
        for dep in deps.values():
            await dep.stop()
    return out


def prefill_writers(audit_root: Path, event: str = "put") -> dict[str, dict[str, int]]:
    """Per mode, the successful Puts (or Gets) of prefill's store by the transport that moved
    them (``local``: in-process, ``grpc``/``data``: through the KV client), from its audit."""
    from pdx.transfer.audit import read_audit

    out: dict[str, dict[str, int]] = {}
    for mode in STREAM_MODES:
        counts: dict[str, int] = {}
        for path in sorted((audit_root / mode).glob("kv-store-prefill-*.jsonl")):
            for rec in read_audit(path):
                if rec.get("event") == event and rec.get("outcome") == "ok":
                    transport = str(rec.get("transport") or "grpc")
                    counts[transport] = counts.get(transport, 0) + 1
        out[mode] = counts
    return out


def median_bounds(values: list[float]) -> dict[str, float | None]:
    """The median and its distribution-free bounds (order statistics, each one-sided at
    ``CONFIDENCE``)."""
    from pdx.accept.judge.confidence import quantile_bounds

    b = quantile_bounds(values, 0.5, CONFIDENCE)
    return {"median": round(median(values), 3),
            "low": None if b.low is None else round(b.low, 3),
            "high": None if b.high is None else round(b.high, 3)}  # fmt: skip


def judge(bounds: dict[str, float | None], goal_ms: float) -> str:
    """MET, MISSED or UNDECIDED: the goal judged from the interval (see goal_verdict)."""
    from pdx.accept.judge.confidence import goal_verdict

    return goal_verdict(bounds["low"], bounds["high"], goal_ms)


def summarize_streamed(
    runs: dict[str, list[dict[str, Any]]], rtt_ms: float, writers: dict[str, dict[str, int]]
) -> dict[str, Any]:
    """Medians per mode, the arrival→second token medians with their bounds, the paired
    streamed/whole ratio, the goal's verdict and the hidden fraction."""

    def m(rs: list[dict[str, Any]], fn: Callable[[dict[str, Any]], float]) -> float:
        return round(median([fn(r) for r in rs]), 3)

    modes: dict[str, dict[str, Any]] = {}
    for mode, rs in runs.items():
        assert all(not r["pdx"]["degraded"] for r in rs), f"a {mode} request degraded"
        assert all(bool(r["pdx"]["kv_streamed"]) == (mode == "streamed") for r in rs), mode
        modes[mode] = {
            "arrival_to_second_token_ms": median_bounds(
                [r["arrival_to_second_token_ms"] for r in rs]
            ),
            "ttft_ms": m(rs, lambda r: r["ttft_ms"]),
            "second_token_gap_ms": m(rs, lambda r: r["second_token_gap_ms"]),
            "prefill_ms": m(rs, lambda r: _timing(r, "prefill")),
            "kv_store_ms": m(rs, lambda r: _timing(r, "kv_store")),
            "transfer_ms": m(rs, lambda r: float(r["pdx"]["transfer_ms"])),
            "decode_rebuild_ms": m(  # KV ready on decode, less the Get
                rs, lambda r: _timing(r, "decode_kv_ready") - float(r["pdx"]["transfer_ms"])
            ),
            "first_decode_step_ms": m(rs, lambda r: _timing(r, "first_decode_step")),
            "kv_bytes": m(rs, lambda r: float(r["pdx"]["kv_bytes"])),
        }
        if mode == "streamed":
            modes[mode]["pdx_transfer_hidden_fraction"] = m(
                rs, lambda r: float(r["pdx"]["transfer_hidden_fraction"])
            )
            modes[mode]["kv_put_overlap_ms"] = m(rs, lambda r: float(r["pdx"]["kv_put_overlap_ms"]))
            modes[mode]["kv_put_overlap_bytes"] = m(
                rs, lambda r: float(r["pdx"]["kv_put_overlap_bytes"])
            )
    whole, streamed = modes["whole"], modes["streamed"]
    prefill, transfer = streamed["prefill_ms"], whole["transfer_ms"]
    step = streamed["first_decode_step_ms"]
    goal = max(prefill, transfer) + step + STREAM_GOAL_RTTS * rtt_ms
    arrival = streamed["arrival_to_second_token_ms"]
    # What of the transfer the user still waits for after prefill, against all of it.
    exposed = arrival["median"] - prefill - step
    hidden = min(1.0, max(0.0, 1.0 - exposed / transfer)) if transfer > 0 else 0.0
    gap = whole["arrival_to_second_token_ms"]["median"] - arrival["median"]
    parts = {
        "transfer_hidden_ms": hidden * transfer,
        "whole_store_ms": whole["kv_store_ms"] - streamed["kv_store_ms"],
        "whole_rebuild_ms": whole["decode_rebuild_ms"] - streamed["decode_rebuild_ms"],
    }
    parts["rest_ms"] = gap - sum(parts.values())
    ratios = [  # request i of each mode ran in the same round: a paired ratio
        s["arrival_to_second_token_ms"] / w["arrival_to_second_token_ms"]
        for w, s in zip(runs["whole"], runs["streamed"], strict=True)
    ]
    return {
        "modes": modes,
        "prefill_ms": prefill,
        "transfer_ms": transfer,
        "decode_step_ms": step,
        "goal_ms": round(goal, 3),
        "goal": judge(arrival, goal),
        "streamed_to_whole_ratio": median_bounds(ratios),
        "whole_object_sum_ms": round(prefill + transfer + step, 3),
        "hidden_fraction": round(hidden, 4),
        "gap_ms": round(gap, 3),
        "gap_parts_ms": {k: round(v, 3) for k, v in parts.items()},
        "prefill_writers": writers,
        "same_writer": all(writers.values())
        and len({tuple(sorted(w)) for w in writers.values()}) == 1,
        "samples_arrival_to_second_token_ms": {
            mode: [round(r["arrival_to_second_token_ms"], 3) for r in rs]
            for mode, rs in runs.items()
        },
    }


def _interval(b: dict[str, float | None], fmt: str = "{:.1f}") -> str:
    def side(v: float | None) -> str:
        return "-" if v is None else fmt.format(v)

    return f"{fmt.format(b['median'])} [{side(b['low'])}, {side(b['high'])}]"


def render_streamed(result: dict[str, Any]) -> None:
    """Print the streamed-KV result for a terminal."""
    for mode, v in result["modes"].items():
        print(f"{mode:>9}: arrival→second token {_interval(v['arrival_to_second_token_ms'])} ms"
              f"   TTFT {v['ttft_ms']:7.1f}   prefill {v['prefill_ms']:7.1f}   store "
              f"{v['kv_store_ms']:6.1f}   transfer {v['transfer_ms']:7.1f}   rebuild "
              f"{v['decode_rebuild_ms']:6.1f}   first step {v['first_decode_step_ms']:5.1f} ms "
              f"(medians)")  # fmt: skip
    ratio = _interval(result["streamed_to_whole_ratio"], "{:.3f}")
    print(f"streamed / whole, paired by round: {ratio}")
    writers = ", ".join(
        f"{mode} " + " ".join(f"{t}×{n}" for t, n in sorted(w.items()))
        for mode, w in result["prefill_writers"].items()
    )
    same = "same writer" if result["same_writer"] else "DIFFERENT writers"
    print(f"prefill's store Puts by transport: {writers} ({same}); synthetic compute "
          f"{result['compute']}")  # fmt: skip
    gets = ", ".join(
        f"{mode} " + " ".join(f"{t}×{n}" for t, n in sorted(w.items()))
        for mode, w in result["gets_by_transport"].items()
    )
    link = "through the proxy" if result["proxy"] else "straight to the store (no proxy)"
    print(f"decode's Gets by transport: {gets}; the KV link {link}")
    shaped = (f"RTT {result['rtt_ms']:g} ms, rate cap {result['rate_mbps']:g} Mbit/s"
              if result["proxy"] else "loopback (no added RTT, no rate cap)")  # fmt: skip
    print(f"KV per request {int(result['modes']['whole']['kv_bytes'])} B, {shaped}, "
          f"codec {result['codec']}, TLS {result['tls']}, {result['requests']} requests per "
          f"mode, {result['cpus']} CPUs, load average {result['load_before']:.2f} before, "
          f"{result['load_after']:.2f} after")  # fmt: skip
    print(f"goal: arrival→second token <= max(prefill {result['prefill_ms']:.1f}, transfer "
          f"{result['transfer_ms']:.1f}) + step {result['decode_step_ms']:.1f} + "
          f"{STREAM_GOAL_RTTS} RTT = {result['goal_ms']:.1f} ms: streamed median "
          f"{_interval(result['modes']['streamed']['arrival_to_second_token_ms'])} ms "
          f"{result['goal']} (prefill + transfer + step = "
          f"{result['whole_object_sum_ms']:.1f} ms)")  # fmt: skip
    print(
        f"transfer hidden behind prefill: {100 * result['hidden_fraction']:.1f} % "
        f"(pdx object's median: "
        f"{100 * result['modes']['streamed']['pdx_transfer_hidden_fraction']:.1f} %)"
    )
    parts = result["gap_parts_ms"]
    print(f"whole − streamed {result['gap_ms']:.1f} ms = transfer hidden "
          f"{parts['transfer_hidden_ms']:.1f} + whole-object store (encode + write) "
          f"{parts['whole_store_ms']:.1f} + whole-object rebuild on decode "
          f"{parts['whole_rebuild_ms']:.1f} + rest {parts['rest_ms']:.1f} (medians)")  # fmt: skip


def run_streamed_kv(args: argparse.Namespace) -> None:
    """``--streamed-kv``: run both modes, then print the result."""
    if "--prompt-tokens" not in sys.argv:
        args.prompt_tokens = 3072
    if "--requests" not in sys.argv:
        args.requests = 30
    if "--max-tokens" not in sys.argv:
        args.max_tokens = 4
    if args.no_proxy:  # loopback as it is: no added RTT, no rate cap
        args.rtt_ms, args.rate_mbps = 0.0, 0.0
    prompt = [4 + (i * 37) % 250 for i in range(args.prompt_tokens)]
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-streamed-kv-") as tmp:
        runs = asyncio.run(streamed_kv(args, prompt, Path(tmp)))
        writers = prefill_writers(Path(tmp))
        readers = prefill_writers(Path(tmp), "get")
    result = {"proxy": not args.no_proxy, "gets_by_transport": readers,
              "prompt_tokens": args.prompt_tokens, "requests": args.requests,
              "codec": args.codec, "tls": not args.no_tls, "rtt_ms": args.rtt_ms,
              "rate_mbps": args.rate_mbps, "preset": args.preset, "chunk_kb": args.chunk_kb,
              "compute": args.compute, "cpus": os.cpu_count(), "load_before": load_before,
              "load_after": os.getloadavg()[0],
              **summarize_streamed(runs, args.rtt_ms, writers)}  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        render_streamed(result)


def main() -> None:
    """Run the four paths and print medians, the breakdowns and the goal check."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--requests", type=int, default=15)
    p.add_argument("--codec", default="raw")
    p.add_argument("--no-tls", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--serve-colocated", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--serve-deployment", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--streamed-kv", action="store_true", help="measure kv.streaming (see above)")
    p.add_argument("--preset", default="llama-3.1-8b", help="--streamed-kv: synthetic model")
    p.add_argument("--rtt-ms", type=float, default=10.0, help="--streamed-kv: KV link RTT")
    p.add_argument("--rate-mbps", type=float, default=1000.0, help="--streamed-kv: rate cap")
    p.add_argument("--no-proxy", action="store_true",
                   help="--streamed-kv: KV straight to the store, no proxy, no RTT or rate "
                   "cap: a whole object then travels on the data plane (kv.transport auto), "
                   "a streamed one on gRPC, as a deployment's default has them")  # fmt: skip
    p.add_argument("--chunk-kb", type=int, default=1024, help="--streamed-kv: kv.chunk_size_kb")
    p.add_argument("--compute", choices=("spin", "sleep"), default="spin",
                   help="--streamed-kv: model.synthetic_compute")  # fmt: skip
    args = p.parse_args()
    if args.serve_colocated:
        asyncio.run(serve_colocated())
        return
    if args.serve_deployment:
        asyncio.run(serve_deployment(args.set))
        return
    if args.streamed_kv:
        run_streamed_kv(args)
        return
    prompt = [4 + (i * 37) % 256 for i in range(args.prompt_tokens)]
    runs = asyncio.run(served(args, prompt))
    result = {"prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
              "requests": args.requests, "codec": args.codec, "tls": not args.no_tls,
              **summarize(runs)}  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        render(result)


if __name__ == "__main__":
    main()
