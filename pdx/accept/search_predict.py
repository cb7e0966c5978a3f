"""The simulator's limit for a search, calibrated on the search's first probe.

The compute comes from the first probe's server timings, the model from the pre-flight
measure-kv, the link from the pre-flight probe (as each step's prediction does, see
:mod:`pdx.accept.prediction`). For ``rate`` the simulator replays Poisson arrivals at each
candidate rate with the probe's lengths and duration; for the link parameters it replays the
first probe's own requests over a link with that RTT, loss or bandwidth. The predicted figures
(TTFT p50/p99, TPOT p50/p99, transfer p50) are set against the step's latency criteria; the
largest ratio figure / threshold decides: at most 1 is GO. The curve over the range (and past
it, up to ``EXTRAPOLATE`` × its bad end, labelled a prediction) is what the envelope plot draws.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pdx.accept.playbook import Playbook, Step, step_criteria
from pdx.accept.prediction import deploy_facts, sim_fields, simulate_step, step_workload
from pdx.accept.search import Axis

PREDICTED = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "transfer_p50_ms")
CURVE_POINTS = 10
EXTRAPOLATE = 4.0  # the curve and the extrapolated limit reach this far past the range


def _step_dict(step: Step, summary: dict[str, Any]) -> dict[str, Any]:
    return {"id": step.id, "input_tokens": step.input_tokens, "output_tokens": step.output_tokens,
            "concurrency": step.concurrency, "summary": summary}  # fmt: skip


class LimitModel:
    """Predicted figures at any value of the axis, from one calibration probe."""

    def __init__(
        self,
        pb: Playbook,
        playbook_dir: Path,
        axis: Axis,
        step: Step,
        summary: dict[str, Any],
        records: list[dict[str, Any]],
        preflight: dict[str, Any],
    ) -> None:
        from pdx.accept.probe import summary as probe_summary
        from pdx.sim.calibrate import compute_fits, model_fields

        self.axis, self.step, self.pb = axis, step, pb
        kv = preflight.get("measure_kv") or preflight.get("_kv")
        model = model_fields({"preflight": {"measure_kv": kv}, "name": pb.name})
        compute, _ = compute_fits([_step_dict(step, summary)], model)
        probe = preflight.get("probe_link") or {}
        link: dict[str, Any] = (probe_summary(probe) if probe.get("report") else None) or {}
        self.link = link
        self.fields = sim_fields(compute, model, link, deploy_facts(pb, playbook_dir))
        self.workload = step_workload(records)
        crit = step_criteria(pb, step)
        self.thresholds = {m: getattr(crit, m) for m in PREDICTED if getattr(crit, m, None)}

    def why_not(self) -> str | None:
        """Why this search has no prediction (None: it has one)."""
        if self.axis.param == "concurrency":
            return "the simulator models open-loop arrivals, not a closed loop of users"
        if not self.thresholds:
            return "no latency criterion to predict (ttft/tpot/transfer thresholds are null)"
        if self.fields is None:
            return "no link figures (preflight.probe_link is off or its probe failed)"
        missing = [k for k in ("prefill_flops", "decode_hbm_bytes_per_s") if k not in self.fields]
        if missing:
            return f"the first probe's servers reported no {', '.join(missing)} timings"
        if self.workload is None:
            return "the first probe finished no request"
        return None

    def figures(self, value: float) -> dict[str, float | None]:
        """Predicted figures (ms) at one value of the axis."""
        from pdx.sim.config import WorkloadConfig
        from pdx.sim.workload import poisson_workload

        assert self.fields is not None
        fields, workload, param = dict(self.fields), self.workload, self.axis.param
        if param == "rate":
            n = max(50, min(20_000, round(value * self.step.duration_s)))
            workload = poisson_workload(WorkloadConfig(
                requests=n, rate_per_s=value, seed=self.pb.seed + 7,
                prompt_tokens=[self.step.input_tokens], prompt_weights=[1.0],
                output_tokens=self.step.output_tokens, trace=None))  # fmt: skip
        elif param == "rtt_ms":
            fields["link_rtt_s"] = float(self.link.get("rtt_p50_ms") or 0.0) / 1e3 + value / 1e3
        elif param == "loss":
            fields["link_loss"] = min(0.5, value)
        elif param == "bandwidth_mbps":
            fields["link_bytes_per_s"] = min(float(fields["link_bytes_per_s"]), value * 1e6 / 8)
        return simulate_step(fields, workload)

    def ratio(self, value: float) -> tuple[float, str, dict[str, float | None]]:
        """The largest predicted figure / threshold at ``value``, which criterion, the figures."""
        figs = self.figures(value)
        worst, binding = 0.0, ""
        for m, thr in self.thresholds.items():
            v = figs.get(m)
            r = math.inf if v is None else float(v) / float(thr)
            if r > worst or not binding:
                worst, binding = r, m
        return worst, binding, figs


def predict(model: LimitModel) -> dict[str, Any]:
    """``predicted_limit`` in range, ``extrapolated_limit`` past it, and the curve."""
    why = model.why_not()
    if why is not None:
        return {"predicted_limit": None, "why_not": why, "curve": []}
    ax = model.axis
    far = ax.hi * EXTRAPOLATE if ax.worse_up else ax.lo / EXTRAPOLATE
    values = _spread(ax.best, far, CURVE_POINTS + 3)
    curve: list[dict[str, Any]] = []
    for v in values:
        r, binding, figs = model.ratio(v)
        curve.append({"value": v, "ratio": round(r, 4), "binding": binding,
                      "figures": {k: _round(x) for k, x in figs.items()}})  # fmt: skip
    below = bool(curve) and curve[0]["ratio"] > 1  # predicted NO-GO at the good end itself
    limit = None if below else _crossing(model, curve)
    within = limit is not None and not ax.worse(limit, ax.worst)
    return {
        "predicted_limit": ax.snap(limit) if within and limit is not None else None,
        "extrapolated_limit": None if within or limit is None else float(f"{limit:.4g}"),
        "predicted_below_range": below,
        "beyond_reach": limit is None and not below,
        "calibrated_on": model.step.id,
        "link": {k: model.link.get(k) for k in ("rtt_p50_ms", "down_gbps", "loss_down_pct")},
        "curve": curve,
        "method": "simulator calibrated on the first probe (its server timings, the pre-flight "
        "model and link); the largest predicted figure / threshold crosses 1",
    }


def _spread(a: float, b: float, n: int) -> list[float]:
    """``n`` values from a to b, geometric (both are positive)."""
    return [float(f"{a * (b / a) ** (i / (n - 1)):.4g}") for i in range(n)]


def _crossing(model: LimitModel, curve: list[dict[str, Any]]) -> float | None:
    """Where the ratio crosses 1: bisected between the curve's last GO and first NO-GO."""
    prev = None
    for point in curve:
        if point["ratio"] > 1 and prev is not None:
            good, bad = prev["value"], point["value"]
            for _ in range(8):
                mid = math.sqrt(good * bad)
                good, bad = (mid, bad) if model.ratio(mid)[0] <= 1 else (good, mid)
            return good
        prev = point
    return None  # GO over the whole curve


def _round(x: float | None) -> float | None:
    return None if x is None else round(float(x), 3)
