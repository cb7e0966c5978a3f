"""``probe-link``: run the phases against a probe server and assemble one report."""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pdx.errors import InputError, MeasurementError
from pdx.link import phases
from pdx.link.chunks import CHUNK_GOODPUT_SHARE, choose_chunk, get_chunk_transport, run_chunk_sweep
from pdx.link.client import ProbePlan, ProbeSession, parse_target
from pdx.link.stats import mean_ci95, summarize
from pdx.link.verdict import VerdictRules, judge
from pdx.tcp import TcpInfo, bdp_bytes, tcp_facts, window_for
from pdx.units import MIB, human_bytes

ALL_PHASES = ("latency", "throughput", "loaded", "mtu", "chunks")
DEFAULT_CHUNK_SIZES = (256 * 1024, 1 * MIB, 2 * MIB, 4 * MIB, 8 * MIB)
_CHUNK_WARMUP_S = 0.25  # per size in a plan: the 2 MiB warm-up before the timed chunks

Progress = Callable[[str, str], None]


@dataclass(frozen=True)
class ProbeOptions:
    """Everything ``probe-link`` needs, validated at the command line."""

    target: str
    duration_s: float = 5.0
    interval_ms: float = 10.0
    streams: int = 4
    secret: bytes | None = None
    phases: Sequence[str] = ALL_PHASES
    probe_bytes: int = 64
    omit_s: float = 0.5
    sample_interval_s: float = 0.1
    ci_target_pct: float = 5.0
    max_duration_s: float | None = None
    max_test_bytes: int = 64 * 1024**3
    chunk_sizes: Sequence[int] = DEFAULT_CHUNK_SIZES
    chunk_seconds: float = 1.0
    chunk_window: int = 2
    chunk_transport: str = "tcp"
    connect_timeout_s: float = 5.0
    rules: VerdictRules = field(default_factory=VerdictRules)
    kv_source: str | None = None


def _quiet(phase: str, message: str) -> None:
    """Default progress sink: say nothing."""


def probe_link(opts: ProbeOptions, progress: Progress = _quiet) -> dict[str, Any]:
    """Measure the link to ``opts.target`` and judge it; returns the ``--json`` document."""
    unknown = [p for p in opts.phases if p not in ALL_PHASES]
    if unknown:
        raise InputError("--phases", ",".join(unknown), f"a subset of {','.join(ALL_PHASES)}")
    host, port = parse_target(opts.target)
    get_chunk_transport(opts.chunk_transport)  # fail on a bad name before measuring anything
    plan = probe_plan(opts)
    session = ProbeSession(host, port, opts.secret, opts.connect_timeout_s, plan=plan)
    report: dict[str, Any] = _empty_report(opts)
    try:
        with session.open():
            _run_phases(session, opts, report, progress)
    except OSError as exc:  # a socket failure mid-run is a measurement failure, not a bug
        raise MeasurementError(f"link to {opts.target} failed during the probe: {exc}") from None
    report["verdict"] = asdict(judge(report, opts.rules))
    return report


def probe_plan(opts: ProbeOptions) -> ProbePlan:
    """What this run asks of the server: its most data connections at once, and the seconds
    of data tests (the throughput phase's tests at their caps, the chunk sweep's sizes)."""
    streams, seconds = 0, 0.0
    if "throughput" in opts.phases:
        streams = opts.streams
        test_s = opts.duration_s + opts.omit_s
        seconds += 2 * len({1, opts.streams}) * max(test_s, _goodput_cap(opts))
    if "chunks" in opts.phases and opts.chunk_transport != "grpc":  # grpc: the KV store
        streams = max(streams, 1)
        seconds += len(opts.chunk_sizes) * (opts.chunk_seconds + _CHUNK_WARMUP_S)
    return ProbePlan(streams, round(seconds, 3))


def budget_note(session: ProbeSession) -> str | None:
    """Fail now when the server grants fewer streams than the session's plan needs; a line
    to show when it grants fewer bytes than the plan could move (None: nothing to say)."""
    budget, plan = session.budget, session.plan
    if budget is None or plan is None:  # an older server announces no per-session budget
        return None
    hint = ("" if budget.get("authenticated") else "; a server without --secret grants every "
            "session this: run both ends with --secret, or raise the server's --anonymous-* "
            "limits")  # fmt: skip
    granted = int(budget.get("data_connections", 0))
    if granted < plan.streams:
        needs = f"the probe needs {plan.streams} (--streams)"
        raise MeasurementError(
            f"the server grants this session {granted} data connections at once, {needs}{hint}"
        )
    if not budget.get("capped") or plan.seconds <= 0:
        return None
    gb = int(budget.get("bytes", 0)) / 1e9
    gbps = gb * 8 / plan.seconds
    return (f"the server grants this session {gb:.3g} GB for {plan.seconds:g} s of tests: a "
            f"link faster than {gbps:.3g} Gbit/s on average runs out{hint}")  # fmt: skip


