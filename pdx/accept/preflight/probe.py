"""Pre-flight ``probe-link`` over the deploy's KV link, judged against the KV demand.

A probe server is placed at the KV store's end of the link (on the prefill host, or inside the
prefill namespace) and ``pdx probe-link --json`` runs from decode's end (inside the decode
namespace when the run uses one), so the probe crosses the same hops as the KV bytes. It runs
before any step's condition is applied: it is the baseline link. KV flows from the store to
decode, i.e. server → client, so the bandwidth rule uses the ``down`` direction.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from typing import Any

from pdx.accept.playbook import Preflight
from pdx.errors import MeasurementError

_PDX = [sys.executable, "-c", "from pdx.cli.main import main; main()"]
# UDP probes per latency test: the loss rule passes only when none lost bounds loss to 0.1 %
# (2,995 probes at 95 %), so each probe sends that many (with a margin) over its duration.
LOSS_PROBES = 3200


def loss_interval_ms(duration_s: float) -> str:
    """The probe interval that sends :data:`LOSS_PROBES` probes in ``duration_s``."""
    return f"{max(0.1, min(10.0, duration_s * 1e3 / LOSS_PROBES)):.3g}"


_LISTENING = re.compile(r"listening on (\S+) tcp (\d+) udp (\d+)")


def probe_args(p: Preflight, target: str) -> list[str]:
    """``pdx probe-link`` arguments sized for a pre-flight (one round per throughput test).

    The shared secret travels in ``PDX_PROBE_SECRET`` (see :func:`_env`), not on the command line.
    """
    one_round_s = p.probe_duration_s + 0.5
    return [
        "probe-link",
        target,
        "--json",
        "--duration",
        f"{p.probe_duration_s:g}",
        "--interval-ms",
        loss_interval_ms(p.probe_duration_s),
        "--streams",
        str(p.probe_streams),
        "--max-duration",
        f"{one_round_s:g}",
        "--chunk-sizes",
        p.probe_chunk_sizes,
        "--chunk-seconds",
        f"{p.probe_chunk_seconds:g}",
        # the client runs at decode's end: KV flows from the server's end (the store) to it
        "--kv-direction",
        "down",
    ]


def step_probe_args(p: Preflight, target: str, streams: int) -> list[str]:
    """A short probe of the link under one step's condition: RTT and loss (enough UDP probes
    to bound loss to 0.1 %) and goodput with ``streams`` streams (the deploy's KV stripes) and
    one."""
    return [
        "probe-link",
        target,
        "--json",
        "--phases",
        "latency,throughput",
        "--duration",
        f"{p.probe_step_duration_s:g}",
        "--interval-ms",
        loss_interval_ms(p.probe_step_duration_s),
        "--streams",
        str(streams),
        "--max-duration",
        f"{p.probe_step_duration_s + 0.5:g}",
        "--kv-direction",
        "down",
    ]


@contextlib.asynccontextmanager
async def probe_server(host: str, secret: str, netns: str | None) -> AsyncIterator[str]:
    """A probe server bound on ``host`` (in ``netns`` when given); yields ``host:port``."""
    if netns is None:
        from pdx.link.server import ProbeServer, ServerThread

        thread = ServerThread(ProbeServer(host, 0, secret=secret.encode()))
        await asyncio.to_thread(thread.start)
        try:
            yield f"{host}:{thread.server.tcp_port}"
        finally:
            await asyncio.to_thread(thread.stop)
        return
    argv = ["ip", "netns", "exec", netns, *_PDX, "probe-server", "--bind", host, "--port", "0"]
    proc = await asyncio.create_subprocess_exec(
        *argv, env=_env(secret), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        yield f"{host}:{await _listening_port(proc)}"
    finally:
        if proc.returncode is None:
            proc.terminate()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 10)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def _env(secret: str) -> dict[str, str]:
    """This process's environment plus the per-run probe secret (``ip netns exec`` keeps it)."""
    return {**os.environ, "PDX_PROBE_SECRET": secret}


async def _listening_port(proc: asyncio.subprocess.Process) -> int:
    assert proc.stdout is not None and proc.stderr is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
    except TimeoutError:
        line = b""
    found = _LISTENING.search(line.decode(errors="replace"))
    if found is None:
        err = (await proc.stderr.read(2000)).decode(errors="replace").strip() if line == b"" else ""
        raise MeasurementError(f"probe server did not start: {err or line!r}")
    return int(found.group(2))


async def run_probe(
    host: str, netns: tuple[str, str] | None, args_for: Callable[[str], list[str]]
) -> dict[str, Any]:
    """Probe the link from decode's end to a server at the KV store (``host``).

    ``netns`` = (prefill namespace, decode namespace) when the deploy runs in them;
    ``args_for`` builds the probe-link arguments for the server's ``host:port`` (the
    pre-flight's: ``functools.partial(probe_args, playbook.preflight)``). Returns
    ``{"command", "server", "report"}`` or ``{"error"}``; never raises a measurement failure
    (pre-flight informs, it does not judge).
    """
    secret = secrets.token_hex(16)
    try:
        async with probe_server(host, secret, netns[0] if netns else None) as where:
            args = args_for(where)
            prefix = ["ip", "netns", "exec", netns[1]] if netns else []
            proc = await asyncio.create_subprocess_exec(
                *prefix,
                *_PDX,
                *args,
                env=_env(secret),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            try:
                out, err = await asyncio.wait_for(proc.communicate(), 120)
            finally:
                if proc.returncode is None:  # cancelled (Ctrl-C) or timed out: stop it now
                    proc.kill()
                    await proc.wait()
    except (MeasurementError, OSError, TimeoutError) as exc:
        return {"error": f"probe-link could not run: {exc}"}
    shown = ["pdx", *args]
    if netns:
        shown = ["ip", "netns", "exec", netns[1], *shown]
    if proc.returncode not in (0, 1, 3):  # its own NO-GO / INCONCLUSIVE: the report is there
        return {"command": shown, "error": err.decode(errors="replace").strip()[-500:]}
    return {
        "command": shown,
        "server": where,
        "server_netns": netns[0] if netns else None,
        "report": _trim(json.loads(out)),
    }


def _trim(report: dict[str, Any]) -> dict[str, Any]:
    """Drop per-interval samples (kept by ``probe-link --json`` itself)."""
    for run in (report.get("throughput") or {}).get("runs", []):
        run.pop("intervals_gbps", None)
    return report


def judge_demand(
    probe: dict[str, Any], kv: tuple[int, int] | None, rps: float | None, rps_source: str,
    ttft_budget_ms: float | None, confidence: float = 0.95,
) -> dict[str, Any]:  # fmt: skip
    """Re-judge a probe report with the KV demand at the playbook's load.

    demand Gbps = KV bytes of the largest request × req/s × 8 / 1e9.
    """
    from pdx.link.verdict import VerdictRules, judge

    report = probe.get("report")
    if report is None:
        return probe
    gbps = kv[1] * rps * 8 / 1e9 if kv is not None and rps else None
    rules = VerdictRules(
        kv_gbps=gbps, ttft_budget_ms=ttft_budget_ms, kv_direction="down", confidence=confidence
    )
    report["kv_demand"] = {
        "gbps": gbps,
        "source": "pre-flight measure-kv × load",
        "input_tokens": kv[0] if kv else None,
        "kv_bytes_per_request": kv[1] if kv else None,
        "rps": rps,
        "rps_source": rps_source,
    }
    verdict = judge(report, rules)
    report["verdict"] = asdict(verdict)
    sizes = next((r.sizes for r in verdict.rules if r.name == "chunk_p99" and r.sizes), None)
    if sizes is not None:  # the size to use at this run's budget (None: no size passes it)
        report["chunk_recommended_bytes"] = next(
            (s["chunk_bytes"] for s in sizes if s["recommended"]), None
        )
    return probe


def _retrans(run: dict[str, Any]) -> float | None:
    """Segments the senders retransmitted, in percent of the segments they delivered."""
    senders = run.get("sender_tcp") or []
    sent = sum(t["bytes_acked"] / max(t["snd_mss"], 1) for t in senders if t.get("bytes_acked"))
    if not sent:
        return None
    return 100.0 * sum(t.get("total_retrans", 0) for t in senders) / sent


def _algorithms(tcp: dict[str, Any]) -> dict[str, Any]:
    """Each end's default congestion control and what the single-stream senders used."""
    single = tcp.get("single_stream") or {}
    used = {s["congestion_control"] for s in single.values() if s.get("congestion_control")}
    return {
        "client": (tcp.get("client") or {}).get("congestion_control"),
        "server": (tcp.get("server") or {}).get("congestion_control"),
        "senders": sorted(used),
    }


def summary(probe: dict[str, Any] | None) -> dict[str, Any] | None:
    """The figures a reviewer reads first (also what ``report.md`` shows)."""
    report = (probe or {}).get("report")
    if not report:
        return None
    rtt = report.get("rtt_ms") or {}
    tp = report.get("throughput") or {}
    loss = report.get("loss") or {}
    verdict = report.get("verdict") or {}
    return {
        "down_gbps": tp.get("down_gbps"),
        "up_gbps": tp.get("up_gbps"),
        "goodput_ci95_pct": tp.get("ci95_pct"),
        "rtt_p50_ms": rtt.get("p50"),
        "rtt_p99_ms": rtt.get("p99"),
        "loss_up_pct": loss.get("up"),
        "loss_down_pct": loss.get("down"),
        "chunks": [
            {k: c.get(k) for k in ("chunk_bytes", "gbps", "p50_ms", "p99_ms")}
            for c in report.get("chunks") or []
        ],
        "chunk_recommended_bytes": report.get("chunk_recommended_bytes"),
        "down_runs": [
            {"streams": r.get("streams"), "gbps": r.get("gbps"), "retransmit_pct": _retrans(r)}
            for r in tp.get("runs") or []
            if r.get("direction") == "down"
        ],
        "jitter_ms": (report.get("jitter_ms") or {}).get("rfc3550"),
        "congestion_control": _algorithms(report.get("tcp") or {}),
        "kv_demand_gbps": (report.get("kv_demand") or {}).get("gbps"),
        "verdict": verdict.get("result") if verdict else None,
        "verdict_why": verdict.get("why") if verdict else None,
        "rules": [
            {k: r.get(k) for k in ("name", "status", "measured", "threshold", "unit")}
            for r in verdict.get("rules", [])
        ],
    }
