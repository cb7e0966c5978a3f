"""``pdx measure-kv``: exact KV bytes per token / request, codecs and the bandwidth budget."""

from __future__ import annotations

from pathlib import Path

import typer

from pdx.cli.output import emit, err_console

_CODECS_HELP = (
    "Codecs to measure: 'all' (default), 'none' (analytic only, no torch), "
    "or a comma-separated list of names (see docs; e.g. fp8-e4m3,int4-g64,zstd-planes)."
)


def measure_kv_command(
    config: Path | None = typer.Option(None, "--config", help="A Hugging Face config.json."),
    model_path: Path | None = typer.Option(
        None, "--model-path", help="A local checkpoint directory (config.json + weights)."
    ),
    preset: str | None = typer.Option(None, "--preset", help="A built-in model preset."),
    list_presets: bool = typer.Option(False, "--list-presets", help="List presets and exit."),
    dtype: str = typer.Option("bf16", "--dtype", help="KV element type: bf16, fp16, fp32, fp8."),
    state_dtype: str = typer.Option(
        "auto",
        "--state-dtype",
        help="Recurrent/SSM state type: auto (as the engine keeps each state), fp32, bf16, fp16.",
    ),
    seq: str = typer.Option("1024,8192,32768", "--seq", help="Prompt lengths, comma-separated."),
    qps: float = typer.Option(1.0, "--qps", help="Requests per second for the budget."),
    link_gbps: float = typer.Option(100.0, "--link-gbps", help="Link bandwidth, Gbit/s."),
    prefill_tflops: float = typer.Option(
        400.0, "--prefill-tflops", help="Effective prefill compute, TFLOP/s (recompute time)."
    ),
    active_params_b: float | None = typer.Option(
        None,
        "--active-params-b",
        help="Active parameters per token, billions (overrides the estimate).",
    ),
    transfer_overhead_ms: float = typer.Option(
        0.0, "--transfer-overhead-ms", help="Fixed cost per KV transfer (handshake, scheduling)."
    ),
    codecs: str = typer.Option("all", "--codecs", help=_CODECS_HELP),
    codec_seq: int = typer.Option(
        256, "--codec-seq", help="Prefill length of the codec KV sample."
    ),
    decode_tokens: int = typer.Option(
        8, "--decode-tokens", help="Greedy decode steps compared per codec (0 skips accuracy)."
    ),
    empirical: bool = typer.Option(
        False, "--empirical", help="Also run the model code and count its cache bytes."
    ),
    empirical_seq: int = typer.Option(
        64, "--empirical-seq", help="Cap on the empirical prefill length."
    ),
    engine: str = typer.Option(
        "transformers",
        "--engine",
        help="Size as this engine holds the KV: transformers (pdx's own pair) or vllm.",
    ),
    block_size: int | None = typer.Option(
        None, "--block-size", help="vLLM block size in tokens (default: vLLM's for --device)."
    ),
    device: str = typer.Option(
        "gpu", "--device", help="vLLM device for the default block size: gpu (16) or cpu (128)."
    ),
    sets: list[str] | None = typer.Option(
        None,
        "--set",
        metavar="FIELD=VALUE",
        help="Set a config field the file lacks or gets wrong (repeatable; VALUE is JSON, "
        "e.g. --set num_hidden_layers=80 --set sliding_window=null).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """Exact KV bytes per token and per request, compression and its accuracy cost, link budget."""
    from pdx.errors import InputError, MeasurementError
    from pdx.kv.budget import LinkParams
    from pdx.kv.render import render_presets, render_report
    from pdx.kv.report import MeasureOptions, check_codecs, measure_kv
    from pdx.kv.source import apply_overrides, parse_overrides, preset_names, resolve_source
    from pdx.kv.spec import billions, check_positive, parse_codec_list, parse_seq_list

    if list_presets:
        emit({"presets": preset_names()}, as_json=as_json, render=render_presets)
        return
    overrides = parse_overrides(sets or [])
    source = resolve_source(config=config, model_path=model_path, preset=preset)
    source = apply_overrides(source, overrides)
    opts = MeasureOptions(
        dtype=dtype,
        state_dtype=state_dtype,
        seqs=tuple(parse_seq_list(seq)),
        codecs=tuple(parse_codec_list(codecs)),
        codec_seq=check_positive("--codec-seq", codec_seq),
        decode_tokens=check_positive("--decode-tokens", decode_tokens, allow_zero=True),
        empirical=empirical,
        empirical_seq=check_positive("--empirical-seq", empirical_seq),
        active_params=billions("--active-params-b", active_params_b),
        link=LinkParams(qps, link_gbps, prefill_tflops, transfer_overhead_ms),
        engine=engine,
        block_size=block_size,
        device=device,
    )
    try:
        check_codecs(opts.codecs)
    except InputError as exc:  # the registry names its own field; the user typed --codecs
        raise InputError("--codecs", exc.value, exc.expected) from None
    if opts.codecs or opts.empirical:
        err_console().print("running the model code (torch) for the measured parts ...")
    report = measure_kv(source, opts)
    emit(report, as_json=as_json, render=render_report)
    failed = [line for row in report.empirical or [] for line in row["mismatches"]]
    if failed:
        raise MeasurementError("analytic and empirical bytes differ: " + "; ".join(failed[:5]))


def register(app: typer.Typer) -> None:
    """Attach ``measure-kv`` to the top-level app."""
    app.command("measure-kv")(measure_kv_command)
