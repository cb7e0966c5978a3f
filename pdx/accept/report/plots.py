"""Report plots (matplotlib, Agg backend): written as PNG files and returned as data URIs."""

from __future__ import annotations

import base64
import functools
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdx.accept.report import StepReport


def _save(fig: Any, directory: Path, name: str) -> str:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=90)
    data = buf.getvalue()
    (directory / name).write_bytes(data)
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def _distributions(
    ax: Any, steps: list[StepReport], records: dict[str, list[dict[str, Any]]]
) -> None:
    labels, ttft, tpot = [], [], []
    for s in steps:
        ok = [r for r in records.get(s.id, []) if r.get("ok")]
        labels.append(s.id.split("-", 1)[0])
        ttft.append([r["ttft_ms"] for r in ok if r.get("ttft_ms") is not None] or [float("nan")])
        tpot.append([r["tpot_ms"] for r in ok if r.get("tpot_ms") is not None] or [float("nan")])
    ax[0].boxplot(ttft, tick_labels=labels, showfliers=True)
    ax[0].set_title("TTFT per step (ms)")
    ax[1].boxplot(tpot, tick_labels=labels, showfliers=True)
    ax[1].set_title("TPOT per step (ms)")
    for a in ax:
        a.tick_params(axis="x", rotation=60)


def _vs_load(ax: Any, steps: list[StepReport]) -> None:
    by_net: dict[str, list[StepReport]] = {}
    for s in steps:
        by_net.setdefault(s.network, []).append(s)
    for net, group in by_net.items():
        xs = [float(s.concurrency if s.concurrency is not None else s.rate_rps or 0) for s in group]
        for key, style in (("p50", "-o"), ("p99", "--x")):
            ys = [(s.summary.get("ttft_ms") or {}).get(key) for s in group]
            pts = sorted((x, y) for x, y in zip(xs, ys, strict=True) if y is not None)
            if pts:
                ax.plot(*zip(*pts, strict=True), style, label=f"{net} TTFT {key}")
    ax.set_xlabel("concurrency (users) or rate (req/s)")
    ax.set_ylabel("ms")
    ax.set_title("Latency vs load")
    ax.legend(fontsize="small")


def _fault_timeline(ax: Any, step: StepReport) -> None:
    t = [b["t_s"] for b in step.timeline]
    ttft = [
        b["ttft_p50_ms"] if b["ttft_p50_ms"] is not None else float("nan") for b in step.timeline
    ]
    ax.plot(t, ttft, "-o", label="TTFT p50 (ms)")
    ax2 = ax.twinx()
    ax2.bar(
        t, [b["failed"] for b in step.timeline], width=0.4, alpha=0.5, color="red", label="failed"
    )
    ax2.bar(
        [x + 0.4 for x in t],
        [b["degraded"] for b in step.timeline],
        width=0.4,
        alpha=0.5,
        color="orange",
        label="degraded",
    )
    ax2.set_ylabel("requests per second")
    c = step.condition
    if c.get("link_down_at_s") is not None:
        start = c["link_down_at_s"]
        ax.axvspan(start, start + c["link_down_for_s"], color="grey", alpha=0.3, label="link down")
    ax.set_xlabel("seconds into step")
    ax.set_title(f"{step.id}: degradation and recovery")
    ax.legend(loc="upper left", fontsize="small")
    ax2.legend(loc="upper right", fontsize="small")


def _transfers(ax: Any, records: dict[str, list[dict[str, Any]]]) -> None:
    ms = [
        float(r["pdx"]["transfer_ms"])
        for rows in records.values()
        for r in rows
        if isinstance(r.get("pdx"), dict) and (r["pdx"].get("transfer_ms") or 0) > 0
    ]
    if ms:
        ax.hist(ms, bins=40)
    else:
        ax.text(0.5, 0.5, "no KV transfers observed", ha="center", transform=ax.transAxes)
    ax.set_title(f"KV transfer time (ms), {len(ms)} transfers")
    ax.set_xlabel("ms")


def _resources(ax: Any, steps: list[StepReport]) -> None:
    t0, xs, cpu, rss, bw = 0.0, [], [], [], []
    for s in steps:
        for r in s.resources:
            xs.append(t0 + r["t_s"])
            cpu.append(r.get("cpu_percent") or 0.0)
            rss.append((r.get("rss_bytes") or 0) / 2**20)
            bw.append((r.get("link_bytes_per_s") or 0.0) * 8 / 1e6)
        t0 += s.elapsed_s + 1
    ax[0].plot(xs, cpu)
    ax[0].set_title("target CPU (% of one core)")
    ax[1].plot(xs, rss)
    ax[1].set_title("target RSS (MiB)")
    ax[2].plot(xs, bw)
    ax[2].set_title("KV link through proxy (Mbit/s)")
    for a in ax:
        a.set_xlabel("seconds (steps back to back)")


