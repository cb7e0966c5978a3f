"""Gateway micro-benchmark: pdx's engine gateway and vllm-router in front of an instant backend.

This measures the fronts, not a model: both sit in front of the same two "instant" vLLM
stand-ins (:mod:`instant_engine`, one prefill and one decode process, each answering at once:
prefill's JSON with NIXL ``kv_transfer_params``, decode's SSE stream of ``--max-tokens``
tokens with no delay), so whatever time and CPU a front adds is its own. Fronts:

- ``direct``: the client runs vLLM's two-step P/D protocol itself against the two instances
  (prefill with ``do_remote_decode``, then decode with prefill's ``kv_transfer_params``): the
  floor, no front;
- ``pdx``: pdx's engine gateway (``engine: vllm``, ``build_engine_gateway``), in a process of
  its own (this script re-run with ``--serve-pdx``), ``pdx_route: disaggregated``;
- ``vllm-router``: ``vllm-router --vllm-pd-disaggregation --kv-connector nixl`` (from
  .venv-vllm, ``make vllm``), as benchmarks/bench_router.py runs it; left out, with the
  reason, when it is not installed or does not start.

Fairness: the same backend processes, the same client code (one aiohttp client in this
process), the same prompts (token-id lists, ``--prompt-tokens`` long, one fresh prompt per
round shared by every front), every request streamed with ``return_token_ids`` and usage.
vllm-router passes the backend's events through; pdx renders each token's text with its own
tokenizer (``--tokenizer``: by default the byte-level one ``pdx deploy`` loads for its tiny
engine models), as it does in front of vLLM. Phases:

1. overhead at 1 user: ``--requests`` rounds, one request per front per round, the fronts
   interleaved request by request and their order reversed every round; TTFT and E2E
   medians and p99; overhead = front median - direct median;
2. throughput: for each of ``--users`` closed-loop users, ``--load-s`` seconds per front,
   the order of the fronts reversed at each user count; req/s, E2E p50/p99, and CPU
   seconds per 1,000 requests of the front's process tree (utime+stime from /proc) and of
   the two backend processes.

Every request must end with ``[DONE]`` and exactly ``--max-tokens`` tokens to count as ok;
the backends' counters check that each front ran both steps (prefills = decodes given KV).
The client, the backends and the fronts share this machine's cores: req/s is bounded by
them all, while CPU per 1,000 requests is each front's own.

    .venv/bin/python benchmarks/bench_gateway.py [--requests 200] [--users 16 64]
        [--load-s 10] [--prompt-tokens 300] [--max-tokens 16] [--tokenizer hf-byte|byte]
        [--vllm-router PATH] [--json]

CPU comes in clock ticks (10 ms): the 1-user figure is coarse below a few hundred requests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VLLM_ROUTER = ROOT / ".venv-vllm" / "bin" / "vllm-router"
MODEL = "instant"
WARMUP_ROUNDS = 3  # latency rounds not counted (connections opened, code paths warmed)
MAX_RUN_REQUESTS = 200_000  # a closed-loop run stops here even before --load-s
START_TIMEOUT_S = 60.0
TICK = os.sysconf("SC_CLK_TCK")
TOKEN_IDS = re.compile(rb'"token_ids":\s*\[([^\]]*)\]')

# pdx's config for the gateway: prompts of 300 tokens go disaggregated, the breaker stays
# closed, and decode's admission limit is above every user count measured.
PDX_SETTINGS = ["engine=vllm", "gateway.port=0", "router.local_prefill_max_tokens=8",
                "router.degrade_p99_ms=1000", "decode.max_batch=1024",
                "decode.max_queue=1024"]  # fmt: skip


# --- processes ------------------------------------------------------------------------------


@dataclass
class Child:
    """A started process and the port it listens on."""

    name: str
    proc: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        """Its base URL."""
        return f"http://127.0.0.1:{self.port}"


def spawn(name: str, argv: list[str], log: Path) -> Child:
    """Start ``argv`` (own process group) and wait for its ``PORT <n>`` line on stdout."""
    with log.open("ab") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, start_new_session=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    line = b""
    while time.monotonic() < deadline and not line.endswith(b"\n"):
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 256)
            if not chunk:
                break
            line += chunk
        elif proc.poll() is not None:
            break
    if not line.startswith(b"PORT "):
        stop(proc)
        raise RuntimeError(f"{name} did not start (exit {proc.poll()}); see {log}")
    return Child(name, proc, int(line.split()[1]))


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM its process group, SIGKILL after 10 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _stat(pid: int) -> tuple[int, int] | None:
    """(ppid, utime+stime ticks) of one process, None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[1]), int(fields[11]) + int(fields[12])


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) of ``pid`` and its descendants."""
    procs = {int(p): st for p in os.listdir("/proc") if p.isdigit() and (st := _stat(int(p)))}
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        if p in procs:
            total += procs[p][1]
            todo += [c for c, (ppid, _) in procs.items() if ppid == p]
    return total / TICK


def free_port() -> int:
    """A port free now on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_vllm_router(exe: Path, prefill: str, decode: str, log: Path) -> Child:
    """vllm-router in P/D mode over the instances, as bench_router.py runs it."""
    if not exe.is_file():
        raise RuntimeError(f"{exe} is not installed (make vllm)")
    port = free_port()
    argv = [str(exe), "--host", "127.0.0.1", "--port", str(port),
            "--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode,
            "--kv-connector", "nixl", "--policy", "round_robin",
            "--log-level", "warning"]  # fmt: skip
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=out, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), urllib.request.urlopen(url + "/health", timeout=2) as r:
            if r.status == 200:
                return Child("vllm-router", proc, port)
        if proc.poll() is not None:
            raise RuntimeError(f"vllm-router exited with {proc.returncode}; see {log}")
        time.sleep(0.3)
    stop(proc)
    raise RuntimeError(f"vllm-router did not answer /health in {START_TIMEOUT_S:g} s; see {log}")


