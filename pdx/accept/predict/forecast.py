"""A run's predictions and recommendations, assembled from its steps.

The compute comes from the servers' own timings (:func:`pdx.sim.calibrate.compute_fits`):
the step's own when it has at least ``OWN_COMPUTE_MIN`` prefills (a shared machine's speed
drifts between steps; the link is what the prediction tests), else the whole run's. The
model comes from the pre-flight measure-kv, the link of each step from its own probe
(``preflight.probe_each_step``) or else the pre-flight baseline. Each step's
report gets ``prediction``, ``unexplained`` and ``prediction_model``; the run gets
``recommendations`` (:mod:`pdx.accept.predict.advice`) and ``prediction_summary``.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from pdx.accept.playbook import Playbook
from pdx.accept.predict import advice
from pdx.accept.predict.prediction import (
    StepPrediction,
    deploy_facts,
    predict_step,
    run_summary,
    sim_fields,
)
from pdx.accept.report import Recommendation, StepReport
from pdx.accept.steps import Step, step_criteria


def _step_dict(step: Step, report: StepReport) -> dict[str, Any]:
    return {
        "id": step.id,
        "input_tokens": step.input_tokens,
        "output_tokens": step.output_tokens,
        "concurrency": step.concurrency,
        "summary": report.summary,
    }


OWN_COMPUTE_MIN = 5


def _compute(
    step: Step, report: StepReport, run: dict[str, Any], model: dict[str, Any]
) -> tuple[dict[str, Any], str]:
    """The step's own compute figures over the run's, when it has enough prefills."""
    from pdx.sim.calibrate import compute_fits

    t = report.summary.get("timings_ms") or {}
    n = sum(int((t.get(k) or {}).get("count") or 0) for k in ("prefill", "local_prefill"))
    if n < OWN_COMPUTE_MIN:
        return run, "the run's server timings"
    if step.concurrency != 1:  # its timings hold waits behind the others' work (see compute_fits)
        return run, "the run's server timings (one-user steps)"
    own, _ = compute_fits([_step_dict(step, report)], model)
    return {**run, **own}, "the step's own server timings"


def _link(report: StepReport, baseline: dict[str, Any] | None) -> tuple[dict[str, Any], str]:
    own = ((report.preflight or {}).get("probe_link") or {}).get("summary")
    if own:
        return own, "the step's own probe"
    return dict((baseline or {}).get("summary") or {}), "the pre-flight baseline probe"


def _step_trace(pb: Playbook, step: Step) -> tuple[Any, int]:
    """A trace step's trace and its scaled block size (None, 0 for other steps)."""
    if step.workload is None:
        return None, 0
    from pdx.traces.formats import read_trace
    from pdx.traces.prompts import scaled

    w = pb.load.workloads[step.workload]
    trace = read_trace(w.trace, w.format, block_size=w.block_size)
    return trace, scaled(trace.block_size, w.length_scale)