def _run_phases(
    session: ProbeSession, opts: ProbeOptions, report: dict[str, Any], progress: Progress
) -> None:
    report["server_version"] = session.server_version
    note = budget_note(session)
    data_phases = [p for p in opts.phases if p in ("throughput", "chunks")]
    if note and data_phases:
        progress(data_phases[0], note)
    if "latency" in opts.phases:
        _latency_phase(session, opts, report, progress)
    if "mtu" in opts.phases:
        _mtu_phase(session, report, progress)
    if "throughput" in opts.phases:
        _throughput_phase(session, opts, report, progress)
    if "chunks" in opts.phases:
        _chunk_phase(session, opts, report, progress)
    report["tcp"] = tcp_summary(session, report)
    rules = opts.rules
    report["recommendations"] = recommend(report, rules.kv_direction, rules.chunk_p99_limit_ms)


def _empty_report(opts: ProbeOptions) -> dict[str, Any]:
    return {
        "target": opts.target,
        "server_version": None,
        "phases": list(opts.phases),
        "settings": {
            "duration_s": opts.duration_s,
            "interval_ms": opts.interval_ms,
            "streams": opts.streams,
            "omit_s": opts.omit_s,
            "sample_interval_s": opts.sample_interval_s,
            "ci_target_pct": opts.ci_target_pct,
        },
        "rtt_ms": None,
        "jitter_ms": {"rfc3550": None, "rfc3550_under_load": None},
        "ipdv_ms": None,
        "loss": None,
        "throughput": None,
        "rtt_under_load_ms": None,
        "mtu": None,
        "mtu_probe": None,
        "chunk_transport": opts.chunk_transport,
        "chunk_window": opts.chunk_window,
        "chunks": [],
        "chunk_recommended_bytes": None,
        "kv_demand": {"gbps": opts.rules.kv_gbps, "source": opts.kv_source},
        "tcp": None,
        "recommendations": None,
        "verdict": None,
    }


def _latency_phase(
    session: ProbeSession, opts: ProbeOptions, report: dict[str, Any], progress: Progress
) -> None:
    progress("latency", f"idle latency: UDP probes every {opts.interval_ms:g} ms")
    run = phases.run_probes(
        session,
        stream=1,
        duration_s=opts.duration_s,
        interval_ms=opts.interval_ms,
        probe_bytes=opts.probe_bytes,
    )
    result = phases.summarize_probes(run)
    report["rtt_ms"] = result.rtt_ms
    report["jitter_ms"]["rfc3550"] = result.jitter_ms
    report["ipdv_ms"] = result.ipdv_ms
    report["loss"] = result.loss
    progress(
        "latency",
        f"RTT p50 {result.rtt_ms['p50']:.3f} ms p99 {result.rtt_ms['p99']:.3f} ms, "
        f"loss up {result.loss['up']:.3f} % down {result.loss['down']:.3f} %",
    )


def _mtu_phase(session: ProbeSession, report: dict[str, Any], progress: Progress) -> None:
    progress("mtu", "path MTU: DF-bit binary search")
    result = phases.discover_mtu(session)
    report["mtu"] = result.mtu
    report["mtu_probe"] = asdict(result)
    progress("mtu", f"path MTU {result.mtu} bytes ({result.probes} probes)")


class _LoadedProbes:
    """UDP probes on their own thread while a throughput run loads the link."""

    def __init__(self, session: ProbeSession, opts: ProbeOptions, stream: int) -> None:
        self.result: phases.ProbeRun | BaseException | None = None
        kwargs = {
            "stream": stream,
            "duration_s": opts.duration_s + opts.omit_s,
            "interval_ms": opts.interval_ms,
            "probe_bytes": opts.probe_bytes,
        }
        self.thread = threading.Thread(target=self._run, args=(session, kwargs), daemon=True)

    def _run(self, session: ProbeSession, kwargs: dict[str, Any]) -> None:
        try:
            self.result = phases.run_probes(session, **kwargs)
        except BaseException as exc:
            self.result = exc

    def __enter__(self) -> _LoadedProbes:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.thread.join()


