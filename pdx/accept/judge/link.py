"""The link verdict of a run: the pre-flight probe against the KV demand the load reached, and
``criteria.link_verdict`` on every step (its own probe, or the baseline where the step leaves
the steady link as it was)."""

from __future__ import annotations

from typing import Any, Protocol

from pdx.accept.judge import criteria as judge
from pdx.accept.playbook import Playbook
from pdx.accept.steps import Step, step_criteria


class AcceptRun(Protocol):
    """What the link verdict reads of a run (:class:`pdx.accept.run.AcceptRun`)."""

    pb: Playbook
    preflight: dict[str, Any] | None
    kv_measured: dict[str, Any] | None
    steps: list[Step]

    @property
    def outcomes(self) -> Any: ...

    def _planned_rps(self) -> float: ...


def judge_link(run: AcceptRun) -> None:
    """The probe's verdict against the KV demand at the highest load the run reached."""
    from pdx.accept.preflight.kv import kv_bytes_per_request
    from pdx.accept.preflight.probe import judge_demand, summary

    probe = (run.preflight or {}).get("probe_link")
    kv = (run.preflight or {}).pop("_kv", None)
    run.kv_measured = kv  # the prediction sizes the model from it too
    if probe is None:
        return
    rps: float | None
    if run.steps and run.steps[0].rate_rps is not None:
        rps, how = run._planned_rps(), "highest matrix.rate_rps"
    else:
        achieved = [o.report.summary.get("achieved_rps") or 0.0 for o in run.outcomes]
        rps, how = (max(achieved), "highest achieved req/s of any step") if achieved else (
            None, "no step finished")  # fmt: skip
    budget = run.pb.criteria.ttft_p99_ms or run.pb.criteria.ttft_p50_ms
    confidence = run.pb.judgement.confidence or 0.95
    for each in [probe, *_step_probes(run)]:
        judge_demand(each, kv_bytes_per_request(kv), rps, how, budget, confidence)
        each["summary"] = summary(each)


def _step_probes(run: AcceptRun) -> list[dict[str, Any]]:
    return [
        o.report.preflight["probe_link"]
        for o in run.outcomes
        if o.report.preflight and o.report.preflight.get("probe_link")
    ]


def judge_link_per_step(run: AcceptRun) -> None:
    """criteria.link_verdict on every step: its own probe, else the baseline probe when its
    condition leaves the steady link as it was (cuts, kills and idle gaps do), else none."""
    baseline = ((run.preflight or {}).get("probe_link") or {}).get("report")
    for o in run.outcomes:
        wanted = step_criteria(run.pb, o.step).link_verdict
        if wanted is None or (wanted == "auto" and not run.pb.preflight.probe_link):
            continue
        own = ((o.report.preflight or {}).get("probe_link") or {}).get("report")
        cond = run.pb.conditions[o.step.network]
        steady = bool(cond.delay_ms or cond.jitter_ms or cond.loss or cond.bandwidth_mbps)
        probe = own if own is not None else (None if steady else baseline)
        if not run.pb.preflight.probe_link:
            why = "preflight.probe_link is off: nothing measured the KV link"
        elif probe is None and steady:
            why = (
                "this step's condition changes the link and the link was not probed "
                "under it (preflight.probe_each_step: true measures it)"
            )
        else:
            why = "the link probe did not run or failed (see preflight.probe_link.error)"
        verdict = (probe or {}).get("verdict")
        o.criteria.append(judge.judge_link(o.step.id, verdict, why, run.pb.preflight.advisory))
