"""The same vLLM prefill/decode pair fronted by the pdx gateway and by vllm-router.

One real pair (``pdx deploy --set engine=vllm`` in a process of its own: NixlConnector, KV
over UCX/TCP) and, on the same two instances, ``vllm-router --vllm-pd-disaggregation
--kv-connector nixl`` (vllm-router 0.1.17, installed into .venv-vllm by ``make vllm``).
In one run:

1. latency, one request at a time, the fronts interleaved in an order that alternates by round
   (unique prompts, streamed): TTFT (median and p99) and TPOT = (E2E − TTFT) / (tokens − 1)
   from the client, for ``direct`` (decode alone computes the prompt: one instance, no P/D),
   ``two-step`` (the benchmark itself runs the two-step protocol against the instances as pdx
   sends it: P/D with no proxy), ``two-step-doc`` (the same, with the requests vLLM's
   documentation and toy proxy send: no ``ignore_eos`` on the prefill request, the remote
   fields spelled out empty), ``pdx`` and ``vllm-router``; the overhead of each is its median
   (and p99) against ``two-step``, and the median of its per-round differences from
   ``two-step`` with a 90 % interval (the two one-sided 95 % order-statistic bounds); the p99
   overhead with bounds from each side's bounds on its p99 (``--requests 300`` or more for an
   upper one);
2. throughput: ``--users`` closed-loop users for ``--load-s`` through each front;
3. prefill killed mid-run (SIGKILL to its process group, the deploy restarts it): an
   open-loop load (``--kill-rps``) for ``--kill-window-s`` through each front in turn (open
   loop, so a front that fails fast is not sent more requests than one that degrades);
   errors, requests that hang past
   ``--hang-s``, and recovery = time from the kill until decode's
   ``vllm:prompt_tokens_cached_by_source{source="p2p"}`` rises again (KV pulled over NIXL).

The rule of the fight: the same pair, client and prompts for both fronts; latency requests
interleaved; the throughput phase takes the fronts in one order and the kill phase in the
other; before each front's kill the pair is checked back by itself (a two-step request to the
instances and decode's NIXL counter rising, through neither front); a kill that finds no
prefill process stops the phase instead of being reported as a kill.

    python benchmarks/bench_router.py [--requests 20] [--prompt-tokens 300] [--max-tokens 32]
        [--users 4] [--load-s 20] [--kill-window-s 120] [--kill-rps 4]
        [--phases latency,throughput,kill] [--references direct,two-step,two-step-doc]
        [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from pdx.serving.engines.metrics import engine_counters

ROOT = Path(__file__).resolve().parents[1]
# What a front may add to TTFT over the bare two-step protocol: median and p99, in ms.
FRONT_GOAL_MS, FRONT_P99_GOAL_MS = 1.0, 3.0
BASE = ["engine=vllm", "gateway.port=0", "router.local_prefill_max_tokens=8",
        "router.degrade_p99_ms=1000"]  # fmt: skip
_rng = random.Random(2026)


def prompt(n: int) -> list[int]:
    """A prompt no earlier request used (decode would serve a repeat from its own cache)."""
    return [_rng.randint(4, 259) for _ in range(n)]


@dataclass
class Pair:
    """``pdx deploy`` (its own process, as users run it) and the endpoints it printed."""

    proc: subprocess.Popen[bytes]
    endpoints: dict[str, Any]

    def prefill_pid(self) -> int | None:
        """The prefill instance's current pid (it changes when the deploy restarts it)."""
        from pdx.accept.target.engine_faults import find_instance

        return find_instance(self.proc.pid, int(self.endpoints["prefill"][0]["port"]))