def _throughput_phase(
    session: ProbeSession, opts: ProbeOptions, report: dict[str, Any], progress: Progress
) -> None:
    counts = sorted({1, opts.streams})
    loaded = "loaded" in opts.phases
    runs: list[phases.ThroughputRun] = []
    loaded_runs: dict[str, phases.ProbeRun] = {}
    for direction in ("up", "down"):
        for streams in counts:
            progress("throughput", f"TCP {direction} x{streams} ({opts.duration_s:g} s + omit)")
            prober = None
            if loaded and streams == counts[-1]:
                prober = _LoadedProbes(session, opts, 2 if direction == "up" else 3)
            with prober or contextlib.nullcontext():
                run = _goodput(session, opts, direction, streams)
            runs.append(run)
            if prober is not None:
                if isinstance(prober.result, BaseException):
                    raise prober.result
                assert prober.result is not None
                loaded_runs[direction] = prober.result
            state = "converged" if run.converged else "did NOT converge"
            progress(
                "throughput",
                f"{direction} x{streams}: {run.gbps:.3f} Gbps ±{run.ci95_pct:.1f} % ({state})",
            )
    report["throughput"] = _throughput_summary(runs)
    if loaded_runs:
        _loaded_summary(loaded_runs, report, progress)


def _goodput(
    session: ProbeSession, opts: ProbeOptions, direction: str, streams: int
) -> phases.ThroughputRun:
    return phases.measure_goodput(
        session,
        direction=direction,
        streams=streams,
        duration_s=opts.duration_s,
        omit_s=opts.omit_s,
        interval_s=opts.sample_interval_s,
        ci_target_pct=opts.ci_target_pct,
        max_duration_s=_goodput_cap(opts),
        max_bytes=opts.max_test_bytes,
    )


def _goodput_cap(opts: ProbeOptions) -> float:
    """Seconds one throughput test may take, repeats included."""
    return opts.max_duration_s or 3 * (opts.duration_s + opts.omit_s)


def _throughput_summary(runs: list[phases.ThroughputRun]) -> dict[str, Any]:
    best = {}
    for direction in ("up", "down"):
        mine = [r for r in runs if r.direction == direction]
        best[direction] = max(mine, key=lambda r: r.gbps)
    return {
        "up_gbps": best["up"].gbps,
        "down_gbps": best["down"].gbps,
        "ci95_pct": max(best["up"].ci95_pct, best["down"].ci95_pct),
        "converged": all(r.converged for r in best.values()),
        "up_streams": best["up"].streams,
        "down_streams": best["down"].streams,
        "runs": [asdict(r) for r in runs],
    }


def _loaded_summary(
    loaded_runs: dict[str, phases.ProbeRun], report: dict[str, Any], progress: Progress
) -> None:
    rtts = [ns / 1e6 for run in loaded_runs.values() for ns in run.rtt_ns_by_seq.values()]
    if not rtts:
        return
    s = summarize(rtts)
    by_direction: dict[str, dict[str, float | None]] = {}
    for direction, run in loaded_runs.items():
        if run.received == 0:  # every probe lost under load: a result, not a failure
            by_direction[direction] = {"p50": None, "p99": None, "loss": 100.0}
            continue
        result = phases.summarize_probes(run)
        by_direction[direction] = {
            "p50": result.rtt_ms["p50"],
            "p99": result.rtt_ms["p99"],
            "loss": result.loss["round_trip"],
        }
        report["jitter_ms"]["rfc3550_under_load"] = max(
            report["jitter_ms"]["rfc3550_under_load"] or 0.0, result.jitter_ms
        )
    report["rtt_under_load_ms"] = {
        "p50": s.p50,
        "p90": s.p90,
        "p99": s.p99,
        "max": s.max,
        "mean": s.mean,
        "samples": s.count,
        "by_direction": by_direction,
    }
    progress("loaded", f"RTT under load p50 {s.p50:.3f} ms p99 {s.p99:.3f} ms")


