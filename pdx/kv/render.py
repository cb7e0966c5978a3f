"""Rich tables for ``measure-kv`` (the human form of :class:`MeasureKVReport`)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from pdx.kv.report import MeasureKVReport
from pdx.units import human_bytes


def render_presets(console: Console, data: dict[str, list[str]]) -> None:
    """One preset name per line."""
    for name in data["presets"]:
        console.print(name)


def _layer_groups(layers: list[dict[str, Any]]) -> list[tuple[dict[str, Any], int]]:
    groups: dict[tuple[Any, ...], tuple[dict[str, Any], int]] = {}
    for row in layers:
        key = (
            row["kind"],
            row["bytes_per_token"],
            row["window_tokens"],
            row["state_bytes"],
            row["detail"],
        )
        first, count = groups.get(key, (row, 0))
        groups[key] = (first, count + 1)
    return list(groups.values())


def layers_table(report: MeasureKVReport) -> Table:
    """Layers grouped by kind and size."""
    table = Table(title="layers", title_justify="left")
    for col in ("kind", "layers", "B/token", "kept", "state B", "shape (each layer)"):
        table.add_column(col, justify="left" if col in ("kind", "shape (each layer)") else "right")
    for row, count in _layer_groups(report.layers):
        kept = "all" if row["kind"] in ("full", "mla", "hybrid") else (row["window_tokens"] or "-")
        table.add_row(
            row["kind"],
            str(count),
            f"{row['bytes_per_token']:,}",
            str(kept),
            f"{row['state_bytes']:,}",
            row["detail"],
        )
    return table


def requests_table(report: MeasureKVReport) -> Table:
    """Exact bytes per request for each length."""
    table = Table(title="per request", title_justify="left")
    for col in ("seq", "kv_bytes", "total", "growing", "sliding", "state"):
        table.add_column(col, justify="right")
    for r in report.requests:
        table.add_row(
            f"{r['seq']:,}",
            f"{r['kv_bytes']:,}",
            human_bytes(r["kv_bytes"]),
            human_bytes(r["growing_bytes"]),
            human_bytes(r["sliding_bytes"]),
            human_bytes(r["state_bytes"]),
        )
    return table


def empirical_table(rows: list[dict[str, Any]]) -> Table:
    """Analytic vs empirical side by side."""
    table = Table(
        title="analytic vs empirical (cache returned by the model code)", title_justify="left"
    )
    for col in ("seq", "cache", "dtype", "analytic bytes", "empirical bytes", "match"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["seq"]),
            r["cache_class"],
            r["run_dtype"],
            f"{r['analytic_bytes']:,}",
            f"{r['empirical_bytes']:,}",
            "yes" if r["match"] else "NO",
        )
    return table


def codecs_table(report: MeasureKVReport) -> Table:
    """Ratio, speed, error and accuracy cost per codec."""
    title = "codecs (enc/dec: Gbit/s of raw KV, one CPU thread; top-1: decode agreement)"
    table = Table(title=title, title_justify="left")
    for col in ("codec", "ratio", "enc", "dec", "max err", "rel err", "top-1", "KL"):
        table.add_column(col, justify="left" if col == "codec" else "right")
    for c in report.codecs:
        agree = "-" if c["token_agreement"] is None else f"{c['token_agreement']:.3f}"
        kl = "-" if c["kl"] is None else f"{c['kl']:.1e}"
        table.add_row(
            c["name"],
            f"{c['ratio']:.3f}",
            f"{c['encode_gbps']:.1f}",
            f"{c['decode_gbps']:.1f}",
            f"{c['max_error']:.2g}",
            f"{c['rel_error']:.1e}",
            agree,
            kl,
        )
    return table


def demand_table(report: MeasureKVReport) -> Table:
    """Link demand per codec and length, against the 70 % rule (! marks a breach)."""
    b = report.budget
    title = (
        f"link demand at {b.qps:g} req/s on {b.link_gbps:g} Gbit/s "
        f"(Gbit/s, % of link; ! above {b.utilisation_limit:.0%})"
    )
    table = Table(title=title, title_justify="left")
    table.add_column("codec")
    for s in b.sequences:
        table.add_column(f"seq {s.seq:,}", justify="right")
    for i, codec in enumerate(c.codec for c in b.sequences[0].per_codec):
        cells = []
        for s in b.sequences:
            cb = s.per_codec[i]
            flag = "" if cb.within_70pct else " !"
            cells.append(f"{cb.demand_gbps:,.1f} {cb.utilisation:.0%}{flag}")
        table.add_row(codec, *cells)
    return table


def transfer_table(report: MeasureKVReport) -> Table:
    """Transfer time per codec next to recomputing the prefill, and the break-even length."""
    b = report.budget
    title = f"transfer vs recompute, ms (prefill {b.prefill_tflops:g} TFLOP/s)"
    table = Table(title=title, title_justify="left")
    table.add_column("codec")
    for s in b.sequences:
        table.add_column(f"seq {s.seq:,}", justify="right")
    table.add_column("ships from seq", justify="right")
    breaks = {be.codec: be.seq for be in b.break_even}
    for i, codec in enumerate(c.codec for c in b.sequences[0].per_codec):
        cells = [f"{s.per_codec[i].transfer_s * 1e3:,.1f}" for s in b.sequences]
        be = breaks.get(codec)
        table.add_row(codec, *cells, "never" if be is None else f"{be:,}")
    table.add_row("(recompute)", *[_ms(s.recompute_s) for s in b.sequences], "")
    return table


def _billions(count: int | None) -> str:
    return "unknown" if count is None else f"{count / 1e9:.1f} B"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.1f}"


def render_report(console: Console, report: MeasureKVReport) -> None:
    """Print the whole report for a human."""
    states = ", ".join(f"{k} {v}" for k, v in report.state_dtypes.items()) or report.state_dtype
    console.print(
        f"[bold]{report.model}[/bold] ({report.model_type}) · KV {report.dtype} · state "
        f"{states} · params {_billions(report.params_total)} total, "
        f"{_billions(report.params_active)} active per token"
    )
    engine = report.engine + (f", block {report.block_size} tokens" if report.block_size else "")
    console.print(f"engine {engine}: {report.engine_rules}")
    console.print(layers_table(report))
    console.print(
        f"kv_bytes_per_token {report.kv_bytes_per_token:,} (full, MLA and hybrid layers) · sliding "
        f"{report.sliding_bytes_per_token:,} per token up to the window · state "
        f"{report.state_bytes_per_request:,} per request"
    )
    console.print(requests_table(report))
    if report.empirical:
        console.print(empirical_table(report.empirical))
        for row in report.empirical:
            scaled = ", ".join(f"{k} {v[0]}→{v[1]}" for k, v in row["scaled"].items())
            console.print(f"  ran: {row['model_run']}" + (f"; scaled: {scaled}" if scaled else ""))
            for note in row["notes"]:
                console.print(f"  note: {note}")
            for line in row.get("mismatches", []):
                console.print(f"  [bold red]MISMATCH[/bold red] {line}")
    if report.codecs:
        console.print(codecs_table(report))
        s = report.codec_sample or {}
        console.print(
            f"  codec KV: {s.get('kv_source')}, {s.get('run_dtype')}, {s.get('seq')} tokens, "
            f"{human_bytes(s.get('sample_bytes', 0))}; accuracy over {s.get('decode_tokens')} "
            "greedy decode steps"
        )
    console.print(demand_table(report))
    console.print(transfer_table(report))
    for note in report.notes:
        console.print(f"note: {note}")
