"""``pdx link-watch``: keep measuring a link after go-live and export it to Prometheus."""

from __future__ import annotations

import json
import signal
from typing import Any

import typer

from pdx.cli.output import to_jsonable
from pdx.cli.probe import VERDICT_EXIT_CODES, _check_range, _secret, parse_sizes
from pdx.errors import InputError, MeasurementError


def link_watch(
    target: str = typer.Argument(..., help="The probe server (pdx probe-server), HOST:PORT."),
    secret: str | None = typer.Option(
        None, "--secret", envvar="PDX_PROBE_SECRET", help="The server's shared secret."
    ),
    window: float = typer.Option(10.0, "--window", help="Seconds of UDP probes per window."),
    interval_ms: float = typer.Option(50.0, "--interval-ms", help="UDP probe spacing."),
    probe_bytes: int = typer.Option(64, "--probe-bytes", help="UDP probe size (64-1472)."),
    judge_window: float = typer.Option(
        300.0, "--judge-window", help="Seconds of probes the rules judge (rolling)."
    ),
    goodput_every: float = typer.Option(
        60.0, "--goodput-every", help="Seconds between goodput samples (0: none; at least 60)."
    ),
    goodput_bytes: str = typer.Option(
        "8MiB", "--goodput-bytes", help="Most bytes one goodput sample moves."
    ),
    goodput_seconds: float = typer.Option(2.0, "--goodput-seconds", help="Longest goodput sample."),
    streams: int = typer.Option(1, "--streams", help="TCP streams of a goodput sample."),
    direction: str = typer.Option(
        "up", "--direction", help="Goodput sample sent by this host (up) or the server (down)."
    ),
    mtu_every: float = typer.Option(
        600.0, "--mtu-every", help="Seconds between path-MTU searches (0: none; at least 60)."
    ),
    mtu_max: int = typer.Option(9000, "--mtu-max", help="Largest packet the MTU search tries."),
    duration: float | None = typer.Option(
        None, "--duration", help="Stop after this many seconds (default: until Ctrl-C/SIGTERM)."
    ),
    max_bytes_per_min: str = typer.Option(
        "16MiB", "--max-bytes-per-min", help="Refuse a plan that sends more per minute."
    ),
    metrics_bind: str = typer.Option(
        "127.0.0.1", "--metrics-bind", help="Address of the /metrics endpoint."
    ),
    metrics_port: int = typer.Option(
        9478, "--metrics-port", help="Port of the /metrics endpoint (0: any free port; -1: none)."
    ),
    kv_gbps: float | None = typer.Option(None, "--kv-gbps", help="KV demand, Gbit/s."),
    ttft_budget_ms: float | None = typer.Option(
        None, "--ttft-budget-ms", help="TTFT budget (the RTT rule's basis)."
    ),
    bandwidth_share: float = typer.Option(0.70, "--bandwidth-share", help="Max KV/goodput."),
    rtt_share: float = typer.Option(0.20, "--rtt-share", help="Max RTT p99/TTFT budget."),
    max_loss_pct: float = typer.Option(0.1, "--max-loss-pct", help="Max loss, percent."),
    connect_timeout: float = typer.Option(5.0, "--connect-timeout", help="Seconds to connect."),
    as_json: bool = typer.Option(
        False, "--json", help="One JSON object per window on stdout, then the summary."
    ),
) -> None:
    """Keep measuring a link within a byte budget: RTT, loss, jitter, goodput and MTU as
    Prometheus series, judged over a rolling window by probe-link's rules.

    Exit (when it stops) 0 GO, 1 NO-GO, 3 INCONCLUSIVE over the last judged window; 2 error or
    no window measured the link.
    """
    from pdx.link.verdict import VerdictRules
    from pdx.link.watch import LinkWatch, WatchOptions

    _check_range("--window", window, 0.1, 3600)
    _check_range("--interval-ms", interval_ms, 1, 60_000)
    _check_range("--probe-bytes", probe_bytes, 64, 1472)
    _check_range("--judge-window", judge_window, 0.1, 86_400)
    for name, every in (("--goodput-every", goodput_every), ("--mtu-every", mtu_every)):
        if every != 0:
            _check_range(name, every, 60, 86_400)
    _check_range("--goodput-seconds", goodput_seconds, 0.1, 60)
    _check_range("--streams", streams, 1, 16)
    _check_range("--mtu-max", mtu_max, 576, 65535)
    _check_range("--metrics-port", metrics_port, -1, 65535)
    _check_range("--connect-timeout", connect_timeout, 0.1, 600)
    _check_range("--max-loss-pct", max_loss_pct, 0, 100)
    for name, share in (("--bandwidth-share", bandwidth_share), ("--rtt-share", rtt_share)):
        _check_range(name, share, 0.001, 1.0)
    if duration is not None:
        _check_range("--duration", duration, 0.1, 31 * 86_400)
    if kv_gbps is not None:
        _check_range("--kv-gbps", kv_gbps, 0, 1e6)
    if ttft_budget_ms is not None:
        _check_range("--ttft-budget-ms", ttft_budget_ms, 0.001, 3.6e6)
    opts = WatchOptions(
        target=target,
        secret=_secret(secret),
        window_s=window,
        interval_ms=interval_ms,
        probe_bytes=probe_bytes,
        loss_window_s=judge_window,
        goodput_every_s=goodput_every,
        goodput_bytes=_one_size("--goodput-bytes", goodput_bytes),
        goodput_s=goodput_seconds,
        goodput_streams=streams,
        direction=direction,
        mtu_every_s=mtu_every,
        mtu_max=mtu_max,
        duration_s=duration,
        max_bytes_per_min=_one_size("--max-bytes-per-min", max_bytes_per_min),
        connect_timeout_s=connect_timeout,
        rules=VerdictRules(
            kv_gbps=kv_gbps,
            ttft_budget_ms=ttft_budget_ms,
            bandwidth_share=bandwidth_share,
            rtt_share=rtt_share,
            max_loss_pct=max_loss_pct,
            kv_direction=direction,
        ),
    )
    watch = LinkWatch(opts)
    plan = watch.plan
    typer.echo(
        f"link-watch {target}: {window:g} s windows, probes every {interval_ms:g} ms, rules over "
        f"{judge_window:g} s; sends at most {plan['total']:,} B/min (probes {plan['probes']:,}, "
        f"goodput {plan['goodput']:,}, mtu {plan['mtu']:,}, control {plan['control']:,})",
        err=True,
    )
    server = _metrics_server(watch, metrics_bind, metrics_port)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: watch.stop())
    try:
        summary = watch.run(lambda record: _print_window(record, as_json))
    finally:
        if server is not None:
            server.shutdown()
    _print_summary(summary, as_json)
    if summary["windows"] == summary["failed_windows"]:
        raise MeasurementError(f"no window measured the link to {target}")
    raise typer.Exit(VERDICT_EXIT_CODES[summary["verdict"]["result"]])