def _chunk_phase(
    session: ProbeSession, opts: ProbeOptions, report: dict[str, Any], progress: Progress
) -> None:
    progress("chunks", f"KV chunk sweep over {opts.chunk_transport}")

    def each(result: Any) -> None:
        progress(
            "chunks",
            f"{human_bytes(result.chunk_bytes)}: {result.gbps:.3f} Gbps, "
            f"p50 {result.p50_ms:.2f} ms p99 {result.p99_ms:.2f} ms",
        )

    sweep = run_chunk_sweep(
        session,
        list(opts.chunk_sizes),
        transport=opts.chunk_transport,
        seconds=opts.chunk_seconds,
        window=opts.chunk_window,
        on_size=each,
    )
    report["chunks"] = [asdict(c) for c in sweep.chunks]
    limit_ms = opts.rules.chunk_p99_limit_ms
    chosen = choose_chunk(report["chunks"], max_p99_ms=limit_ms)
    report["chunk_recommended_bytes"] = chosen
    if limit_ms is not None:
        within = f"p99 within {limit_ms:g} ms: chunk_p99"
        said = f"recommended {human_bytes(chosen)} ({within})" if chosen else (
            f"none recommended: no size passes ({within})")  # fmt: skip
        progress("chunks", said)


# Which sysctl caps a window-limited stream, by what limited its sender (see pdx.tcp).
_CAPS = {
    ("up", "send buffer"): ("client", "net.ipv4.tcp_wmem", "tcp_wmem_max"),
    ("up", "receive window"): ("server", "net.ipv4.tcp_rmem", "tcp_rmem_max"),
    ("down", "send buffer"): ("server", "net.ipv4.tcp_wmem", "tcp_wmem_max"),
    ("down", "receive window"): ("client", "net.ipv4.tcp_rmem", "tcp_rmem_max"),
}


def tcp_summary(session: ProbeSession, report: dict[str, Any]) -> dict[str, Any]:
    """Congestion control of both ends, the path's BDP, and whether one stream is capped by
    socket buffers (the sysctl that caps it and a value that would not)."""
    client = tcp_facts()
    server = session.server_tcp
    out: dict[str, Any] = {"client": client, "server": server, "bdp_bytes": None,
                           "rtt_ms": None, "single_stream": {}}  # fmt: skip
    tp = report.get("throughput")
    rtt = (report.get("rtt_ms") or {}).get("p50")
    if not tp:
        return out
    if rtt is None:  # no idle-latency phase: the senders' own minimum RTT
        mins = [t["min_rtt_ms"] for r in tp["runs"] for t in r["sender_tcp"] if t["min_rtt_ms"]]
        rtt = min(mins) if mins else None
    if rtt is None:
        return out
    best_gbps = max(tp["up_gbps"], tp["down_gbps"])
    bdp = bdp_bytes(best_gbps * 1e9, rtt)
    out.update(rtt_ms=rtt, bdp_bytes=bdp)
    ends = {"client": client, "server": server or {}}
    for direction in ("up", "down"):
        single = [r for r in tp["runs"] if r["direction"] == direction and r["streams"] == 1]
        if not single:
            continue
        run = single[0]
        senders = [TcpInfo.from_dict(t) for t in run["sender_tcp"]]
        limited = next((t.limited_by for t in senders if t.limited_by), None)
        evidence = "TCP_INFO sndbuf/rwnd-limited time" if limited else None
        if limited is None:
            limited = _inferred_limit(direction, run, tp, rtt, ends)
            evidence = "window near the buffer sysctl, more streams go faster" if limited else None
        entry: dict[str, Any] = {
            "gbps": run["gbps"],
            "window_bytes": bdp_bytes(run["gbps"] * 1e9, rtt),
            "congestion_control": next(
                (t["congestion_control"] for t in run["sender_tcp"] if t.get("congestion_control")),
                None,
            ),
            "retransmits": sum(t["total_retrans"] for t in run["sender_tcp"]),
            "limited_by": limited,
            "evidence": evidence,
            "capped_by_buffers": limited is not None,
            "cap": None,
        }
        if limited is not None:
            end, sysctl, key = _CAPS[(direction, limited)]
            value = (ends[end].get("buffers") or {}).get(key)
            entry["cap"] = {"end": end, "sysctl": sysctl, "max_bytes": value,
                            "would_not_cap_bytes": window_for(bdp)}  # fmt: skip
        out["single_stream"][direction] = entry
    return out


def _inferred_limit(
    direction: str, run: dict[str, Any], tp: dict[str, Any], rtt_ms: float,
    ends: dict[str, dict[str, Any]],
) -> str | None:  # fmt: skip
    """When TCP_INFO did not say (a sender that waits in poll() is never counted as send-buffer
    limited): one stream is buffer-capped if its window is close to what the sysctl lets a
    socket hold while several streams reach more."""
    best = max(r["gbps"] for r in tp["runs"] if r["direction"] == direction)
    if best < 1.3 * run["gbps"]:
        return None
    window = bdp_bytes(run["gbps"] * 1e9, rtt_ms)
    sender, receiver = ("client", "server") if direction == "up" else ("server", "client")
    wmem = (ends[sender].get("buffers") or {}).get("tcp_wmem_max")
    rmem = (ends[receiver].get("buffers") or {}).get("tcp_rmem_max")
    if wmem and window >= 0.4 * wmem:
        return "send buffer"
    if rmem and window >= 0.4 * rmem:
        return "receive window"
    return None


