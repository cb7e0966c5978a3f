"""``pdx simulate``: colocated vs disaggregated serving, sweeps and sizing by simulation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from pdx.cli.output import emit
from pdx.errors import InputError
from pdx.units import bytes_per_s_to_gbps

_ROWS: tuple[tuple[str, str, str], ...] = (
    ("ttft_p50_s", "TTFT p50", "s"),
    ("ttft_p90_s", "TTFT p90", "s"),
    ("ttft_p95_s", "TTFT p95", "s"),
    ("ttft_p99_s", "TTFT p99", "s"),
    ("itl_mean_s", "ITL mean (per decode step)", "s"),
    ("itl_p95_s", "ITL p95", "s"),
    ("tpot_mean_s", "TPOT mean (per request)", "s"),
    ("tpot_p99_s", "TPOT p99", "s"),
    ("e2e_p99_s", "end-to-end p99", "s"),
    ("goodput_fraction", "goodput (meets TTFT and TPOT SLOs)", "%"),
    ("goodput_req_per_s", "goodput", "req/s"),
    ("throughput_tokens_per_s", "output throughput", "tok/s"),
    ("prefill_utilisation", "prefill utilisation", "%"),
    ("decode_utilisation", "decode utilisation", "%"),
    ("link_utilisation", "link utilisation", "%"),
    ("link_mean_gbps", "link mean rate", "Gbit/s"),
    ("transfer_p99_s", "KV transfer p99", "s"),
    ("second_token_p50_s", "second token p50", "s"),
    ("prefill_queue_mean", "prefill queue mean / max", "q"),
    ("link_queue_mean", "link queue mean / max", "q"),
    ("decode_queue_mean", "decode admission queue mean / max", "q"),
    ("decode_batch_mean", "decode batch mean", ""),
    ("local_prefill_requests", "prefilled locally on decode", ""),
    ("prefix_hit_ratio", "prefix cache hits (of prompt tokens)", "%"),
    ("kv_shipped_bytes", "KV shipped (uncached tokens)", "B"),
    ("kv_shipped_bytes_per_request", "KV shipped per shipping request", "B"),
)


def _cell(result: Any, key: str, unit: str) -> str:
    value = getattr(result, key) if result is not None else None
    if value is None:
        return "-"
    if unit == "%":
        return f"{100 * value:.1f} %"
    if unit == "q":
        peak = getattr(result, key.replace("_mean", "_max"))
        return f"{value:.2f} / {peak}"
    if unit == "s":
        return f"{value:.4g} s"
    if unit == "B":
        return f"{value:,.0f} B"
    return f"{value:.4g} {unit}".rstrip()


def _render_calibration(con: Console, cal: dict[str, Any]) -> None:
    table = Table(title=f"calibrated to {cal['report']} (link: {cal['link_step']})")
    for h in ("parameter", "value", "from", "points", "max error"):
        table.add_column(h, justify="right" if h in ("value", "points", "max error") else "left")
    for f in cal["fits"]:
        err = "-" if f["max_error_pct"] is None else f"{f['max_error_pct']:.1f} %"
        table.add_row(f["param"], f"{f['value']:.4g}", f["source"], str(f["points"]), err)
    con.print(table)
    for note in cal["notes"]:
        con.print(note, markup=False)


def _render_report(con: Console, rep: Any) -> None:
    if rep.calibration:
        _render_calibration(con, rep.calibration)
    modes = [m for m in ("colocated", "disaggregated") if getattr(rep, m) is not None]
    table = Table(title=f"pdx simulate — {rep.workload}, compat={rep.compat}")
    table.add_column("metric")
    for m in modes:
        table.add_column(m, justify="right")
    for key, label, unit in _ROWS:
        table.add_row(label, *(_cell(getattr(rep, m), key, unit) for m in modes))
    con.print(table)
    con.print(f"percentiles: {rep.percentile_method}", markup=False)
    per = (
        "(last token - first token) / (output tokens - 1), first token from prefill"
        if rep.config.get("first_token_from") == "prefill"
        else "(last token - first token) / output tokens"
    )
    con.print(f"ITL: durations of decode steps, over all steps; TPOT: per request, {per}")
    con.print(
        f"simulated {rep.requests} requests in {rep.wall_s:.2f} s "
        f"({rep.events_per_s:,.0f} events/s)"
    )


_SHORT_MODE = {"colocated": "coloc", "disaggregated": "disagg"}
_SWEEP_COLS = (
    ("ttft_p50_s", "TTFT50"),
    ("ttft_p99_s", "TTFT99"),
    ("itl_mean_s", "ITL"),
    ("itl_p95_s", "ITL95"),
    ("goodput_fraction", "goodput"),
    ("link_utilisation", "link"),
)


def _short(value: float | None, key: str) -> str:
    if value is None:
        return "-"
    if key in ("goodput_fraction", "link_utilisation"):
        return f"{100 * value:.1f}%"
    return f"{value:.3g}"


def _render_sweep(con: Console, res: Any) -> None:
    from pdx.sim.sweep import plain_modes, render_value

    table = Table(title=f"sweep of {res.param} (times in s)", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column(res.param, justify="right", min_width=min(len(res.param), 20))
    table.add_column("mode", no_wrap=True)
    for _, label in _SWEEP_COLS:
        table.add_column(label, justify="right", no_wrap=True)
    for p in res.points:
        for m in plain_modes(res.points):
            r = getattr(p, m)
            cells = [_short(getattr(r, key), key) for key, _ in _SWEEP_COLS]
            table.add_row(render_value(res.param, p.value), _SHORT_MODE[m], *cells)
    con.print(table)
    con.print(f"percentiles: {res.percentile_method}", markup=False)
    if res.plot_path:
        con.print(f"plot: {res.plot_path}", markup=False)


def _render_find_min(con: Console, res: Any) -> None:
    from pdx.sim.sweep import render_value

    slo = ", ".join(
        f"{k} {'>=' if k == 'goodput_fraction' else '<='} {v:g}" for k, v in res.slo.items()
    )
    table = Table(title=f"find-min {res.param} ({', '.join(res.modes)}): {slo}")
    table.add_column(res.param, justify="right")
    table.add_column("meets SLO")
    keys = list(res.evaluations[0].metrics) if res.evaluations else []
    for k in keys:
        label = k.split(".", 1)[1] if len(res.modes) == 1 else k
        table.add_column(label, justify="right")
    for e in res.evaluations:
        table.add_row(
            render_value(res.param, e.value),
            "yes" if e.ok else "no",
            *(f"{e.metrics[k]:.4g}" for k in keys),
        )
    con.print(table)
    con.print(f"method: {res.method}")
    lo, hi = render_value(res.param, res.searched_lo), render_value(res.param, res.searched_hi)
    if res.answer is None:
        con.print(f"answer: no value of {res.param} in [{lo}, {hi}] meets the SLO")
    else:
        extra = ""
        if res.param == "link_bytes_per_s":
            extra = f" B/s ({bytes_per_s_to_gbps(res.answer):.3g} Gbit/s)"
        answer = render_value(res.param, res.answer)
        con.print(f"answer: smallest {res.param} meeting the SLO = {answer}{extra}")


def _parse_range(text: str | None) -> tuple[float, float] | None:
    if text is None:
        return None
    lo, _, hi = text.partition(":")
    try:
        return float(lo), float(hi)
    except ValueError:
        raise InputError("--range", text, "LOW:HIGH numbers, e.g. 1e9:100e9") from None


def simulate_cmd(
    config: Path | None = typer.Option(
        None, "--config", help="YAML config (complete, or over --preset)."
    ),
    preset: str | None = typer.Option(
        None, "--preset", help="Base parameters; default published-illustration when no --config."
    ),
    workload: Path | None = typer.Option(
        None,
        "--workload",
        help="A trace to replay: Mooncake JSONL, BurstGPT CSV or pdx JSONL (arrival_s, "
        "prompt_tokens, output_tokens; optional session, hash_ids).",
    ),
    trace_format: str | None = typer.Option(
        None, "--format", help="The trace's format: mooncake, burstgpt, pdx or auto (default)."
    ),
    length_scale: float | None = typer.Option(
        None, "--length-scale", help="Trace: multiply every length and the block size."
    ),
    time_scale: float | None = typer.Option(
        None, "--time-scale", help="Trace: multiply every time (0.05 replays 20x faster)."
    ),
    max_requests: int | None = typer.Option(
        None, "--max-requests", help="Trace: at most this many requests (from its start)."
    ),
    prefix_cache_blocks: int | None = typer.Option(
        None,
        "--prefix-cache-blocks",
        help="Trace with hash ids: each instance's prefix cache, in blocks (LRU).",
    ),
    requests: int | None = typer.Option(
        None, "--requests", help="Poisson workload: number of requests."
    ),
    rate: float | None = typer.Option(
        None, "--rate", help="Poisson workload: arrivals per second."
    ),
    seed: int | None = typer.Option(
        None, "--seed", help="Poisson workload: seed of random.Random."
    ),
    output_tokens: int | None = typer.Option(
        None, "--output-tokens", help="Output tokens per request."
    ),
    mode: str | None = typer.Option(
        None, "--mode", help="colocated, disaggregated or both (default: config, else both)."
    ),
    compat: str | None = typer.Option(None, "--compat", help="none (correct model) or published."),
    model_preset: str | None = typer.Option(
        None, help="Fill model_params, weight_bytes, kv_bytes_per_token from a measure-kv preset."
    ),
    model_dtype: str | None = typer.Option(None, help="Weight and KV dtype for --model-preset."),
    prefill_flops: float | None = typer.Option(None, help="FLOP/s per prefill instance."),
    decode_hbm_bytes_per_s: float | None = typer.Option(
        None, help="HBM bytes/s per decode instance."
    ),
    weight_bytes: float | None = typer.Option(None, help="Model weight bytes."),
    model_params: float | None = typer.Option(None, help="Parameter count."),
    kv_bytes_per_token: float | None = typer.Option(None, help="KV bytes per token."),
    decode_weight_reads: str | None = typer.Option(
        None, help="per_request (published) or per_step."
    ),
    link_bytes_per_s: float | None = typer.Option(None, help="Link bandwidth, bytes/s."),
    link_rtt_s: float | None = typer.Option(None, help="Round trip added to each transfer."),
    link_loss: float | None = typer.Option(None, help="Packet loss probability."),
    link_jitter_s: float | None = typer.Option(
        None, help="Mean extra (exponential) transfer delay."
    ),
    link_sharing: str | None = typer.Option(
        None,
        help="fifo (transfers queue on one link), fair (transfers in flight share its rate "
        "equally, as concurrent TCP flows do) or none (each gets the whole bandwidth).",
    ),
    codec_ratio: float | None = typer.Option(None, help="Compressed / raw KV bytes."),
    prefill_instances: int | None = typer.Option(None, help="Prefill pool size."),
    decode_instances: int | None = typer.Option(None, help="Decode pool size."),
    colocated_instances: int | None = typer.Option(None, help="Colocated instances."),
    local_prefill_max_tokens: int | None = typer.Option(
        None, help="Prefill prompts up to this on decode."
    ),
    offload_policy: str | None = typer.Option(
        None,
        "--offload-policy",
        help="length (whole prompt decides and ships), uncached (the part decode's cache "
        "lacks decides and ships) or break_even (that part goes where its KV is ready sooner); "
        "unset: length decides, only what decode lacks ships.",
    ),
    max_decode_batch: int | None = typer.Option(None, help="Requests per decode batch."),
    decode_kv_budget_bytes: float | None = typer.Option(None, help="KV bytes per decode instance."),
    chunked_prefill_tokens: int | None = typer.Option(None, help="Colocated chunked prefill size."),
    slo_ttft_s: float | None = typer.Option(None, help="TTFT SLO for goodput."),
    slo_tpot_s: float | None = typer.Option(None, help="TPOT SLO for goodput."),
    set_: list[str] = typer.Option([], "--set", help="Any config key: key=value (repeatable)."),
    sweep: str | None = typer.Option(None, "--sweep", help="PARAM=start:stop:count; table + PNG."),
    plot: Path | None = typer.Option(None, "--plot", help="Where the sweep PNG goes."),
    find_min_param: str | None = typer.Option(
        None, "--find-min", help="Smallest PARAM meeting --slo."
    ),
    slo: list[str] = typer.Option([], "--slo", help="METRIC=VALUE for --find-min (repeatable)."),
    value_range: str | None = typer.Option(
        None, "--range", help="LOW:HIGH searched by --find-min."
    ),
    calibrate: Path | None = typer.Option(
        None, "--calibrate", help="Fit compute and link to a pdx accept report.json (or its dir)."
    ),
    calibrate_step: str | None = typer.Option(
        None, "--calibrate-step", help="The report step whose link is fitted (default: first)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
) -> None:
    """Simulate colocated vs disaggregated serving (default: the published illustration)."""
    from pdx.sim.config import load_sim_config

    modes = {
        "both": ["colocated", "disaggregated"],
        "colocated": ["colocated"],
        "disaggregated": ["disaggregated"],
    }
    if mode is not None and mode not in modes:
        raise InputError("--mode", mode, "colocated, disaggregated or both")
    flags: dict[str, Any] = {k: v for k, v in locals().items() if k in _CONFIG_FLAGS}
    flags["modes"] = modes[mode] if mode else None
    flags["workload"] = {
        "requests": requests,
        "rate_per_s": rate,
        "seed": seed,
        "output_tokens": output_tokens,
        "trace": str(workload) if workload else None,
        "format": trace_format,
        "length_scale": length_scale,
        "time_scale": time_scale,
        "max_requests": max_requests,
    }
    fitted = None
    if calibrate is not None:
        from pdx.sim.calibrate import calibrate as fit_report
        from pdx.sim.calibrate import read_report

        fitted = fit_report(read_report(str(calibrate)), calibrate_step)
    elif calibrate_step is not None:
        raise InputError("--calibrate-step", calibrate_step, "with --calibrate REPORT")
    cfg = load_sim_config(
        str(config) if config else None, preset, flags, set_, fitted.fields if fitted else None
    )
    if sweep and find_min_param:
        raise InputError("--sweep", sweep, "either --sweep or --find-min, not both")
    if sweep:
        _do_sweep(cfg, sweep, plot, as_json)
    elif find_min_param:
        from pdx.sim.sweep import find_min, parse_slo

        res = find_min(cfg, find_min_param, parse_slo(slo), _parse_range(value_range))
        emit(res, as_json=as_json, render=_render_find_min)
        if res.answer is None:  # searched, and nothing in the range meets the SLO
            raise typer.Exit(1)
    else:
        from dataclasses import asdict

        from pdx.sim.runner import simulate

        rep = simulate(cfg)
        rep.calibration = asdict(fitted) if fitted else None
        emit(rep, as_json=as_json, render=_render_report)


_CONFIG_FLAGS = (
    "model_preset",
    "model_dtype",
    "compat",
    "prefill_flops",
    "decode_hbm_bytes_per_s",
    "weight_bytes",
    "model_params",
    "kv_bytes_per_token",
    "decode_weight_reads",
    "link_bytes_per_s",
    "link_rtt_s",
    "link_loss",
    "link_jitter_s",
    "link_sharing",
    "codec_ratio",
    "prefill_instances",
    "decode_instances",
    "colocated_instances",
    "local_prefill_max_tokens",
    "offload_policy",
    "max_decode_batch",
    "decode_kv_budget_bytes",
    "chunked_prefill_tokens",
    "prefix_cache_blocks",
    "slo_ttft_s",
    "slo_tpot_s",
)


def _do_sweep(cfg: Any, spec: str, plot: Path | None, as_json: bool) -> None:
    from pdx.sim.plot import plot_sweep
    from pdx.sim.sweep import is_integer_param, parse_sweep, run_sweep

    param, values = parse_sweep(spec)
    res = run_sweep(cfg, param, values)
    out = plot or Path(f"sim-sweep-{param.replace('.', '-')}.png")
    res.plot_path = plot_sweep(res, out, integer_x=is_integer_param(param))
    emit(res, as_json=as_json, render=_render_sweep)


def register(app: typer.Typer) -> None:
    """Attach ``pdx simulate``."""
    app.command("simulate")(simulate_cmd)
