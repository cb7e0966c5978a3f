"""``--search router.offload.threshold_tokens``: the offload threshold that pays, measured.

Production P/D routers send a prompt to the prefill site when the part the decode has not
cached reaches a threshold (llm-d's ``nonCachedTokens``, Dynamo's ``eff_isl_threshold``), set by
hand. This search measures it. The threshold is probed on a ladder — LO, 2·LO, 4·LO, … up to HI
or the step's longest prompt, past which every prompt prefills where it decodes — each probe a
full judged step on the same deployment, every request sending ``pdx_offload:
{threshold_tokens}`` (a trace step's tokens are salted by step: no probe finds the caches an
earlier one warmed). Per probe: goodput (requests within every per-request latency threshold
per second, Garwood interval), the KV bytes that crossed and the share offloaded.

The answer: of the GO probes whose goodput the sample cannot tell from the best probe's (their
intervals overlap), the one that ships the fewest KV bytes — the lowest egress that keeps the
best goodput. It is probed again (``search.confirm`` times) and must be GO again. Its bracket
is the run of ladder values around it that the sample could not tell from the best either:
any threshold in it pays the same, as far as this sample shows.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from pdx.accept.judge.baseline import above, side
from pdx.accept.run import StepOutcome
from pdx.accept.search.limit import THRESHOLD, Probe
from pdx.accept.search.run import SearchRun
from pdx.accept.steps import Step, step_criteria

#: Criteria that judge the KV path: a probe that sent few requests across cannot show them.
KV_PATH = ("transfer_success_min", "retry_rate_max", "silent_fallback_max", "output_mismatch_max",
           "kv_stranded_max_s", "transfer_p50_ms", "transfer_p99_ms")  # fmt: skip
EXIT = {"found": 0, "no_go": 1, "disputed": 3, "budget_exhausted": 3, "no_data": 3}


def ladder(lo: float, hi: float, longest: int) -> list[int]:
    """LO, 2·LO, 4·LO, … while below HI and the longest prompt; then the first value at or past
    either (every prompt local when it is the prompt's)."""
    top = min(hi, float(longest))
    out, v = [], max(1.0, lo)
    while v < top:
        out.append(round(v))
        v *= 2
    out.append(round(top))
    return sorted(set(out))


class ThresholdSearch(SearchRun):
    """A search of the offload threshold for goodput (and, at equal goodput, the least egress)."""

    _unshown: dict[str, list[str]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._unshown = {}
        super().__init__(*args, **kwargs)

    def _step(self, value: float, net: str, tpl: Step, duration: float, dry: bool = False) -> Step:
        index = self._index
        if not dry:
            self._index += 1
        return replace(tpl, index=index, network=net, duration_s=duration,
                       threshold_tokens=int(value))  # fmt: skip

    async def _search(self, net: str, tpl: Step, locustfile: Path) -> dict[str, Any]:
        points: list[dict[str, Any]] = []
        probes: list[Probe] = []
        budget_left = True
        for value in ladder(self.axis.lo, self.axis.hi, tpl.input_tokens):
            final = await self._probe(value, net, tpl, locustfile, probes)
            if final is None:
                budget_left = False
                break
            points.append(self._point(final, self.outcomes[-1]))
        answer = choose(points)
        confirmed = None
        if answer.get("pick") is not None and budget_left:
            confirmed = True
            for _ in range(self.pb.search.confirm):
                again = await self._probe(answer["pick"], net, tpl, locustfile, probes, True)
                if again is None:
                    budget_left = False
                    break
                confirmed = confirmed and again.verdict == "GO"
        return self._result(net, tpl, points, probes, answer, confirmed, budget_left)

    def _judge_probe(self, value: float, o: StepOutcome, attempt: int, wall: float) -> Probe:
        """As any probe, except that a criterion of the KV path left undecided does not hold a
        threshold back: a high threshold sends few requests (or none) across, so no sample
        there can show those rates; the point lists them (``kv_path_undecided``)."""
        open_ = ("indeterminate", "not_measured")
        unshown = [c for c in o.criteria if c.name in KV_PATH and c.result in open_]
        kept = [c for c in o.criteria if c not in unshown]
        self._unshown[o.step.id] = sorted({c.name for c in unshown})
        return super()._judge_probe(value, replace(o, criteria=kept), attempt, wall)

    def _point(self, p: Probe, o: StepOutcome) -> dict[str, Any]:
        """A probe's figures: verdict, goodput with its interval, KV bytes, share offloaded."""
        crit, conf = step_criteria(self.pb, o.step), self.pb.judgement.confidence
        figures = side(o.records, float(o.report.elapsed_s or 0.0), crit, conf, ())
        pdx = [r.get("pdx") or {} for r in o.records]
        shipped = [int(x.get("kv_bytes") or 0) for x in pdx if x.get("route") == "disaggregated"]
        return {
            "value": int(p.value),
            "verdict": p.verdict,
            "step": o.step.id,
            "requests": len(o.records),
            "goodput_rps": figures["goodput_rps"],
            "kv_bytes": sum(shipped),
            "offloaded_share": round(len(shipped) / len(o.records), 4) if o.records else None,
            "kv_path_undecided": self._unshown.get(o.step.id, []),
        }

    def _result(
        self,
        net: str,
        tpl: Step,
        points: list[dict[str, Any]],
        probes: list[Probe],
        answer: dict[str, Any],
        confirmed: bool | None,
        budget_left: bool,
    ) -> dict[str, Any]:
        pick = answer.get("pick")
        if not points:
            outcome = "no_data"
        elif pick is None:
            outcome = "no_go"
        elif confirmed is False:
            outcome = "disputed"
        elif not budget_left:
            outcome = "budget_exhausted"
        else:
            outcome = "found"
        policy = self._policy()
        return {
            "param": THRESHOLD,
            "unit": "tokens",
            "condition": net,
            "range": [self.axis.lo, self.axis.hi],
            "resolution": None,
            "kind": "threshold",
            "policy": policy,
            "limit": pick if outcome in ("found", "budget_exhausted") else None,
            "bracket": answer.get("bracket") or [None, None],
            "best": answer.get("best"),
            "indistinguishable": answer.get("same", []),
            "points": points,
            "outcome": outcome,
            "exit_code": EXIT[outcome],
            "confirm": self.pb.search.confirm,
            "confirmed": bool(confirmed),
            "undecided": [], "non_monotone": [], "disputed": [pick] if confirmed is False else [],
            "predicted_limit": None,
            "prediction": {"predicted_limit": None,
                           "why_not": "the simulator does not model offload thresholds"},
            "extrapolation": None,
            "settings": settings(pick, policy) if outcome == "found" else None,
            "probes": [asdict(p) for p in probes],
            "steps_run": len(probes),
            "wall_s": round(sum(p.wall_s for p in probes), 1),
            "longest_prompt_tokens": tpl.input_tokens,
        }  # fmt: skip

    def _policy(self) -> str | None:
        """The deployed offload policy (pdx's own deploy; None for a target pdx did not start)."""
        if self.pb.target.deploy is None:
            return None
        from pdx.accept.preflight.kv import deploy_config

        cfg = deploy_config(self.pb.target, self.playbook_dir)
        return str(cfg.router.offload.policy)

    async def _predict_limit(self, first: StepOutcome) -> dict[str, Any]:
        return {"predicted_limit": None}


def choose(points: list[dict[str, Any]]) -> dict[str, Any]:
    """The best goodput, the probes the sample cannot tell from it, and of those the GO one
    with the fewest KV bytes (``pick``) with its bracket of neighbouring such values."""
    measured = [p for p in points if p["goodput_rps"]["interval"]]
    if not measured:
        return {}
    best = max(measured, key=lambda p: (p["goodput_rps"]["value"], -p["kv_bytes"]))
    same = sorted(p["value"] for p in measured if not above(best["goodput_rps"], p["goodput_rps"]))
    go = [p for p in measured if p["value"] in same and p["verdict"] == "GO"]
    out: dict[str, Any] = {"best": best["value"], "same": same}
    if not go:
        return out
    pick = min(go, key=lambda p: (p["kv_bytes"], -p["value"]))["value"]
    values = sorted(p["value"] for p in measured)
    i = j = values.index(pick)
    while i > 0 and values[i - 1] in same:
        i -= 1
    while j + 1 < len(values) and values[j + 1] in same:
        j += 1
    return out | {"pick": pick, "bracket": [values[i], values[j]]}


def settings(value: int | None, policy: str | None) -> dict[str, Any] | None:
    """The found threshold as pdx's, llm-d's and Dynamo's settings (text to paste)."""
    if value is None:
        return None
    out: dict[str, Any] = {
        "pdx": f"router: {{offload: {{policy: {policy or 'uncached'}, threshold_tokens: {value}}}}}"
    }
    if policy in (None, "uncached"):
        out["llm-d"] = ("plugins: [{type: prefix-based-pd-decider, parameters: "
                        f"{{nonCachedTokens: {value}}}}}]")  # fmt: skip
        cfg = json.dumps({"policy": "isl_bounding", "eff_isl_threshold": value})
        out["dynamo"] = (f"--router-conditional-disagg --router-conditional-disagg-config '{cfg}' "
                         "(Dynamo also keeps local a prompt mostly cached, eff_isl_ratio_threshold;"
                         " pdx's uncached policy does not)")  # fmt: skip
    else:
        out["why_not_others"] = (f"llm-d and Dynamo decide on the uncached length; this search "
                                 f"ran pdx's {policy} policy")  # fmt: skip
    return out