# --- the pdx front (child process) ----------------------------------------------------------


def _tokenizer(kind: str) -> Any:
    """hf-byte: the byte-level HF tokenizer pdx exports with its tiny engine models (what
    ``pdx deploy`` loads by default); byte: pdx's ByteTokenizer (same ids, pure Python)."""
    from pdx.serving.backends.tokenizer import ByteTokenizer, HFTokenizer

    if kind == "byte":
        return ByteTokenizer()
    from pdx.serving.engines.checkpoint import byte_level_tokenizer

    return HFTokenizer(byte_level_tokenizer())


async def serve_pdx(prefill: str, decode: str, tokenizer: str, profile: str = "") -> None:
    """pdx's engine gateway over the two instances; prints ``PORT <n>``, runs until SIGTERM.

    ``profile``: run under cProfile and write its stats there on SIGTERM (``--profile``)."""
    from pdx.serving.deploy_config import load_deploy_config
    from pdx.serving.gateway.engine_app import build_engine_gateway

    cfg = load_deploy_config(dotted=PDX_SETTINGS)
    gw = build_engine_gateway(
        cfg, [("prefill-0", prefill)], [("decode-0", decode)], tokenizer=_tokenizer(tokenizer),
        max_context_tokens=4096, model_name=MODEL, served_model=MODEL,
        kv_bytes_for=lambda tokens: tokens * 4096, vocab_size=260,
    )  # fmt: skip
    port = await gw.start("127.0.0.1", 0)
    print(f"PORT {port}", flush=True)
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    await done.wait()
    if prof is not None:
        prof.disable()
        prof.dump_stats(profile)
    await gw.stop()


# --- the client -----------------------------------------------------------------------------


def _tokens_in(line: bytes) -> int:
    """Generated token ids in one SSE line (``prompt_token_ids`` are not counted)."""
    m = TOKEN_IDS.search(line)
    if m is None:
        return 0
    inner = m.group(1).strip()
    return inner.count(b",") + 1 if inner else 0


