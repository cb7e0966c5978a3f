"""The simulator's limit for a search, calibrated on the search's first probe.

The compute comes from the first probe's server timings, the model from the pre-flight
measure-kv, the link from the pre-flight probe (as each step's prediction does, see
:mod:`pdx.accept.predict.prediction`). With ``engine: vllm`` the compute comes from the first
probe's ``vllm:`` series instead (:mod:`pdx.accept.predict.calibrate`, as a run's forecast
does), and so does the NIXL pull's own time: one probe at one RTT cannot tell the pull's round trips
from its fixed part (a run's forecast fits both on steps at several RTTs), so the pull is
taken as ``PULL_ROUND_TRIPS`` round trip (the read request and its data) plus the rest of
what the first probe measured as a fixed time.

For ``rate`` the simulator replays Poisson arrivals at each candidate rate with the probe's
lengths and duration; for the link parameters it replays the first probe's own requests over
a link with that RTT, loss or bandwidth. The predicted figures (TTFT p50/p99, TPOT p50/p99,
transfer p50) are set against the step's latency criteria; the largest ratio figure /
threshold decides: at most 1 is GO. The curve over the range (and past
it, up to ``EXTRAPOLATE`` × its bad end, labelled a prediction) is what the envelope plot draws.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pdx.accept.playbook import Playbook
from pdx.accept.predict.prediction import (
    deploy_facts,
    goodput_bps,
    sim_fields,
    simulate_step,
    step_workload,
)
from pdx.accept.report import StepReport
from pdx.accept.search.limit import Axis
from pdx.accept.steps import Step, step_criteria

PREDICTED = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "transfer_p50_ms")
CURVE_POINTS = 10
EXTRAPOLATE = 4.0  # the curve and the extrapolated limit reach this far past the range
# vLLM: round trips of the link in one NIXL pull (a read request, the blocks back); the line
# fitted on playbooks/vllm-cross-dc.yaml's steps at 10 and 40 ms had a slope of 0.90
PULL_ROUND_TRIPS = 1.0


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
        report: StepReport,
        records: list[dict[str, Any]],
        preflight: dict[str, Any],
    ) -> None:
        from pdx.accept.predict.calibrate import engine_compute
        from pdx.accept.preflight.probe import summary as probe_summary
        from pdx.sim.calibrate import compute_fits, model_fields

        self.axis, self.step, self.pb = axis, step, pb
        kv = preflight.get("measure_kv") or preflight.get("_kv")
        model = model_fields({"preflight": {"measure_kv": kv}, "name": pb.name})
        facts = deploy_facts(pb, playbook_dir)
        self.engine = facts.engine
        if facts.engine == "vllm":
            compute, _ = engine_compute([(step, report)], model)
        else:
            compute, _ = compute_fits([_step_dict(step, report.summary)], model)
        probe = preflight.get("probe_link") or {}
        link: dict[str, Any] = (probe_summary(probe) if probe.get("report") else None) or {}
        self.link = link
        self.fields = sim_fields(compute, model, link, facts)
        self.pull: dict[str, Any] = {}  # vLLM: how the NIXL pull was calibrated
        if self.fields is not None and facts.engine == "vllm":
            self.fields.update(self._pull(report, model, goodput_bps(link, facts.kv_streams)))
        self.workload = step_workload(records)
        crit = step_criteria(pb, step)
        self.thresholds = {m: getattr(crit, m) for m in PREDICTED if getattr(crit, m, None)}

    def _pull(self, report: StepReport, model: dict[str, Any], bps: float | None) -> dict[str, Any]:
        """vLLM's flow (the first token from decode, the prompt across the link to prefill)
        and its pull: ``PULL_ROUND_TRIPS`` of the link the first probe ran on, the rest of
        its measured pull (transfer p50 − wire time − one decode step) a fixed time."""
        from pdx.accept.predict.calibrate import VLLM_FLOW, pull_point

        out: dict[str, Any] = dict(VLLM_FLOW)
        ax = self.axis
        rtt_ms = self._rtt_ms(ax.best if ax.param == "rtt_ms" else 0.0)  # the first probe's
        if bps and ax.param == "bandwidth_mbps":
            bps = min(bps, ax.best * 1e6)
        point = pull_point(self.step, report, {"rtt_p50_ms": rtt_ms}, bps, model)
        if point is not None:
            rtt_s, pull_s = point
            out["link_round_trips"] = PULL_ROUND_TRIPS
            out["link_fixed_s"] = max(0.0, pull_s - PULL_ROUND_TRIPS * rtt_s)
            self.pull = {"measured_ms": round(pull_s * 1e3, 3), "at_rtt_ms": round(rtt_ms, 3),
                         "round_trips": PULL_ROUND_TRIPS,
                         "fixed_ms": round(out["link_fixed_s"] * 1e3, 3)}  # fmt: skip
        else:  # no transfer p50 or decode step to take it from: the link's round trips only
            self.pull = {"measured_ms": None,
                         "round_trips": (self.fields or {}).get("link_round_trips")}  # fmt: skip
        return out

    def _rtt_ms(self, added_ms: float) -> float:
        """The link's RTT with ``added_ms`` of emulated delay (an ``rtt_ms`` probe's value)."""
        return float(self.link.get("rtt_p50_ms") or 0.0) + added_ms

    def why_not(self) -> str | None:
        """Why this search has no prediction (None: it has one)."""
        if self.axis.param == "concurrency":
            return "the simulator models open-loop arrivals, not a closed loop of users"
        if not self.thresholds:
            return "no latency criterion to predict (ttft/tpot/transfer thresholds are null)"
        if self.fields is None:
            return "no link figures (preflight.probe_link is off or its probe failed)"
        missing = [k for k in ("prefill_flops", "decode_hbm_bytes_per_s") if k not in self.fields]
        if missing and self.engine == "vllm":
            return (f"the first probe's vllm: series gave no {', '.join(missing)} (prefill's "
                    "time to first token, decode's inter-token latency)")  # fmt: skip
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
            fields["link_rtt_s"] = self._rtt_ms(value) / 1e3
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
        **({"pull": model.pull} if model.pull else {}),
        "curve": curve,
        "method": "simulator calibrated on the first probe (its server timings, or with vLLM "
        "its vllm: series and its pull, the pre-flight model and link); the largest predicted "
        "figure / threshold crosses 1",
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