STREAM_SHARE = 0.95
"""kv.streams: the fewest measured streams whose goodput is within 5 % of the best measured."""
KV_DIRECTIONS = {"up": ("up",), "down": ("down",), "both": ("up", "down")}
"""Which goodput direction carries the KV, by ``--kv-direction``: up = probe-link's host sends
it to the probe server's host, down = the other way."""
MAX_KV_STREAMS = 16  # what pdx deploy's kv.streams accepts


def recommend(
    report: dict[str, Any], kv_direction: str = "both", chunk_p99_limit_ms: float | None = None
) -> dict[str, Any] | None:
    """Deploy settings for the measured link, as ``pdx deploy --set`` takes them: the fewest
    streams that reach the best measured goodput in the KV direction(s), the chunk size the
    sweep chose (one that passes the chunk rule when a TTFT budget is given), the link rate
    (socket buffers are then sized to its BDP), and the sysctls that cap a stream."""
    tp, tcp = report.get("throughput"), report.get("tcp") or {}
    if not tp:
        return None
    best = max(tp["up_gbps"], tp["down_gbps"])
    interval_s = float((report.get("settings") or {}).get("sample_interval_s") or 0.1)
    streams = stream_advice(tp.get("runs") or [], kv_direction, interval_s=interval_s)
    single = tcp.get("single_stream") or {}
    capped = [f"one {d} stream is window-capped: the sysctl advice lets one carry more"
              for d in KV_DIRECTIONS[kv_direction]
              if (single.get(d) or {}).get("capped_by_buffers")]  # fmt: skip
    streams["why"] = "; ".join([streams["why"], *capped])
    sets: dict[str, Any] = {}
    if streams["streams"] is not None:
        sets["kv.streams"] = min(MAX_KV_STREAMS, streams["streams"])
    sets["kv.link_gbps"] = round(best, 3)
    chunk = report.get("chunk_recommended_bytes")
    if chunk:
        sets["kv.chunk_size_kb"] = max(64, min(8192, int(chunk) // 1024))
    sysctls = {}
    for s in single.values():
        cap = s.get("cap")
        if cap:
            sysctls[f"{cap['end']} {cap['sysctl']}"] = f"4096 131072 {cap['would_not_cap_bytes']}"
    from pdx.errors import PdxError
    from pdx.link.vllm_advice import vllm_settings

    try:
        peer: str | None = parse_target(str(report.get("target") or ""))[0]
    except PdxError:  # a report without a usable target: no interface to name
        peer = None
    return {"set": sets, "sysctl": sysctls, "why": streams["why"], "streams": streams,
            "chunk": chunk_advice(report, chunk_p99_limit_ms),
            "vllm": vllm_settings(report, peer)}  # fmt: skip


def stream_advice(
    runs: list[dict[str, Any]],
    kv_direction: str,
    share: float = STREAM_SHARE,
    interval_s: float = 0.1,
) -> dict[str, Any]:
    """``kv.streams`` from the measured 1- and N-stream goodput (``throughput.runs[]``): in each
    direction the fewest streams within ``share`` of that direction's best; the KV direction
    decides (``both``: the larger of the two). ``streams`` is None without runs."""
    by_direction = {d: _fewest_streams(runs, d, share) for d in ("up", "down")}
    chosen = {d: c["streams"] for d, c in by_direction.items() if c is not None}
    counted = [d for d in KV_DIRECTIONS[kv_direction] if d in chosen]
    streams = max((chosen[d] for d in counted), default=None)
    out = {"streams": streams, "kv_direction": kv_direction, "share": share,
           "by_direction": by_direction}  # fmt: skip
    return out | {"why": _streams_why(out, counted, interval_s)}


def _fewest_streams(
    runs: list[dict[str, Any]], direction: str, share: float
) -> dict[str, Any] | None:
    mine = sorted((r for r in runs if r["direction"] == direction), key=lambda r: r["streams"])
    if not mine:
        return None
    best = max(r["gbps"] for r in mine)
    chosen = next(r for r in mine if r["gbps"] >= share * best)
    return {"streams": chosen["streams"], "best_gbps": best,
            "runs": [_stream_figure(r) for r in mine]}  # fmt: skip


def _stream_figure(run: dict[str, Any]) -> dict[str, Any]:
    """One test's goodput with its 95 % interval (from its samples when the run lacks it)."""
    samples = run.get("intervals_gbps")
    interval = run.get("ci95_gbps")
    if interval is None and samples:
        ci = mean_ci95(samples)
        interval = [ci.low, ci.high] if math.isfinite(ci.half_width) else None
    return {"streams": run["streams"], "gbps": run["gbps"], "ci95_gbps": interval,
            "samples": len(samples) if samples else None}  # fmt: skip


def _streams_why(advice: dict[str, Any], counted: list[str], interval_s: float) -> str:
    n = advice["streams"]
    if n is None:
        return "no 1- and N-stream goodput in the report: kv.streams not advised"
    share = f"{1 - advice['share']:.0%}"
    kv = f"{' and '.join(counted)} (the KV direction, --kv-direction {advice['kv_direction']})"
    parts = [f"×{n}: the fewest streams within {share} of the best goodput measured {kv}"]
    for direction, choice in advice["by_direction"].items():
        if choice is not None:
            role = "" if direction in counted else " (not the KV direction)"
            text = ", ".join(_figure_text(f) for f in choice["runs"])
            parts.append(f"{direction}{role} {text} Gbit/s → ×{choice['streams']}")
    figures = [f for c in advice["by_direction"].values() if c for f in c["runs"]]
    parts.append(_sample_text(figures, interval_s))
    most = max(f["streams"] for f in figures)
    if n == most > 1:
        parts.append(f"more than ×{most} was not measured (--streams)")
    if n > MAX_KV_STREAMS:
        parts.append(f"kv.streams takes at most {MAX_KV_STREAMS}")
    return "; ".join(parts)


def _sample_text(figures: list[dict[str, Any]], interval_s: float) -> str:
    """What the bracketed intervals are, and which figures have none."""
    counts = sorted({f["samples"] for f in figures if f["samples"]})
    many = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}" if counts else "its"
    text = f"[low-high]: 95 % CI of a test's mean over its {many} {interval_s:g} s samples"
    if any(f["ci95_gbps"] is None for f in figures):
        text += " (a figure without one is a single mean, with no interval)"
    return text


def _figure_text(figure: dict[str, Any]) -> str:
    ci = figure["ci95_gbps"]
    interval = f" [{ci[0]:.3f}-{ci[1]:.3f}]" if ci else ""
    return f"×{figure['streams']} {figure['gbps']:.3f}{interval}"


def chunk_advice(report: dict[str, Any], limit_ms: float | None) -> dict[str, Any] | None:
    """The chunk size the report recommends, and why (None without a chunk sweep)."""
    chunks = report.get("chunks") or []
    if not chunks:
        return None
    chosen = report.get("chunk_recommended_bytes")
    best = max(chunks, key=lambda c: c["gbps"])
    near = f"within {CHUNK_GOODPUT_SHARE:.0%} of the best goodput"
    if limit_ms is None:
        why = (f"{_size(chosen)}: the smallest size {near} ({_size(best['chunk_bytes'])}, "
               f"{best['gbps']:.3f} Gbit/s); no TTFT budget, so no p99 was judged")  # fmt: skip
    elif chosen is None:
        nearest = min(chunks, key=lambda c: c["p99_ms"])
        why = (f"none: no swept size's p99 is within {limit_ms:g} ms (chunk_p99); the nearest "
               f"is {_size(nearest['chunk_bytes'])} at {nearest['p99_ms']:.1f} ms")  # fmt: skip
    else:
        passing = [c for c in chunks if c["p99_ms"] <= limit_ms]
        listed = ", ".join(f"{_size(c['chunk_bytes'])} {c['p99_ms']:.1f} ms" for c in passing)
        why = (f"{_size(chosen)}: the smallest size {near} among those whose p99 is within "
               f"{limit_ms:g} ms (chunk_p99: {listed})")  # fmt: skip
        if best not in passing:
            why += (f"; {_size(best['chunk_bytes'])} moved the most ({best['gbps']:.3f} Gbit/s) "
                    f"but its p99 is {best['p99_ms']:.1f} ms")  # fmt: skip
    return {"bytes": chosen, "max_p99_ms": limit_ms, "why": why}


def _size(n: int | None) -> str:
    return "none" if n is None else human_bytes(int(n))