async def stream(
    s: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout_s: float
) -> dict[str, Any]:
    """One streamed completion: ok, TTFT, E2E (to ``[DONE]``, client clock), tokens."""
    t0 = time.perf_counter()
    ttft, tokens, error, done, e2e = None, 0, None, False, 0.0
    try:
        async with asyncio.timeout(timeout_s), s.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                text = (await r.text())[:120]
                return {"ok": False, "error": f"HTTP {r.status}: {text}",
                        "e2e_s": time.perf_counter() - t0}  # fmt: skip
            # Read to the end after [DONE]: a response left unread closes its connection.
            async for line in r.content:
                if not line.startswith(b"data: ") or done:
                    continue
                if line.startswith(b"data: [DONE]"):
                    done, e2e = True, time.perf_counter() - t0
                elif n := _tokens_in(line):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    tokens += n
                elif b'"error"' in line and b'"choices"' not in line:
                    error = line[6:126].decode(errors="replace")
    except TimeoutError:
        return {"ok": False, "error": "timeout", "e2e_s": time.perf_counter() - t0}
    except aiohttp.ClientError as exc:
        return {"ok": False, "error": type(exc).__name__, "e2e_s": time.perf_counter() - t0}
    e2e = e2e or time.perf_counter() - t0
    ok = error is None and done and tokens == body["max_tokens"]
    if error is None and not ok:
        error = f"{tokens} tokens, [DONE] {'seen' if done else 'missing'}"
    return {"ok": ok, "error": error, "ttft_s": ttft, "e2e_s": e2e, "tokens": tokens}