@contextlib.contextmanager
def pair(work: Path, extra: list[str] | None = None) -> Iterator[Pair]:
    """Start ``pdx deploy --set engine=vllm --json``; SIGTERM it (and so the pair) at the end."""
    out = work / "endpoints.json"
    args = [sys.executable, "-m", "pdx", "deploy", "--json"]
    for item in [*BASE, *(extra or [])]:
        args += ["--set", item]
    with out.open("wb") as stdout, (work / "deploy.log").open("ab") as log:
        proc = subprocess.Popen(args, stdout=stdout, stderr=log, start_new_session=True)
    try:
        t0 = time.monotonic()
        while True:
            with contextlib.suppress(ValueError):
                endpoints = json.loads(out.read_text())
                break
            if proc.poll() is not None or time.monotonic() - t0 > 600:
                raise RuntimeError(f"pdx deploy did not start; see {work / 'deploy.log'}")
            time.sleep(0.5)
        yield Pair(proc, endpoints)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def vllm_router(prefill: str, decode: str, log: Path) -> Iterator[str | None]:
    """vllm-router in front of the pair (None when it is not installed)."""
    exe = ROOT / ".venv-vllm" / "bin" / "vllm-router"
    if not exe.is_file():
        yield None
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [str(exe), "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
            "--prefill", prefill, "--decode", decode, "--kv-connector", "nixl",
            "--policy", "round_robin", "--log-level", "warning"]  # fmt: skip
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=out, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:
            with contextlib.suppress(OSError):
                import urllib.request

                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            if proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited with {proc.returncode}; see {log}")
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


async def stream(
    s: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout_s: float
) -> dict[str, Any]:
    """One streamed completion: ok, TTFT, E2E, tokens (client clock)."""
    t0 = time.perf_counter()
    ttft, tokens, error = None, 0, None
    try:
        async with asyncio.timeout(timeout_s):
            async with s.post(url + "/v1/completions", json={**body, "stream": True}) as r:
                if r.status != 200:
                    return {
                        "ok": False,
                        "error": f"HTTP {r.status}",
                        "e2e_s": time.perf_counter() - t0,
                    }
                async for raw in r.content:
                    line = raw.decode(errors="replace").strip()
                    if not line.startswith("data: {"):
                        continue
                    data = json.loads(line[6:])
                    if "error" in data:
                        error = str(data["error"])[:120]
                    for c in data.get("choices") or []:
                        n = len(c.get("token_ids") or [])
                        if n and ttft is None:
                            ttft = time.perf_counter() - t0
                        tokens += n
    except TimeoutError:
        return {"ok": False, "error": "hung", "e2e_s": time.perf_counter() - t0}
    except aiohttp.ClientError as exc:
        return {"ok": False, "error": type(exc).__name__, "e2e_s": time.perf_counter() - t0}
    e2e = time.perf_counter() - t0
    ok = error is None and ttft is not None
    return {"ok": ok, "error": error, "ttft_s": ttft, "e2e_s": e2e, "tokens": tokens}