def _one_size(field: str, text: str) -> int:
    sizes = parse_sizes(text, field, most=1024**4) if "," not in text else []
    if len(sizes) != 1:
        raise InputError(field, text, "one size like 8MiB, 512KiB or plain bytes")
    return sizes[0]


def _metrics_server(watch: Any, bind: str, port: int) -> Any:
    """Serve ``/metrics`` from the watch's registry (prometheus_client's own server)."""
    if port < 0:
        return None
    from prometheus_client import start_http_server

    try:
        server, _thread = start_http_server(port, bind, registry=watch.metrics.registry)
    except OSError as exc:
        raise InputError(
            "--metrics-port", port, f"a free port on {bind} ({exc.strerror})"
        ) from None
    typer.echo(f"metrics on http://{bind}:{server.server_port}/metrics", err=True)
    return server


def _print_window(record: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(to_jsonable(record)), flush=True)
        return
    if record["error"] is not None:
        typer.echo(f"window failed: {record['error']}")
        return
    rtt = record["rtt_ms"] or {}
    judged = record["judged"]
    rules = ", ".join(
        f"{name} {r['status']}" for name, r in judged["rules"].items() if r["status"] != "skip"
    )
    typer.echo(
        f"probes {record['probes']} lost up {record['lost']['up']} down {record['lost']['down']}"
        f" · RTT p50 {rtt.get('p50', float('nan')):.2f} p99 {rtt.get('p99', float('nan')):.2f} ms"
        f" · jitter {record['jitter_ms']} ms"
        + _goodput_text(record)
        + (f" · MTU {record['mtu']}" if record["mtu"] else "")
        + (" (--mtu-max)" if record.get("mtu_capped") else "")
        + f" · {judged['seconds']:g} s judged: {judged['result']} ({rules})"
        + "".join(f" · {note}" for note in record["notes"])
    )


def _goodput_text(record: dict[str, Any]) -> str:
    if record["goodput_gbps"] is None:
        return ""
    bound = " (at least: the byte cap ended it)" if record["goodput_capped"] else ""
    return f" · goodput {record['goodput_gbps']:.3f} Gbit/s{bound}"


def _print_summary(summary: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps({"summary": to_jsonable(summary)}), flush=True)
        return
    sent = summary["sent_bytes"]
    budget = summary["budget_bytes_per_min"]["total"]
    typer.echo(
        f"stopped after {summary['elapsed_s']:.0f} s: {summary['windows']} windows "
        f"({summary['failed_windows']} failed), sent {sent['total']:,} B, busiest minute "
        f"{summary['busiest_minute_bytes']:,} B (budget {budget:,} B/min); "
        f"verdict {summary['verdict']['result']}"
    )


def register(app: typer.Typer) -> None:
    """Add ``link-watch`` to the ``pdx`` app."""
    app.command("link-watch")(link_watch)