def _prediction(ax: Any, steps: list[StepReport]) -> None:
    """Per predicted metric: measured (with its interval) and predicted, step by step."""
    from pdx.accept.predict.prediction import METRICS

    for a, metric in zip(ax, METRICS, strict=True):
        xs, meas, pred, lo, hi = [], [], [], [], []
        for i, s in enumerate(steps):
            e = (s.prediction or {}).get(metric) or {}
            if e.get("measured") is None or e.get("predicted") is None:
                continue
            low, high = e.get("interval") or (None, None)
            xs.append(i)
            meas.append(e["measured"])
            pred.append(e["predicted"])
            # an order statistic can sit past the interpolated quantile: clamp the bars at 0
            lo.append(max(0.0, e["measured"] - (low if low is not None else e["measured"])))
            hi.append(max(0.0, (high if high is not None else e["measured"]) - e["measured"]))
        a.errorbar(xs, meas, yerr=[lo, hi], fmt="o", capsize=3, label="measured (interval)")
        a.plot(xs, pred, "x", markersize=9, label="predicted")
        a.set_xticks(range(len(steps)), [s.id.split("-", 1)[0] for s in steps])
        a.set_title(metric)
        a.set_ylabel("ms")
    ax[0].legend(fontsize="small")


_MARK = {"GO": ("o", "tab:green"), "NO-GO": ("x", "tab:red"), "INCONCLUSIVE": ("^", "orange")}


def _envelope(ax: Any, s: dict[str, Any]) -> None:
    """A search: its probes (measured), its bracket, the simulator's curve."""
    curve = (s.get("prediction") or {}).get("curve") or []
    lo, hi = s["range"]
    inside = [p for p in curve if lo <= p["value"] <= hi]
    past = [p for p in curve if not lo <= p["value"] <= hi]
    if inside:
        ax.plot([p["value"] for p in inside], [p["ratio"] for p in inside], "-", color="grey",
                label="predicted (simulator)")  # fmt: skip
    if past:  # past the probed range: the simulator's extrapolation, drawn apart
        ax.plot([p["value"] for p in past], [p["ratio"] for p in past], ":", color="grey",
                label="predicted past the range")  # fmt: skip
    for verdict, (marker, color) in _MARK.items():
        pts = [(p["value"], p["worst_ratio"]) for p in s["probes"]
               if p["verdict"] == verdict and p.get("worst_ratio") is not None]  # fmt: skip
        if pts:
            ax.plot(*zip(*pts, strict=True), marker, color=color, markersize=8,
                    linestyle="none", label=f"probe {verdict}")  # fmt: skip
    good, bad = s["bracket"]
    if good is not None and bad is not None:
        ax.axvspan(min(good, bad), max(good, bad), color="tab:blue", alpha=0.2, label="bracket")
    elif good is not None:
        ax.axvline(good, color="tab:blue", alpha=0.5, label="limit (last GO)")
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="threshold")
    measured = [p["worst_ratio"] for p in s["probes"] if p.get("worst_ratio") is not None]
    ax.set_ylim(0, max(2.0, 1.3 * max(measured, default=0.0)))
    ax.set_xlim(lo / 1.2, hi * 1.2)
    if hi / lo >= 10:
        ax.set_xscale("log")
    ax.set_xlabel(f"{s['param']} ({s['unit']})")
    ax.set_ylabel("closest latency criterion / its threshold")
    ax.set_title(f"search {s['param']} under {s['condition']}")
    ax.legend(fontsize="small")


def make_plots(
    steps: list[StepReport],
    records: dict[str, list[dict[str, Any]]],
    directory: Path,
    searches: list[dict[str, Any]] | None = None,
) -> dict[str, str]:
    """Every plot the report shows: {file name: data URI}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: dict[str, str] = {}
    if not steps:
        return out

    def one(name: str, ncols: int, draw: Callable[[Any], None], width: float = 10) -> None:
        fig, ax = plt.subplots(1, ncols, figsize=(width, 4))
        try:
            draw(ax)
            out[name] = _save(fig, directory, name)
        finally:
            plt.close(fig)

    one("latency-distributions.png", 2, lambda ax: _distributions(ax, steps, records))
    one("latency-vs-load.png", 1, lambda ax: _vs_load(ax, steps), width=7)
    for s in steps:
        if s.proxy is not None or s.fault_events:
            one(f"fault-{s.id}.png", 1, functools.partial(_fault_timeline, step=s), width=8)
    one("transfer-times.png", 1, lambda ax: _transfers(ax, records), width=7)
    if any(s.resources for s in steps):
        one("resources.png", 3, lambda ax: _resources(ax, steps), width=12)
    if any(s.prediction for s in steps):
        one("prediction-vs-measured.png", 5, lambda ax: _prediction(ax, steps), width=16)
    for i, search in enumerate(searches or []):
        one(f"envelope-{i}-{search['param']}.png", 1,
            functools.partial(_envelope, s=search), width=8)  # fmt: skip
    return out
