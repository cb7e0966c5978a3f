"""A PNG of a sweep: TTFT, inter-token latency and goodput against the swept parameter."""

from __future__ import annotations

from pathlib import Path

from pdx.sim.sweep import SweepResult, plain_modes

_COLOURS = {"colocated": "tab:orange", "disaggregated": "tab:blue"}


def plot_sweep(result: SweepResult, path: Path | str, integer_x: bool = False) -> str:
    """Write the sweep plot to ``path`` (PNG) and return the path (whole-number ticks if asked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    xs = [p.value for p in result.points]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6), constrained_layout=True)
    panels = (
        (axes[0], ("ttft_p50_s", "ttft_p99_s"), "TTFT (s)"),
        (axes[1], ("itl_mean_s", "itl_p95_s"), "inter-token latency (s)"),
        (axes[2], ("goodput_fraction",), "goodput (fraction meeting SLOs)"),
    )
    for ax, metrics, label in panels:
        for mode in plain_modes(result.points):
            for metric, style in zip(metrics, ("-o", "--s"), strict=False):
                ys = [getattr(getattr(p, mode), metric) for p in result.points]
                name = f"{mode} {metric.removesuffix('_s').replace('_', ' ')}"
                ax.plot(xs, ys, style, color=_COLOURS[mode], label=name, markersize=4)
        ax.set_xlabel(result.param)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        if metrics == ("goodput_fraction",):
            ax.set_ylim(-0.02, 1.02)
        if xs[-1] / max(xs[0], 1e-300) > 20:
            ax.set_xscale("log")
        elif integer_x:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(f"pdx simulate: sweep of {result.param} (percentiles: nearest rank)")
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return str(out)