async def two_step(
    s: aiohttp.ClientSession, prefill: str, decode: str, body: dict[str, Any], timeout_s: float
) -> dict[str, Any]:
    """The two-step protocol done by the client itself: P/D with no proxy in between."""
    t0 = time.perf_counter()
    first = {**body, "max_tokens": 1, "ignore_eos": True, "stream": False,
             "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    async with s.post(prefill + "/v1/completions", json=first) as r:
        params = (await r.json()).get("kv_transfer_params")
    prefill_s = time.perf_counter() - t0
    out = await stream(s, decode, {**body, "kv_transfer_params": params}, timeout_s)
    out["e2e_s"] += prefill_s  # both clocks start at the prefill request
    if out.get("ttft_s") is not None:
        out["ttft_s"] += prefill_s
    return out


# vLLM's documented P/D request (its toy proxy's prefill body): no ignore_eos, the remote
# fields spelled out empty. A client written from vLLM's docs sends this.
DOC_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip


async def two_step_doc(
    s: aiohttp.ClientSession, prefill: str, decode: str, body: dict[str, Any], timeout_s: float
) -> dict[str, Any]:
    """The two-step protocol as vLLM documents it (its toy proxy's requests), by the client."""
    t0 = time.perf_counter()
    first = {k: v for k, v in body.items() if k != "ignore_eos"}
    first.update(max_tokens=1, stream=False, kv_transfer_params=dict(DOC_PARAMS))
    async with s.post(prefill + "/v1/completions", json=first) as r:
        reply = await r.json()
    params = reply.get("kv_transfer_params")
    prefill_s = time.perf_counter() - t0
    out = await stream(s, decode, {**body, "kv_transfer_params": params}, timeout_s)
    out["e2e_s"] += prefill_s
    if out.get("ttft_s") is not None:
        out["ttft_s"] += prefill_s
    out["prefill_finish"] = ((reply.get("choices") or [{}])[0]).get("finish_reason")
    out["kv_params"] = params is not None
    return out


def _tpot_ms(r: dict[str, Any]) -> float | None:
    if not r.get("ok") or r.get("tokens", 0) < 2:
        return None
    return (r["e2e_s"] - r["ttft_s"]) / (r["tokens"] - 1) * 1e3


async def latency(
    fronts: dict[str, str], urls: dict[str, str], model: str, args: Any
) -> dict[str, Any]:
    """One request at a time, the fronts interleaved, after a warm-up round."""
    names = [*_references(args.references), *fronts]
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    async with aiohttp.ClientSession() as s:
        for rnd in range(args.requests + 2):
            # the order alternates by round, so no client always follows the same one
            for name in names if rnd % 2 == 0 else names[::-1]:
                body = {"model": model, "prompt": prompt(args.prompt_tokens),
                        "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
                        "return_token_ids": True}  # fmt: skip
                if name == "direct":
                    r = await stream(s, urls["decode"], body, 60)
                elif name == "two-step":
                    r = await two_step(s, urls["prefill"], urls["decode"], body, 60)
                elif name == "two-step-doc":
                    r = await two_step_doc(s, urls["prefill"], urls["decode"], body, 60)
                else:
                    extra = {"pdx_route": "disaggregated"} if name == "pdx" else {}
                    r = await stream(s, fronts[name], {**body, **extra}, 60)
                if rnd >= 2:  # the first two rounds warm every path (NIXL handshake included)
                    rows[name].append(r)
    out = {}
    for name, rs in rows.items():
        ok = [r for r in rs if r["ok"]]
        ttft = [r["ttft_s"] * 1e3 for r in ok]
        tpot = [t for r in ok if (t := _tpot_ms(r)) is not None]
        out[name] = {"n": len(rs), "failed": len(rs) - len(ok),
                     "ttft_ms": round(statistics.median(ttft), 2) if ttft else None,
                     "ttft_p99_ms": round(_p(ttft, 0.99), 2) if ttft else None,
                     "tpot_ms": round(statistics.median(tpot), 3) if tpot else None}  # fmt: skip
        finishes = [r.get("prefill_finish") for r in rs if "prefill_finish" in r]
        if finishes:
            out[name]["prefill_finish"] = {f: finishes.count(f) for f in set(finishes)}
            out[name]["kv_params_returned"] = sum(1 for r in rs if r.get("kv_params"))
    base = out["two-step"]
    for name in [n for n in names if n not in ("direct", "two-step")]:
        paired = _paired(rows[name], rows["two-step"])
        if paired is not None:
            out[name]["ttft_paired_overhead_ms"] = paired
        if out[name]["ttft_ms"] is not None and base["ttft_ms"] is not None:
            out[name]["ttft_overhead_ms"] = round(out[name]["ttft_ms"] - base["ttft_ms"], 2)
            out[name]["ttft_p99_overhead_ms"] = round(
                out[name]["ttft_p99_ms"] - base["ttft_p99_ms"], 2
            )
            out[name]["ttft_p99_overhead_bounds_ms"] = _p99_overhead(rows[name], rows["two-step"])
            out[name]["tpot_overhead_ms"] = round(out[name]["tpot_ms"] - base["tpot_ms"], 3)
        if name in fronts and paired is not None:
            out[name]["goal"] = _goal(paired, out[name]["ttft_p99_overhead_bounds_ms"])
    return out


REFERENCES = ("direct", "two-step", "two-step-doc")


def _references(spec: str) -> list[str]:
    """The latency phase's client-side paths (``--references``): ``two-step`` always, as every
    front's overhead is taken against it; the others as asked, in their usual order."""
    asked = {name.strip() for name in spec.split(",") if name.strip()}
    unknown = sorted(asked - set(REFERENCES))
    if unknown:
        raise SystemExit(f"--references: unknown {', '.join(unknown)} "
                         f"(expected some of {', '.join(REFERENCES)})")  # fmt: skip
    return [name for name in REFERENCES if name in asked or name == "two-step"]


def _goal(paired: dict[str, Any], p99: dict[str, Any]) -> dict[str, str]:
    """A front's overhead over two-step against the goals (median <= 1 ms, p99 <= 3 ms), each
    judged from its interval: MET, MISSED or UNDECIDED (the sample cannot tell)."""
    from pdx.accept.judge.confidence import goal_verdict

    return {"median": goal_verdict(paired["low"], paired["high"], FRONT_GOAL_MS),
            "p99": goal_verdict(p99["low"], p99["high"], FRONT_P99_GOAL_MS)}  # fmt: skip


def _p99_overhead(front: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, Any]:
    """Bounds on p99(front) − p99(two-step) from each side's distribution-free 95 % bounds on
    its p99 (front's low − base's high, front's high − base's low: together a 90 % interval
    or wider); a p99's upper bound needs 299 requests, so shorter runs leave ``high`` None."""
    from pdx.accept.judge import confidence as ci

    f = ci.quantile_bounds([r["ttft_s"] * 1e3 for r in front if r.get("ok")], 0.99, 0.95)
    b = ci.quantile_bounds([r["ttft_s"] * 1e3 for r in base if r.get("ok")], 0.99, 0.95)
    d = ci.difference_bounds(f, b)
    return {"low": None if d.low is None else round(d.low, 2),
            "high": None if d.high is None else round(d.high, 2)}  # fmt: skip


def _paired(front: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, float] | None:
    """Median of the per-round TTFT differences (front − two-step, the same round: the box's
    drift hits both alike) with its distribution-free 90 % interval (order statistics of the
    differences: a sign-test interval), in ms."""
    from pdx.accept.judge import confidence as ci

    diffs = sorted(
        (f["ttft_s"] - b["ttft_s"]) * 1e3
        for f, b in zip(front, base, strict=True)
        if f.get("ok") and b.get("ok")
    )
    if len(diffs) < 5:
        return None
    b = ci.quantile_bounds(diffs, 0.5, 0.95)
    lo, hi = b.low, b.high
    return {"median": round(statistics.median(diffs), 2),
            "low": None if lo is None else round(lo, 2),
            "high": None if hi is None else round(hi, 2), "n": len(diffs)}  # fmt: skip


def _p(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.999999) - 1))]


