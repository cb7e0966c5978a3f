"""``pdx probe-server`` and ``pdx probe-link``: measure a link for KV traffic and judge it."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.table import Table

from pdx.cli.output import emit, err_console
from pdx.errors import InputError
from pdx.units import KIB, MIB, human_bytes

if TYPE_CHECKING:
    from pdx.link.probe import ProbeOptions

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]i?B?|B)?\s*$", re.IGNORECASE)
_FACTORS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "KIB": KIB, "KI": KIB, "M": 1000**2}
_FACTORS |= {"MB": 1000**2, "MIB": MIB, "MI": MIB, "G": 1000**3, "GB": 1000**3}
_FACTORS |= {"GIB": 1024**3, "GI": 1024**3}


def parse_sizes(text: str, field: str = "--chunk-sizes", most: int = 64 * MIB) -> list[int]:
    """``256KiB,1MiB,4MB,1048576`` into byte counts (KiB/MiB binary, KB/MB decimal)."""
    sizes = []
    for part in text.split(","):
        match = _SIZE.match(part)
        if not match:
            raise InputError(field, part, "sizes like 256KiB, 1MiB, 4MB or plain bytes")
        value = float(match.group(1)) * _FACTORS[(match.group(2) or "").upper()]
        sizes.append(int(value))
    if any(s < 1 or s > most for s in sizes):
        raise InputError(field, text, f"every size between 1 byte and {human_bytes(most)}")
    return sizes


def _secret(text: str | None) -> bytes | None:
    return text.encode() if text else None


def _check_range(field: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise InputError(field, value, f"a value between {low:g} and {high:g}")


def probe_server(
    bind: str = typer.Option("127.0.0.1", "--bind", help="Address to listen on (0.0.0.0: all)."),
    port: int = typer.Option(5301, "--port", help="TCP control/data port (0: any free port)."),
    udp_port: int | None = typer.Option(
        None, "--udp-port", help="UDP reflector port (default: the TCP port's number)."
    ),
    secret: str | None = typer.Option(
        None, "--secret", envvar="PDX_PROBE_SECRET", help="Shared secret: HMAC on every message."
    ),
    max_test_s: float = typer.Option(60.0, "--max-test-s", help="Longest data test served."),
    max_sessions: int = typer.Option(64, "--max-sessions", help="Clients served at once."),
    max_connections_per_peer: int = typer.Option(
        128, "--max-connections-per-peer", help="TCP connections one client address may hold."
    ),
    max_data_connections: int = typer.Option(
        16, "--max-data-connections", help="Data connections (streams) one session may open."
    ),
    max_session_gb: float = typer.Option(
        64.0, "--max-session-gb", help="Bytes one session may move, all its streams, GB (1e9)."
    ),
    anonymous_data_connections: int = typer.Option(
        4,
        "--anonymous-data-connections",
        help="Without --secret: data connections a session may open at once (at most its plan).",
    ),
    anonymous_session_gb: float = typer.Option(
        16.0,
        "--anonymous-session-gb",
        help="Without --secret: GB (1e9) one session may move (at most its plan's seconds at "
        "--anonymous-gbps).",
    ),
    anonymous_gbps: float = typer.Option(
        40.0,
        "--anonymous-gbps",
        help="Without --secret: Gbit/s a session may move per second of tests it planned.",
    ),
) -> None:
    """Serve probe-link clients: TCP control and data, UDP reflector. Runs until Ctrl-C."""
    import asyncio

    from pdx.link.server import ProbeServer, ServerLimits, serve

    _check_range("--port", port, 0, 65535)
    if udp_port is not None:
        _check_range("--udp-port", udp_port, 0, 65535)
    _check_range("--max-test-s", max_test_s, 0.1, 3600)
    _check_range("--max-sessions", max_sessions, 1, 10_000)
    _check_range("--max-connections-per-peer", max_connections_per_peer, 2, 100_000)
    _check_range("--max-data-connections", max_data_connections, 1, 1024)
    _check_range("--max-session-gb", max_session_gb, 0.001, 100_000)
    _check_range("--anonymous-data-connections", anonymous_data_connections, 1, 1024)
    _check_range("--anonymous-session-gb", anonymous_session_gb, 0.001, 100_000)
    _check_range("--anonymous-gbps", anonymous_gbps, 0.001, 100_000)
    limits = ServerLimits(
        max_test_s=max_test_s,
        max_sessions=max_sessions,
        max_connections_per_peer=max_connections_per_peer,
        max_data_connections_per_session=max_data_connections,
        max_session_bytes=int(max_session_gb * 1e9),
        anonymous_data_connections=anonymous_data_connections,
        anonymous_session_bytes=int(anonymous_session_gb * 1e9),
        anonymous_gbps=anonymous_gbps,
    )
    server = ProbeServer(bind, port, udp_port=udp_port, secret=_secret(secret), limits=limits)

    def ready(s: ProbeServer) -> None:
        auth = "with secret" if s.secret else "no secret"
        typer.echo(f"probe-server listening on {s.bind} tcp {s.tcp_port} udp {s.udp_port} ({auth})")

    try:
        asyncio.run(serve(server, ready))
    except OSError as exc:
        raise InputError("--port", port, f"a free port on {bind} ({exc.strerror})") from None


def probe_link(
    target: str = typer.Argument(..., help="The probe server, HOST:PORT."),
    duration: float = typer.Option(5.0, "--duration", help="Seconds per latency/throughput test."),
    interval_ms: float = typer.Option(10.0, "--interval-ms", help="UDP probe interval."),
    streams: int = typer.Option(4, "--streams", help="Parallel TCP streams (also runs 1)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    secret: str | None = typer.Option(
        None, "--secret", envvar="PDX_PROBE_SECRET", help="Shared secret of the server."
    ),
    phases: str = typer.Option(
        "latency,throughput,loaded,mtu,chunks", "--phases", help="Phases to run."
    ),
    omit: float = typer.Option(0.5, "--omit", help="Seconds of slow start left out."),
    ci_target_pct: float = typer.Option(5.0, "--ci-target-pct", help="Goal ±% of the 95 % CI."),
    max_duration: float | None = typer.Option(
        None, "--max-duration", help="Cap per throughput test (default 3x(duration+omit))."
    ),
    probe_bytes: int = typer.Option(64, "--probe-bytes", help="UDP probe size."),
    chunk_sizes: str = typer.Option(
        "256KiB,1MiB,2MiB,4MiB,8MiB", "--chunk-sizes", help="KV chunk sizes to sweep."
    ),
    chunk_seconds: float = typer.Option(1.0, "--chunk-seconds", help="Seconds per chunk size."),
    chunk_window: int = typer.Option(2, "--chunk-window", help="Chunks in flight."),
    chunk_transport: str = typer.Option(
        "tcp", "--chunk-transport", help="Chunk transport: tcp (probe server) or grpc (KV store)."
    ),
    kv_target: str | None = typer.Option(
        None, "--kv-target", help="KV store HOST:PORT for --chunk-transport grpc."
    ),
    kv_op: str = typer.Option("get", "--kv-op", help="get (decode's direction) or put."),
    tls_dir: Path | None = typer.Option(
        None, "--tls-dir", help="Mutual TLS to the KV store with DIR/ca.pem, DIR/NAME.{pem,key}."
    ),
    tls_name: str = typer.Option("decode", "--tls-name", help="Client identity NAME in --tls-dir."),
    kv_gbps: float | None = typer.Option(None, "--kv-gbps", help="Peak KV demand in Gbps."),
    kv_report: Path | None = typer.Option(
        None, "--kv-report", help="A `pdx measure-kv --json` output (with --qps)."
    ),
    qps: float | None = typer.Option(
        None, "--qps", help="Requests/s that turn --kv-report's kv_bytes into a demand."
    ),
    seq: int | None = typer.Option(
        None, "--seq", help="Row of --kv-report by sequence length (default: largest kv_bytes)."
    ),
    kv_direction: str = typer.Option(
        "up",
        "--kv-direction",
        help="Which way the KV crosses: up (this host sends it to the probe server's host), "
        "down (the server's host sends it here) or both. Sets the goodput the kv_bandwidth rule "
        "uses (both: the smaller) and the direction whose 1- vs N-stream goodput sets kv.streams "
        "(both: the larger count). probe-link on the decode host, server at prefill: down.",
    ),
    ttft_budget_ms: float | None = typer.Option(None, "--ttft-budget-ms", help="TTFT budget."),
    bandwidth_share: float = typer.Option(0.70, "--bandwidth-share", help="Max KV/bandwidth."),
    rtt_share: float = typer.Option(0.20, "--rtt-share", help="Max RTT p99/TTFT budget."),
    max_loss_pct: float = typer.Option(0.1, "--max-loss-pct", help="Max loss, percent."),
    chunk_share: float = typer.Option(0.15, "--chunk-share", help="Max chunk p99/TTFT budget."),
    jitter_share: float = typer.Option(
        0.5, "--jitter-share", help="Max jitter / RTT p50 (at least 1 ms)."
    ),
    min_mtu: int = typer.Option(1280, "--min-mtu", help="Least path MTU, bytes."),
    connect_timeout: float = typer.Option(5.0, "--connect-timeout", help="Seconds to connect."),
) -> None:
    """Measure bandwidth, RTT, loss, jitter, MTU and KV chunk times and judge the link.

    Exit 0 GO, 1 NO-GO, 3 INCONCLUSIVE (a rule the verdict needs was not given or not
    decided: --kv-gbps / --kv-report for bandwidth, --ttft-budget-ms for RTT), 2 error.
    """
    from pdx.link.probe import ALL_PHASES, ProbeOptions
    from pdx.link.probe import probe_link as run_probe
    from pdx.link.verdict import VerdictRules

    _check_range("--duration", duration, 0.1, 3600)
    _check_range("--interval-ms", interval_ms, 0.1, 10_000)
    _check_range("--streams", streams, 1, 128)
    _check_range("--omit", omit, 0, 60)
    _check_range("--ci-target-pct", ci_target_pct, 0.1, 100)
    _check_range("--probe-bytes", probe_bytes, 64, 65507)
    _check_range("--chunk-seconds", chunk_seconds, 0.01, 600)
    _check_range("--chunk-window", chunk_window, 1, 64)
    for name, share in (("--bandwidth-share", bandwidth_share), ("--rtt-share", rtt_share)):
        _check_range(name, share, 0.001, 1.0)
    _check_range("--chunk-share", chunk_share, 0.001, 1.0)
    _check_range("--jitter-share", jitter_share, 0.001, 10.0)
    _check_range("--min-mtu", min_mtu, 68, 65535)
    _check_range("--max-loss-pct", max_loss_pct, 0, 100)
    if max_duration is not None:
        _check_range("--max-duration", max_duration, 0.1, 3600)
    if ttft_budget_ms is not None:
        _check_range("--ttft-budget-ms", ttft_budget_ms, 0.001, 3.6e6)
    if kv_direction not in ("up", "down", "both"):
        raise InputError("--kv-direction", kv_direction, "one of up, down, both")
    wanted = [p.strip() for p in phases.split(",") if p.strip()]
    if not wanted or any(p not in ALL_PHASES for p in wanted):
        raise InputError("--phases", phases, f"a comma list from {','.join(ALL_PHASES)}")
    kv_gbps, kv_source = _kv_demand(kv_gbps, kv_report, qps, seq)
    opts = ProbeOptions(
        target=target,
        duration_s=duration,
        interval_ms=interval_ms,
        streams=streams,
        secret=_secret(secret),
        phases=tuple(wanted),
        probe_bytes=probe_bytes,
        omit_s=omit,
        ci_target_pct=ci_target_pct,
        max_duration_s=max_duration,
        chunk_sizes=tuple(parse_sizes(chunk_sizes)),
        chunk_seconds=chunk_seconds,
        chunk_window=chunk_window,
        chunk_transport=chunk_transport,
        connect_timeout_s=connect_timeout,
        rules=VerdictRules(
            kv_gbps=kv_gbps,
            ttft_budget_ms=ttft_budget_ms,
            bandwidth_share=bandwidth_share,
            rtt_share=rtt_share,
            max_loss_pct=max_loss_pct,
            chunk_share=chunk_share,
            jitter_share=jitter_share,
            min_mtu=min_mtu,
            kv_direction=kv_direction,
        ),
        kv_source=kv_source,
    )
    kv_sweep = _kv_sweep(opts, kv_target, kv_op, tls_dir, tls_name)
    progress_console = err_console()

    def progress(phase: str, message: str) -> None:
        progress_console.print(f"[dim]\\[{phase}][/dim] {message}")

    with kv_sweep:
        report = run_probe(opts, progress)
    emit(report, as_json=as_json, render=render_report)
    raise typer.Exit(VERDICT_EXIT_CODES[report["verdict"]["result"]])


VERDICT_EXIT_CODES = {"GO": 0, "NO-GO": 1, "INCONCLUSIVE": 3}

_NEEDS_KV_REPORT = {
    "--qps": "--kv-report with it: --qps turns a measure-kv report's kv_bytes per request into "
    "a demand (without a report, give the demand as --kv-gbps)",
    "--seq": "--kv-report with it: --seq picks a row of a measure-kv report",
}


def _kv_demand(
    kv_gbps: float | None, kv_report: Path | None, qps: float | None, seq: int | None
) -> tuple[float | None, str | None]:
    """The KV demand in Gbit/s and where it came from, from --kv-gbps or --kv-report + --qps."""
    from pdx.link.verdict import kv_demand_from_report

    if kv_report is None:
        for name, given in (("--qps", qps), ("--seq", seq)):
            if given is not None:  # never silently ignored: the demand would not be what was meant
                raise InputError(name, given, _NEEDS_KV_REPORT[name])
        if kv_gbps is None:
            return None, None
        _check_range("--kv-gbps", kv_gbps, 0, 1e6)
        return kv_gbps, "--kv-gbps"
    if kv_gbps is not None:
        raise InputError("--kv-report", str(kv_report), "either --kv-gbps or --kv-report")
    if qps is None:
        raise InputError("--qps", None, "a request rate to go with --kv-report")
    return kv_demand_from_report(kv_report, qps, seq)


def _kv_sweep(
    opts: ProbeOptions, kv_target: str | None, kv_op: str, tls_dir: Path | None, tls_name: str
) -> contextlib.AbstractContextManager[Any]:
    """The KV store the grpc chunk transport uses (checked to answer), or a no-op."""
    if opts.chunk_transport != "grpc":
        for name, value in (("--kv-target", kv_target), ("--tls-dir", tls_dir)):
            if value is not None:
                raise InputError(name, str(value), "only with --chunk-transport grpc")
        return contextlib.nullcontext()
    if kv_target is None:
        raise InputError("--kv-target", None, "HOST:PORT of a KV store for --chunk-transport grpc")
    from pdx.link.kv_transport import kv_chunk_transport, kv_sweep_settings

    settings = kv_sweep_settings(
        kv_target, kv_op, tls_dir, tls_name, list(opts.chunk_sizes), opts.connect_timeout_s
    )
    if "chunks" not in opts.phases:
        return contextlib.nullcontext()
    return kv_chunk_transport(settings)


def _fmt(value: Any, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render_report(console: Console, report: dict[str, Any]) -> None:
    """Final table: link figures, chunk sweep, verdict."""
    table = Table(title=f"link to {report['target']}", show_header=True)
    table.add_column("measure")
    table.add_column("value", justify="right")
    rtt, loaded, loss = report["rtt_ms"], report["rtt_under_load_ms"], report["loss"]
    if rtt:
        table.add_row("RTT p50 / p90 / p99 / p99.9 ms", _join(rtt, "p50", "p90", "p99", "p999"))
        table.add_row(
            "RTT min / mean / max / stddev ms", _join(rtt, "min", "mean", "max", "stddev")
        )
        table.add_row("jitter RFC 3550 ms", _fmt(report["jitter_ms"]["rfc3550"]))
        table.add_row("IPDV p50 / p99 ms", _join(report["ipdv_ms"], "p50", "p99"))
    if loss:
        table.add_row("loss up / down %", f"{loss['up']:.3f} / {loss['down']:.3f}")
        table.add_row(
            "probes / bursts / longest / reordered / dup",
            f"{loss['probes']} / {loss['bursts']} / {loss['max_burst']} / "
            f"{loss['reordered']} / {loss['duplicated']}",
        )
    if report["throughput"]:
        tp = report["throughput"]
        table.add_row("goodput up / down Gbps", f"{tp['up_gbps']:.3f} / {tp['down_gbps']:.3f}")
        state = "" if tp["converged"] else " (not converged)"
        table.add_row("goodput 95 % CI ±%", f"{tp['ci95_pct']:.1f}{state}")
    if loaded:
        table.add_row("RTT under load p50 / p99 ms", _join(loaded, "p50", "p99"))
    if report["mtu"]:
        table.add_row("path MTU bytes", str(report["mtu"]))
    _tcp_rows(table, report.get("tcp"))
    if table.row_count:  # empty when only the chunk sweep ran
        console.print(table)
    for note in _tcp_notes(report.get("tcp")):
        console.print(note, soft_wrap=True)
    rec = report.get("recommendations")
    if rec:
        sets = " ".join(f"--set {k}={v}" for k, v in rec["set"].items())
        console.print(f"recommended for pdx deploy: {sets}", soft_wrap=True)
        why = [
            ("kv.streams", rec.get("why")),
            ("kv.chunk_size_kb", (rec.get("chunk") or {}).get("why")),
        ]
        for key, text in why:
            if text:
                console.print(f"  - {key} {text}", soft_wrap=True, markup=False, highlight=False)
        if rec.get("vllm"):
            from pdx.link.vllm_advice import vllm_block

            console.print("recommended for vLLM (NIXL over UCX/TCP) on this link, both sites:",
                          soft_wrap=True)  # fmt: skip
            console.print(vllm_block(rec["vllm"]), soft_wrap=True, markup=False, highlight=False)
            for line in rec["vllm"]["why"]:
                console.print(f"  - {line}", soft_wrap=True, markup=False, highlight=False)
    if report["chunks"]:
        console.print(_chunk_table(report))
    console.print(_verdict_table(report["verdict"]))


def _tcp_rows(table: Table, tcp: dict[str, Any] | None) -> None:
    if not tcp:
        return
    server = (tcp.get("server") or {}).get("congestion_control") or "?"
    table.add_row(
        "TCP congestion control client / server",
        f"{tcp['client']['congestion_control']} / {server}",
    )
    if tcp.get("bdp_bytes"):
        table.add_row("bandwidth-delay product", human_bytes(tcp["bdp_bytes"]))
    for direction, s in tcp.get("single_stream", {}).items():
        state = f"capped: {s['limited_by']}" if s["capped_by_buffers"] else "not buffer-capped"
        table.add_row(
            f"1 stream {direction}: window / limit", f"{human_bytes(s['window_bytes'])} / {state}"
        )


def _tcp_notes(tcp: dict[str, Any] | None) -> list[str]:
    """One line per buffer-capped stream: the sysctl that caps it and a value that would not."""
    notes: list[str] = []
    if not tcp:
        return notes
    for direction, s in (tcp.get("single_stream") or {}).items():
        cap = s.get("cap")
        if not cap:
            continue
        now = human_bytes(cap["max_bytes"]) if cap["max_bytes"] else "?"
        want = cap["would_not_cap_bytes"]
        notes.append(
            f"one {direction} stream is capped by the {cap['end']}'s {cap['sysctl']} (max {now}); "
            f"on this path (BDP {human_bytes(tcp['bdp_bytes'])}) a max of {human_bytes(want)} "
            f'would not cap it: sysctl -w {cap["sysctl"]}="4096 131072 {want}" on the {cap["end"]}'
        )
    return notes


def _join(data: dict[str, Any], *keys: str) -> str:
    return " / ".join(_fmt(data.get(k)) for k in keys)


def _chunk_table(report: dict[str, Any]) -> Table:
    table = Table(title=f"KV chunks over {_transport_title(report)}")
    rule = _chunk_rule(report)
    judged = {s["chunk_bytes"]: s["status"].upper() for s in (rule or {}).get("sizes") or []}
    names = ["chunk", "Gbps", "p50 ms", "p99 ms", "chunks"] + (["chunk_p99"] if judged else [])
    for name in names:
        table.add_column(name, justify="right")
    for c in report["chunks"]:
        mark = " *" if c["chunk_bytes"] == report["chunk_recommended_bytes"] else ""
        row = [human_bytes(c["chunk_bytes"]) + mark, _fmt(c["gbps"]), _fmt(c["p50_ms"], 2),
               _fmt(c["p99_ms"], 2), str(c["count"])]  # fmt: skip
        table.add_row(*row, *([judged.get(c["chunk_bytes"], "-")] if judged else []))
    caption = "* recommended: smallest size within 90 % of the best goodput"
    if rule is not None and judged:
        caption += f" among those whose p99 passes chunk_p99 (≤ {rule['threshold']:g} ms)"
        if report["chunk_recommended_bytes"] is None:
            caption = (
                f"no size's p99 passes chunk_p99 (≤ {rule['threshold']:g} ms): none recommended"
            )
    table.caption = caption
    return table


def _chunk_rule(report: dict[str, Any]) -> dict[str, Any] | None:
    """The verdict's chunk_p99 rule when it was judged (None when skipped)."""
    rules = (report.get("verdict") or {}).get("rules") or []
    return next((r for r in rules if r["name"] == "chunk_p99" and r["status"] != "skip"), None)