async def two_step(
    s: aiohttp.ClientSession, prefill: str, decode: str, body: dict[str, Any], timeout_s: float
) -> dict[str, Any]:
    """The two-step protocol run by the client itself (no front)."""
    t0 = time.perf_counter()
    first = {k: v for k, v in body.items() if k != "stream_options"}
    first |= {"max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    try:
        async with asyncio.timeout(timeout_s), s.post(prefill + "/v1/completions", json=first) as r:
            params = (await r.json()).get("kv_transfer_params") if r.status == 200 else None
    except (TimeoutError, aiohttp.ClientError) as exc:
        return {"ok": False, "error": f"prefill: {type(exc).__name__}", "e2e_s": 0.0}
    if not params:
        return {"ok": False, "error": "prefill gave no kv_transfer_params", "e2e_s": 0.0}
    prefill_s = time.perf_counter() - t0
    out = await stream(s, decode, {**body, "kv_transfer_params": params}, timeout_s)
    out["e2e_s"] += prefill_s  # both clocks start at the prefill request
    if out.get("ttft_s") is not None:
        out["ttft_s"] += prefill_s
    return out


Call = Callable[[aiohttp.ClientSession, dict[str, Any]], Awaitable[dict[str, Any]]]


def calls(fronts: dict[str, str], prefill: str, decode: str, timeout_s: float) -> dict[str, Call]:
    """One request through each front, by name."""

    async def direct(s: aiohttp.ClientSession, body: dict[str, Any]) -> dict[str, Any]:
        return await two_step(s, prefill, decode, body, timeout_s)

    def via(url: str, extra: dict[str, Any]) -> Call:
        async def call(s: aiohttp.ClientSession, body: dict[str, Any]) -> dict[str, Any]:
            return await stream(s, url, {**body, **extra}, timeout_s)

        return call

    out: dict[str, Call] = {"direct": direct}
    for name, url in fronts.items():
        out[name] = via(url, {"pdx_route": "disaggregated"} if name == "pdx" else {})
    return out


class Prompts:
    """Request bodies with fresh random token-id prompts (byte-level ids 4..259)."""

    def __init__(self, args: argparse.Namespace, seed: int) -> None:
        self.rng = random.Random(seed)
        self.args = args

    def body(self) -> dict[str, Any]:
        """The next body."""
        a = self.args
        ids = [self.rng.randint(4, 259) for _ in range(a.prompt_tokens)]
        return {"model": MODEL, "prompt": ids, "max_tokens": a.max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip


# --- measurements ---------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, int(q / 100 * len(ordered) + 0.5) - 1))]


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1e3, 3)


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts, TTFT and E2E p50/p99 (ms) of some results."""
    ok = [r for r in rows if r["ok"]]
    ttft = [r["ttft_s"] for r in ok]
    e2e = [r["e2e_s"] for r in ok]
    errors: dict[str, int] = {}
    for r in rows:
        if not r["ok"]:
            errors[str(r["error"])] = errors.get(str(r["error"]), 0) + 1
    return {"n": len(rows), "failed": len(rows) - len(ok), "errors": errors,
            "ttft_p50_ms": _ms(statistics.median(ttft) if ttft else None),
            "ttft_p99_ms": _ms(pct(ttft, 99)),
            "e2e_p50_ms": _ms(statistics.median(e2e) if e2e else None),
            "e2e_p99_ms": _ms(pct(e2e, 99))}  # fmt: skip


class Backends:
    """The two instant instances: their counters and CPU."""

    def __init__(self, prefill: Child, decode: Child) -> None:
        self.prefill, self.decode = prefill, decode

    async def counters(self, s: aiohttp.ClientSession) -> dict[str, int]:
        """Prefills, decodes given KV, decodes without, other requests (both instances)."""
        out: dict[str, int] = {}
        for c in (self.prefill, self.decode):
            async with s.get(c.url + "/stats") as r:
                for k, v in (await r.json()).items():
                    out[k] = out.get(k, 0) + int(v)
        return out

    def cpu_s(self) -> float:
        """CPU seconds of both processes."""
        return tree_cpu_s(self.prefill.proc.pid) + tree_cpu_s(self.decode.proc.pid)


def pd_check(before: dict[str, int], after: dict[str, int], ok: int) -> dict[str, Any]:
    """What the backends saw between two counter reads; pd_ok: both steps for every request."""
    d = {k: after[k] - before.get(k, 0) for k in after}
    d["pd_ok"] = d["prefill"] >= ok and d["decode_kv"] >= ok and d["decode_plain"] == 0
    return d


async def latency(
    run: dict[str, Call], pids: dict[str, int], backends: Backends, args: argparse.Namespace
) -> dict[str, Any]:
    """One request at a time, fronts interleaved request by request, order reversed by round."""
    names = list(run)
    rows: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    prompts = Prompts(args, 2026)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as s:
        cpu0: dict[str, float] = {}
        base: dict[str, int] = {}
        for rnd in range(WARMUP_ROUNDS + args.requests):
            if rnd == WARMUP_ROUNDS:
                cpu0 = {n: tree_cpu_s(p) for n, p in pids.items()}
                base = await backends.counters(s)
            body = prompts.body()
            for name in names if rnd % 2 == 0 else names[::-1]:
                r = await run[name](s, body)
                if rnd >= WARMUP_ROUNDS:
                    rows[name].append(r)
        cpu1 = {n: tree_cpu_s(p) for n, p in pids.items()}
        check = pd_check(base, await backends.counters(s),
                         sum(r["ok"] for rs in rows.values() for r in rs))  # fmt: skip
    out: dict[str, Any] = {}
    for name in names:
        out[name] = summary(rows[name])
        if name in pids:
            out[name]["cpu_ms_per_req"] = round((cpu1[name] - cpu0[name]) / args.requests * 1e3, 3)
    d = out["direct"]
    for name in names[1:]:
        for key in ("ttft", "e2e"):
            front, floor = out[name][f"{key}_p50_ms"], d[f"{key}_p50_ms"]
            ok = front is not None and floor is not None
            out[name][f"{key}_overhead_ms"] = round(front - floor, 3) if ok else None
    out["backends"] = check
    return out


async def closed_loop(
    call: Call, users: int, seconds: float, args: argparse.Namespace, seed: int
) -> tuple[list[dict[str, Any]], float]:
    """``users`` clients back to back for ``seconds`` (at most MAX_RUN_REQUESTS); wall time."""
    rows: list[dict[str, Any]] = []
    prompts = Prompts(args, seed)
    t0 = time.monotonic()
    deadline = t0 + seconds

    async def user() -> None:
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < deadline and len(rows) < MAX_RUN_REQUESTS:
                rows.append(await call(s, prompts.body()))

    await asyncio.gather(*(user() for _ in range(users)))
    return rows, time.monotonic() - t0


async def throughput(
    run: dict[str, Call], pids: dict[str, int], backends: Backends, args: argparse.Namespace
) -> dict[str, Any]:
    """Each user count, each front in turn (order reversed at each count)."""
    names = list(run)
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession() as stats:
        for k, users in enumerate(args.users):
            table: dict[str, Any] = {}
            for name in names if k % 2 == 0 else names[::-1]:
                await asyncio.sleep(0.5)  # the previous run's connections close
                before = await backends.counters(stats)
                cpu0 = tree_cpu_s(pids[name]) if name in pids else 0.0
                bcpu0 = backends.cpu_s()
                rows, wall = await closed_loop(run[name], users, args.load_s, args, 7 + k)
                cpu = tree_cpu_s(pids[name]) - cpu0 if name in pids else None
                bcpu = backends.cpu_s() - bcpu0
                ok = sum(r["ok"] for r in rows)
                sm = summary(rows)
                table[name] = {
                    "requests": len(rows), "failed": sm["failed"], "errors": sm["errors"],
                    "req_per_s": round(ok / wall, 1),
                    "e2e_p50_ms": sm["e2e_p50_ms"], "e2e_p99_ms": sm["e2e_p99_ms"],
                    "front_cpu_s_per_1k": round(cpu / ok * 1e3, 3) if cpu is not None and ok
                    else None,
                    "front_cpu_util": round(cpu / wall, 2) if cpu is not None else None,
                    "backend_cpu_s_per_1k": round(bcpu / ok * 1e3, 3) if ok else None,
                    "backends": pd_check(before, await backends.counters(stats), ok),
                }  # fmt: skip
            out[str(users)] = {n: table[n] for n in names}
    return out


def ratios(report: dict[str, Any]) -> dict[str, Any]:
    """pdx against vllm-router, from the numbers above."""
    lat, tp = report["latency"], report["throughput"]
    if "vllm-router" not in lat:
        return {}

    def div(a: float | None, b: float | None) -> float | None:
        return round(a / b, 2) if a is not None and b else None

    def sub(a: float | None, b: float | None) -> float | None:
        return round(a - b, 3) if a is not None and b is not None else None

    p, v = lat["pdx"], lat["vllm-router"]
    out: dict[str, Any] = {
        "1_user": {
            "ttft_overhead_ms": {"pdx": p["ttft_overhead_ms"], "vllm-router": v["ttft_overhead_ms"],
                                 "pdx_minus_vllm_router": sub(p["ttft_overhead_ms"],
                                                              v["ttft_overhead_ms"])},
            "e2e_overhead_ms": {"pdx": p["e2e_overhead_ms"], "vllm-router": v["e2e_overhead_ms"],
                                "pdx_minus_vllm_router": sub(p["e2e_overhead_ms"],
                                                             v["e2e_overhead_ms"])},
            "cpu_per_req_pdx_over_vllm_router": div(p.get("cpu_ms_per_req"),
                                                    v.get("cpu_ms_per_req")),
        }
    }  # fmt: skip
    for users, table in tp.items():
        p, v = table["pdx"], table["vllm-router"]
        out[f"{users}_users"] = {
            "cpu_per_1k_pdx_over_vllm_router": div(p["front_cpu_s_per_1k"],
                                                   v["front_cpu_s_per_1k"]),
            "req_per_s_pdx_over_vllm_router": div(p["req_per_s"], v["req_per_s"]),
            "e2e_p50_ms_pdx_minus_vllm_router": sub(p["e2e_p50_ms"], v["e2e_p50_ms"]),
        }  # fmt: skip
    return out


# --- output ---------------------------------------------------------------------------------


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def _table(head: list[str], rows: list[list[Any]]) -> str:
    cells = [head, *[[_cell(v) for v in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells)


def render(report: dict[str, Any]) -> str:
    """The report as text tables."""
    a, lat = report["setup"], report["latency"]
    lines = [
        "gateway micro-benchmark (instant backend, not a model): "
        f"{a['prompt_tokens']}-token prompts, {a['max_tokens']} tokens streamed, "
        f"pdx tokenizer {a['tokenizer']}, {a['cpus']} CPUs"
    ]
    if report.get("vllm_router_absent"):
        lines += [f"  vllm-router absent: {report['vllm_router_absent']}"]
    names = [n for n in lat if n != "backends"]
    lines += ["", f"1 user, {a['requests']} requests per front, interleaved (ms)"]
    lines += [_table(
        ["front", "n", "fail", "TTFT p50", "TTFT p99", "E2E p50", "E2E p99", "+TTFT", "+E2E",
         "CPU ms/req"],
        [[n, lat[n]["n"], lat[n]["failed"], lat[n]["ttft_p50_ms"], lat[n]["ttft_p99_ms"],
          lat[n]["e2e_p50_ms"], lat[n]["e2e_p99_ms"], lat[n].get("ttft_overhead_ms"),
          lat[n].get("e2e_overhead_ms"), lat[n].get("cpu_ms_per_req")] for n in names],
    )]  # fmt: skip
    lines += [f"backends: {_counts(lat['backends'])}"]
    lines += ["", f"closed loop, {a['load_s']:g} s per front (E2E ms, CPU s per 1,000 requests)"]
    rows = []
    for users, table in report["throughput"].items():
        for n, r in table.items():
            rows.append([users, n, r["requests"], r["failed"], r["req_per_s"], r["e2e_p50_ms"],
                         r["e2e_p99_ms"], r["front_cpu_s_per_1k"], r["front_cpu_util"],
                         r["backend_cpu_s_per_1k"], r["backends"]["pd_ok"]])  # fmt: skip
    head = ["users", "front", "req", "fail", "req/s", "E2E p50", "E2E p99", "front CPU/1k",
            "front CPU util", "backend CPU/1k", "P/D ok"]  # fmt: skip
    lines += [_table(head, rows)]
    errors = {f"{u} users {n}": r["errors"] for u, t in report["throughput"].items()
              for n, r in t.items() if r["errors"]}  # fmt: skip
    errors |= {f"1 user {n}": lat[n]["errors"] for n in names if lat[n]["errors"]}
    for where, errs in errors.items():
        lines += [f"errors, {where}: {errs}"]
    if report.get("ratios"):
        lines += ["", "pdx vs vllm-router"]
        r1 = report["ratios"]["1_user"]
        for key in ("ttft_overhead_ms", "e2e_overhead_ms"):
            o = r1[key]
            lines += [
                f"  1 user {key}: pdx {_cell(o['pdx'])}, vllm-router {_cell(o['vllm-router'])}, "
                f"difference {_cell(o['pdx_minus_vllm_router'])}"
            ]
        lines += [f"  1 user CPU per request, pdx / vllm-router: "
                  f"{_cell(r1['cpu_per_req_pdx_over_vllm_router'])}"]  # fmt: skip
        for key, r in report["ratios"].items():
            if key != "1_user":
                lines += [
                    f"  {key.replace('_', ' ')}: CPU per 1k pdx / vllm-router "
                    f"{_cell(r['cpu_per_1k_pdx_over_vllm_router'])}, req/s pdx / vllm-router "
                    f"{_cell(r['req_per_s_pdx_over_vllm_router'])}, E2E p50 pdx - vllm-router "
                    f"{_cell(r['e2e_p50_ms_pdx_minus_vllm_router'])} ms"
                ]
    return "\n".join(lines)


def _counts(d: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items())


# --- main -----------------------------------------------------------------------------------


@contextlib.contextmanager
def processes(
    work: Path, args: argparse.Namespace
) -> Iterator[tuple[Backends, dict[str, Child], str]]:
    """The instances, pdx's gateway and vllm-router (if it starts); all stopped at the end."""
    started: list[Child] = []
    try:
        engine = [sys.executable, str(HERE / "instant_engine.py"), "--model", MODEL, "--role"]
        prefill = spawn("prefill", [*engine, "prefill"], work / "prefill.log")
        started.append(prefill)
        decode = spawn("decode", [*engine, "decode"], work / "decode.log")
        started.append(decode)
        pdx = spawn("pdx", [sys.executable, __file__, "--serve-pdx", "--prefill-url", prefill.url,
                            "--decode-url", decode.url, "--tokenizer", args.tokenizer,
                            *(["--profile", str(args.profile)] if args.profile else [])],
                    work / "pdx.log")  # fmt: skip
        started.append(pdx)
        fronts, absent = {"pdx": pdx}, ""
        try:
            vr = start_vllm_router(args.vllm_router, prefill.url, decode.url,
                                   work / "vllm-router.log")  # fmt: skip
            started.append(vr)
            fronts["vllm-router"] = vr
        except RuntimeError as exc:
            absent = str(exc)
        yield Backends(prefill, decode), fronts, absent
    finally:
        for c in reversed(started):
            stop(c.proc)


async def measure(
    backends: Backends, fronts: dict[str, Child], args: argparse.Namespace
) -> dict[str, Any]:
    """Both phases."""
    urls = {n: c.url for n, c in fronts.items()}
    run = calls(urls, backends.prefill.url, backends.decode.url, args.timeout_s)
    pids = {n: c.proc.pid for n, c in fronts.items()}
    return {"latency": await latency(run, pids, backends, args),
            "throughput": await throughput(run, pids, backends, args)}  # fmt: skip


def main() -> None:
    """Start everything, measure, print (text or JSON), stop everything."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200, help="1-user rounds (each front)")
    ap.add_argument("--users", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--load-s", type=float, default=10.0, help="closed-loop seconds per front")
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout-s", type=float, default=30.0, help="one request's limit")
    ap.add_argument("--tokenizer", choices=["hf-byte", "byte"], default="hf-byte",
                    help="pdx gateway's tokenizer (it renders the output text)")  # fmt: skip
    ap.add_argument("--vllm-router", type=Path, default=VLLM_ROUTER, help="its executable")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--profile", type=Path, default=None,
                    help="run pdx's gateway under cProfile; its stats go to this file")  # fmt: skip
    ap.add_argument("--serve-pdx", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prefill-url", help=argparse.SUPPRESS)
    ap.add_argument("--decode-url", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_pdx:
        profile = str(args.profile) if args.profile else ""
        asyncio.run(serve_pdx(args.prefill_url, args.decode_url, args.tokenizer, profile))
        return
    # SIGTERM (timeout, CI) unwinds like Ctrl-C, so every child is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    with processes(work, args) as (backends, fronts, absent):
        report: dict[str, Any] = {
            "setup": {"requests": args.requests, "users": args.users, "load_s": args.load_s,
                      "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                      "tokenizer": args.tokenizer, "cpus": os.cpu_count(), "logs": str(work)},
            "vllm_router_absent": absent or None,
        }  # fmt: skip
        report |= asyncio.run(measure(backends, fronts, args))
    report["ratios"] = ratios(report)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        print(render(report))


if __name__ == "__main__":
    main()