async def closed_loop(
    url: str, model: str, users: int, seconds: float, args: Any, extra: dict[str, Any]
) -> list[dict[str, Any]]:
    """``users`` clients back to back for ``seconds`` (at most 2,000 requests in all)."""
    rows: list[dict[str, Any]] = []
    deadline = time.monotonic() + seconds

    async def user() -> None:
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < deadline and len(rows) < 2000:
                body = {"model": model, "prompt": prompt(args.prompt_tokens),
                        "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
                        "return_token_ids": True, **extra}  # fmt: skip
                r = await stream(s, url, body, args.hang_s)
                r["sent_at"] = time.monotonic()
                rows.append(r)

    await asyncio.gather(*(user() for _ in range(users)))
    return rows


def throughput(rows: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """Requests and output tokens per second of a closed-loop run."""
    ok = [r for r in rows if r["ok"]]
    return {"requests": len(rows), "failed": len(rows) - len(ok),
            "req_per_s": round(len(ok) / seconds, 2),
            "tokens_per_s": round(sum(r["tokens"] for r in ok) / seconds, 1)}  # fmt: skip


async def p2p_watch(decode: str, since: float, until: float) -> float | None:
    """Seconds from ``since`` until decode pulled KV over NIXL again (None: not by ``until``)."""
    async with aiohttp.ClientSession() as s:

        async def p2p() -> float:
            async with s.get(decode + "/metrics") as r:
                return float(engine_counters(await r.text())["p2p_cached_tokens"])

        base = await p2p()
        while time.monotonic() < until:
            await asyncio.sleep(0.5)
            with contextlib.suppress(aiohttp.ClientError):
                if await p2p() > base:
                    return round(time.monotonic() - since, 1)
    return None


async def open_loop(
    url: str, model: str, rps: float, seconds: float, args: Any, extra: dict[str, Any]
) -> list[dict[str, Any]]:
    """Poisson arrivals at ``rps`` for ``seconds``: the load does not slow when the front fails."""
    rows: list[dict[str, Any]] = []
    rng = random.Random(7)
    async with aiohttp.ClientSession() as s:

        async def one(sent_at: float) -> None:
            body = {"model": model, "prompt": prompt(args.prompt_tokens),
                    "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True, **extra}  # fmt: skip
            r = await stream(s, url, body, args.hang_s)
            r["sent_at"] = sent_at
            rows.append(r)

        tasks, t0 = [], time.monotonic()
        while time.monotonic() - t0 < seconds:
            tasks.append(asyncio.create_task(one(time.monotonic())))
            await asyncio.sleep(rng.expovariate(rps))
        await asyncio.gather(*tasks)
    return rows


async def kill_run(
    dep: Pair, url: str, model: str, extra: dict[str, Any], args: Any
) -> dict[str, Any]:
    """Open-loop load through ``url``; prefill SIGKILLed 3 s in; errors, hangs, recovery."""
    decode = dep.endpoints["decode"][0]["url"]
    t0 = time.monotonic()

    async def kill() -> float | None:
        await asyncio.sleep(3.0)
        pid = dep.prefill_pid()
        if pid is None:  # no kill happened: the phase would measure nothing, so it stops
            raise RuntimeError("prefill-killed phase aborted: no prefill process found")
        os.killpg(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        # p2p rises only once the restarted prefill hands out KV again
        return await p2p_watch(decode, killed_at, t0 + args.kill_window_s)

    rows, recovery = await asyncio.gather(
        open_loop(url, model, args.kill_rps, args.kill_window_s, args, extra), kill()
    )
    after = [r for r in rows if r["sent_at"] - t0 > 3.0]
    errors: dict[str, int] = {}
    for r in after:
        if not r["ok"]:
            errors[str(r.get("error"))] = errors.get(str(r.get("error")), 0) + 1
    return {"requests_after_kill": len(after), "failed": sum(errors.values()), "errors": errors,
            "hung": errors.get("hung", 0), "recovery_s": recovery,
            "slowest_s": round(max((r["e2e_s"] for r in after), default=0.0), 2)}  # fmt: skip


async def wait_pd_back(
    urls: dict[str, str], model: str, tokens: int, timeout_s: float = 240
) -> None:
    """Until the pair itself moves KV again (prefill restarted): a two-step request straight
    to the instances, and decode's own NIXL counter rising, through no front at all. The
    prompt must hold whole KV blocks (128 tokens on CPU): decode pulls none of a shorter one."""
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as s:

        async def p2p() -> float:
            async with s.get(urls["decode"] + "/metrics") as r:
                return float(engine_counters(await r.text())["p2p_cached_tokens"])

        while time.monotonic() - t0 < timeout_s:
            # return_token_ids: the stream reader counts tokens by their ids
            body = {"model": model, "prompt": prompt(tokens), "max_tokens": 2,
                    "ignore_eos": True, "return_token_ids": True}  # fmt: skip
            with contextlib.suppress(aiohttp.ClientError, ValueError, KeyError):
                before = await p2p()
                out = await two_step(s, urls["prefill"], urls["decode"], body, 30.0)
                if out["ok"] and await p2p() > before:
                    return
            await asyncio.sleep(1.0)
    raise RuntimeError("prefill did not come back")


def main() -> None:
    """Every phase on one pair; a table per phase (or one JSON document)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--load-s", type=float, default=20.0)
    ap.add_argument("--kill-window-s", type=float, default=120.0)
    ap.add_argument("--kill-rps", type=float, default=4.0, help="open-loop rate of that phase")
    ap.add_argument("--hang-s", type=float, default=30.0, help="a request past this has hung")
    ap.add_argument(
        "--phases",
        default="latency,throughput,kill",
        help="which phases, comma-separated (latency, throughput, kill)",
    )
    ap.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="more pdx deploy settings for the pair (e.g. vllm.shm_recheck_ms=1)",
    )
    ap.add_argument(
        "--references",
        default=",".join(REFERENCES),
        help="the latency phase's paths without a front, comma-separated (direct, two-step, "
        "two-step-doc); two-step, the anchor of every overhead, is always run. Fewer paths "
        "and --max-tokens 2 make a round shorter, so more rounds fit the same time",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    _references(args.references)  # a bad name stops here, before the pair starts
    phases = set(args.phases.split(","))
    if not _engine_available():
        return
    # SIGTERM (timeout, CI) unwinds like Ctrl-C, so the pair's processes are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="bench-router-"))
    try:
        _phases(args, phases, report, work)
    except Exception as exc:  # what was measured before still counts, with the failure
        report["failed"] = f"{type(exc).__name__}: {exc}"
        print(f"stopped: {report['failed']}", file=sys.stderr)
        _done(args, report)
        raise SystemExit(1) from None
    _done(args, report)


def _phases(args: Any, phases: set[str], report: dict[str, Any], work: Path) -> None:
    with pair(work, args.sets) as dep:
        ep = dep.endpoints
        urls = {"prefill": ep["prefill"][0]["url"], "decode": ep["decode"][0]["url"]}
        model = str(ep["model"]["model"])
        with vllm_router(urls["prefill"], urls["decode"], work / "router.log") as vr:
            fronts = {"pdx": str(ep["gateway"]), **({"vllm-router": vr} if vr else {})}
            extras = {"pdx": {"pdx_route": "disaggregated"}, "vllm-router": {}}
            if "latency" in phases:
                report["latency"] = asyncio.run(latency(fronts, urls, model, args))
                _print(args, "latency (medians, one request at a time)", report["latency"])
            if not phases & {"throughput", "kill"}:
                return
            # Each later phase takes the fronts in the other order, so neither always runs
            # second (after the other's load, or after an earlier kill and restart).
            order = list(fronts)
            report["order"] = {"throughput": order, "prefill_killed": order[::-1]}
            if "throughput" in phases:
                report["throughput"] = {
                    name: throughput(asyncio.run(closed_loop(fronts[name], model, args.users,
                                                             args.load_s, args, extras[name])),
                                     args.load_s)
                    for name in order
                }  # fmt: skip
                title = f"throughput ({args.users} users, {args.load_s:g} s)"
                _print(args, title, report["throughput"])
            report["prefill_killed"] = {}
            for name in order[::-1] if "kill" in phases else []:
                asyncio.run(wait_pd_back(urls, model, args.prompt_tokens))
                report["prefill_killed"][name] = asyncio.run(
                    kill_run(dep, fronts[name], model, extras[name], args)
                )
            if "kill" in phases:
                _print(args, "prefill SIGKILLed 3 s into the run", report["prefill_killed"])


def _done(args: Any, report: dict[str, Any]) -> None:
    if args.json:
        json.dump(report, sys.stdout, indent=2)


def _print(args: Any, title: str, table: dict[str, dict[str, Any]]) -> None:
    if args.json:
        return
    print(title)
    for name, row in table.items():
        print(f"  {name:>12}: " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)


def _engine_available() -> bool:
    """False, with the reason on stderr, where this machine has no vLLM environment (make vllm)."""
    from pdx.serving.engines.env import EngineUnavailable, discover

    try:
        discover()
    except EngineUnavailable as exc:
        print(f"skipped: vLLM environment unavailable: {exc}", file=sys.stderr)
        return False
    return True


if __name__ == "__main__":
    main()