def predict_run(
    pb: Playbook,
    playbook_dir: Path,
    steps: list[tuple[Step, StepReport, list[dict[str, Any]]]],
    preflight: dict[str, Any],
) -> tuple[dict[str, Recommendation], dict[str, Any]]:
    """Predict every step (in place on its report); the run's recommendations and summary."""
    from pdx.sim.calibrate import compute_fits, model_fields

    kv = preflight.get("measure_kv") or preflight.get("_kv")
    model = model_fields({"preflight": {"measure_kv": kv}, "name": pb.name})
    facts = deploy_facts(pb, playbook_dir)
    baseline = preflight.get("probe_link")
    engine = (
        _EngineCalibration(pb, steps, model, baseline, facts) if facts.engine == "vllm" else None
    )
    if engine is not None:
        compute, fits = engine.compute, engine.fits
    else:
        compute, fit_list = compute_fits([_step_dict(s, r) for s, r, _ in steps], model)
        fits = [asdict(f) for f in fit_list]
    tol, conf = pb.prediction.error_max_pct, pb.judgement.confidence
    done: list[tuple[str, StepPrediction]] = []
    inputs: list[advice.StepInput] = []
    for step, report, records in steps:
        link, link_from = _link(report, baseline)
        if engine is not None:
            own, compute_from = engine.step_compute(step, report)
        else:
            own, compute_from = _compute(step, report, compute, model)
        fields = sim_fields(own, model, link, facts) if link else None
        if fields is not None and engine is not None:
            fields.update(engine.pull_fields())
        trace, block = _step_trace(pb, step)
        pred = predict_step(fields, records, link_from, conf, tol, trace, block)
        pred.model["compute_from"] = compute_from
        if engine is not None:
            pred.model["pull_fitted_on"] = engine.fitted_on
        report.prediction, report.unexplained = pred.figures, pred.unexplained
        report.prediction_model = pred.model
        done.append((step.id, pred))
        probe_report = ((report.preflight or {}).get("probe_link") or {}).get("report")
        inputs.append(
            advice.StepInput(
                id=step.id,
                input_tokens=step.input_tokens,
                criteria=step_criteria(pb, step),
                fields=pred.fields,
                workload=pred.workload,
                link=link,
                probe_report=probe_report,
                summary=report.summary,
                elapsed_s=report.elapsed_s,
                router=dict((report.kernel or {}).get("router_counters") or {}),
            )
        )
    run = advice.RunInput(
        steps=inputs,
        facts=facts,
        baseline=(baseline or {}).get("report"),
        kv_bytes_per_token=model["kv_bytes_per_token"],
    )
    settings = {k: Recommendation(**v) for k, v in advice.recommend(run).items()}
    summary = run_summary(done, tol, fits)
    if engine is not None:
        summary["pull_fitted_on"] = engine.fitted_on
    summary["facts"] = asdict(facts)
    return settings, summary


class _EngineCalibration:
    """``engine: vllm``: compute from vLLM's own timings, the pull's round trips and fixed
    time from the run's clean steps (:mod:`pdx.accept.predict.calibrate`)."""

    def __init__(
        self,
        pb: Playbook,
        steps: list[tuple[Step, StepReport, list[dict[str, Any]]]],
        model: dict[str, Any],
        baseline: dict[str, Any] | None,
        facts: Any,
    ) -> None:
        from pdx.accept.predict.calibrate import engine_compute, pull_fit, pull_point
        from pdx.accept.predict.prediction import goodput_bps

        self.model = model
        self.compute, self.fits = engine_compute([(s, r) for s, r, _ in steps], model)
        points: list[tuple[float, float]] = []
        self.fitted_on: list[str] = []
        for step, report, _ in steps:
            if not _clean(pb.conditions.get(step.network)):
                continue
            link, _from = _link(report, baseline)
            point = pull_point(step, report, link, goodput_bps(link, facts.kv_streams), model)
            if point is not None:
                points.append(point)
                self.fitted_on.append(step.id)
        self.pull = pull_fit(points)
        if self.pull is not None:
            how = (
                "vLLM's pulls: a line through (probed RTT p50, transfer p50 - wire time - one "
                f"decode step) of the clean steps {', '.join(self.fitted_on)}"
            )
            for name, value in zip(("link_round_trips", "link_fixed_s"), self.pull, strict=True):
                self.fits.append({"param": name, "value": value, "source": how,
                                  "points": len(points), "max_error_pct": None})  # fmt: skip

    def step_compute(self, step: Step, report: StepReport) -> tuple[dict[str, Any], str]:
        from pdx.accept.predict.calibrate import engine_compute

        own, _ = engine_compute([(step, report)], self.model)
        if "prefill_flops" in own and "decode_hbm_bytes_per_s" in own:
            return {**self.compute, **own}, "the step's own vLLM timings (vllm: series)"
        return self.compute, "the run's vLLM timings (vllm: series)"

    def pull_fields(self) -> dict[str, Any]:
        from pdx.accept.predict.calibrate import VLLM_FLOW

        out: dict[str, Any] = dict(VLLM_FLOW)
        if self.pull is not None:
            out["link_round_trips"], out["link_fixed_s"] = self.pull
        return out


def _clean(c: Any) -> bool:
    """A condition with nothing but delay and a rate: its pulls show the link's own cost
    (an unknown one, a baseline twin's, is not counted)."""
    if c is None:
        return False
    return not (c.loss or c.wan_events or c.kill_prefill_at_s is not None
                or c.link_down_at_s is not None or c.jitter_ms)  # fmt: skip