def _transport_title(report: dict[str, Any]) -> str:
    detail = report["chunks"][0].get("transport_detail") or {}
    if "kv_target" not in detail:
        return str(report["chunk_transport"])
    tls = "mTLS" if detail["tls"] else "plaintext"
    way = "from" if detail["kv_op"] == "get" else "to"
    return f"grpc: KV {detail['kv_op']} {way} {detail['kv_target']}, {tls}, checksums verified"


def _verdict_table(verdict: dict[str, Any]) -> Table:
    table = Table(title=f"verdict: {verdict['result']} ({verdict['why']})")
    for name in ("rule", "status", "measured", "threshold", "margin"):
        table.add_column(name, no_wrap=True)
    notes = []
    for r in verdict["rules"]:
        unit = f" {r['unit']}"
        table.add_row(
            r["name"],
            r["status"].upper(),
            _fmt(r["measured"]) + unit,
            _fmt(r["threshold"]) + unit,
            _fmt(r["margin"]) + unit,
        )
        notes.append(f"{r['name']}: {r['detail']}")
    if verdict.get("judged") is not None:
        notes.append("judged: " + (", ".join(verdict["judged"]) or "none"))
    table.caption = "\n".join(notes)
    table.caption_justify = "left"
    return table


def register(app: typer.Typer) -> None:
    """Add ``probe-server`` and ``probe-link`` to the ``pdx`` app."""
    app.command("probe-server")(probe_server)
    app.command("probe-link")(probe_link)
