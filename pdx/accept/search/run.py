"""``pdx accept PLAYBOOK --search PARAM``: an :class:`AcceptRun` whose steps are a search's probes.

One deployment (and one pre-flight) serves every probe. ``rate`` and ``concurrency`` are
searched once per network condition of the matrix, at its first input and output lengths;
``rtt_ms``, ``loss`` and ``bandwidth_mbps`` once, at the matrix's first load and lengths, on
the first condition with that one setting changed (``rtt_ms`` sets ``delay_ms`` to half the
RTT: the emulators delay each direction). Each probe is a full judged step (validity, every
criterion, the gates); :mod:`pdx.accept.search.limit` picks the values and folds the verdicts in.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pdx.accept.judge import criteria as judge
from pdx.accept.playbook import Playbook
from pdx.accept.run import AcceptRun, StageFn, StepOutcome, report_dir_for
from pdx.accept.search.limit import (
    MAX_PROBES,
    Axis,
    Bracket,
    Probe,
    axis_for,
    probe_verdict,
    result,
    search_exit_code,
    worst_ratio,
)
from pdx.accept.steps import Step, expand_steps

ProbeFn = Callable[[Probe, dict[str, Any]], None]
"""Called after every probe: the probe, and its search so far (param, condition)."""
DEFAULT_OVERHEAD_S = 15.0  # a probe's time beyond its load (gates, replay) before one is measured


def search_playbook(pb: Playbook) -> Playbook:
    """The playbook a search runs: ``rate`` switches the matrix to open loop (and back)."""
    m = pb.matrix
    if pb.search.param == "rate" and m.rate_rps is None:
        m = m.model_copy(update={"concurrency": None, "rate_rps": [1.0]})
    elif pb.search.param == "concurrency" and m.concurrency is None:
        m = m.model_copy(update={"concurrency": [1], "rate_rps": None})
    return pb.model_copy(update={"matrix": m, "conditions": dict(pb.conditions)})


def default_axis(pb: Playbook) -> Axis:
    """The search's axis; ``rate`` without a range starts where one probe holds the sample a
    threshold of 0 needs (judgement.zero_rate_bound at judgement.confidence)."""
    axis = axis_for(pb.search)
    if pb.search.param != "rate" or pb.search.range is not None:
        return axis
    lo = min(axis.hi / 4, max(axis.lo, sample_needed(pb) / probe_duration(pb)))
    return Axis(axis.param, float(f"{lo:.3g}"), axis.hi, axis.resolution)


def sample_needed(pb: Playbook) -> int:
    """Requests a threshold of 0 needs, none seen, to bound its rate (299 for 1 % at 95 %)."""
    j = pb.judgement
    conf = j.confidence or 0.95
    return math.ceil(math.log(1 - conf) / math.log(1 - j.zero_rate_bound))


def probe_duration(pb: Playbook, rate: float | None = None) -> float:
    """A probe's load duration; at a rate too low to send the sample in it, long enough to
    (+15 %), up to 4 × the duration asked for."""
    base = pb.search.probe_duration_s or pb.matrix.duration_s
    if rate is None:
        return base
    return min(4 * base, max(base, float(math.ceil(sample_needed(pb) * 1.15 / rate))))


class SearchRun(AcceptRun):
    """A search over one parameter, every probe a judged step of one report."""

    def __init__(
        self,
        pb: Playbook,
        playbook_path: Path,
        out_root: Path,
        on_probe: ProbeFn | None = None,
        stage: StageFn | None = None,
    ) -> None:
        pb = search_playbook(pb)
        super().__init__(pb, playbook_path, out_root, None, stage)
        self.report_dir = report_dir_for(out_root, f"{pb.name}-search-{pb.search.param}")
        self.raw_dir = self.report_dir / "raw"
        self.axis = default_axis(pb)
        self.on_probe = on_probe
        self.capacity: str | None = None
        self._complete = False  # set when the report is written
        self.contexts = self._contexts()
        self._index = 0
        self._deadline = math.inf
        self._overheads: list[float] = []
        # the first probe of each search stands in for the plan (proxy needed? planned rps?)
        self.steps = [self._step(self.axis.best, net, tpl, probe_duration(pb), dry=True)
                      for net, tpl in self.contexts]  # fmt: skip

    def _contexts(self) -> list[tuple[str, Step]]:
        m = self.pb.matrix
        conc = m.concurrency[0] if m.concurrency else None
        rate = m.rate_rps[0] if m.rate_rps else None
        if m.workload:  # a trace: its first step; a rate search paces its replay
            tpl = expand_steps(self.pb)[0]
        else:
            assert m.input_tokens and m.output_tokens  # the matrix's validator says so
            tpl = Step(0, m.input_tokens[0], m.output_tokens[0], conc, rate, "", m.duration_s)
        nets = m.network if self.axis.param in ("rate", "concurrency") else m.network[:1]
        if self.pb.baseline == "colocated":  # each search again with every request local
            from pdx.accept.judge.baseline import twin_name

            nets = [n for net in nets for n in (net, twin_name(net))]
        return [(net, tpl) for net in nets]

    def _step(self, value: float, net: str, tpl: Step, duration: float, dry: bool = False) -> Step:
        """The probe's step: its load or its condition carries ``value``."""
        p = self.axis.param
        conc, rate = tpl.concurrency, tpl.rate_rps
        if p == "rate":
            rate = value
        elif p == "concurrency":
            conc = int(value)
        else:
            net = self._condition(net, value)
        index = self._index
        if not dry:
            self._index += 1
        scale = tpl.time_scale
        if tpl.workload is not None and p == "rate" and tpl.rate_rps:
            scale = (tpl.time_scale or 1.0) * tpl.rate_rps / value  # the window at this rate
        return Step(index, tpl.input_tokens, tpl.output_tokens, conc, rate, net, duration,
                    workload=tpl.workload, time_scale=scale)  # fmt: skip

    def _condition(self, base: str, value: float) -> str:
        """A condition named ``<base>-<param><value>``: the base with the searched setting."""
        p = self.axis.param
        name = f"{base}-{p.replace('_', '')}{value:g}"
        if name not in self.pb.conditions:
            field = {"rtt_ms": "delay_ms", "loss": "loss", "bandwidth_mbps": "bandwidth_mbps"}[p]
            v = value / 2 if p == "rtt_ms" else value
            self.pb.conditions[name] = self.pb.conditions[base].model_copy(update={field: v})
        if base in self.local_nets:
            self.local_nets.add(name)
        return name

    async def _run_steps(self, locustfile: Path) -> None:
        end = time.monotonic() + self.pb.search.budget_s
        self.steps = []
        for i, (net, tpl) in enumerate(self.contexts):
            # each search gets an equal share of what is left: one cannot starve the next
            self._deadline = time.monotonic() + (end - time.monotonic()) / (len(self.contexts) - i)
            found = await self._search(net, tpl, locustfile)
            if self.pb.baseline == "colocated":
                found["route"] = "colocated" if net in self.local_nets else "split"
            self.searches.append(found)
        if self.pb.baseline == "colocated":
            from pdx.accept.judge.baseline import capacity_line

            self.baseline_rows = []
            self.capacity = capacity_line(self.searches)

    async def _search(self, net: str, tpl: Step, locustfile: Path) -> dict[str, Any]:
        bracket = Bracket(self.axis, confirm=self.pb.search.confirm)
        probes: list[Probe] = []
        prediction: dict[str, Any] | None = None
        budget_left = True
        while len(probes) < MAX_PROBES:
            value = bracket.next_value((prediction or {}).get("predicted_limit"))
            if value is None:
                break
            again = value in bracket.go_counts
            final = await self._probe(value, net, tpl, locustfile, probes, again)
            if final is None:
                budget_left = False
                break
            bracket.record(value, final.verdict)
            if prediction is None:
                prediction = await self._predict_limit(self.outcomes[-1])
        return result(bracket, probes, net, budget_left, prediction)

    async def _probe(
        self,
        value: float,
        net: str,
        tpl: Step,
        locustfile: Path,
        probes: list[Probe],
        confirmation: bool = False,
    ) -> Probe | None:
        """One value, extended while INCONCLUSIVE; None when the budget cannot pay for it."""
        duration = probe_duration(self.pb, value if self.axis.param == "rate" else None)
        final: Probe | None = None
        for attempt in range(1, self.pb.search.max_extensions + 2):
            if time.monotonic() + duration + self._overhead() > self._deadline:
                if final is not None:
                    final.superseded = False
                return final
            step = self._step(value, net, tpl, duration)
            self.steps.append(step)
            t = time.monotonic()
            if self.outcomes and self.pb.search.fresh_deploy and self.pb.target.deploy:
                await self._fresh_pair()
            outcome = await self._run_step(step, locustfile)
            wall = time.monotonic() - t
            self._overheads.append(max(0.0, wall - duration))
            self.outcomes.append(outcome)
            final = self._judge_probe(value, outcome, attempt, wall)
            final.confirmation = confirmation
            probes.append(final)
            if self.on_probe is not None:
                self.on_probe(final, {"param": self.axis.param, "condition": net})
            if final.verdict != "INCONCLUSIVE":
                break
            final.superseded = attempt <= self.pb.search.max_extensions
            duration = self._extended(duration, outcome)
        if final is not None:
            final.superseded = False
        return final

    async def _fresh_pair(self) -> None:
        """Stop the deployment and start it again, warmed up as the first one was."""
        if self.link is not None:
            with contextlib.suppress(Exception):
                await self.link.clear()
            self.link = None
        if self.deploy is not None:
            await self.deploy.stop()
        await self._start_pair(self.topology)
        self.gates = self._gate_context()
        if self.pb.load.warmup_requests and self.steps:
            from pdx.accept.load.warmup import warm_up

            pb = self.pb
            await warm_up(self.url, self.steps[-1], pb.load.warmup_requests,
                          load=pb.load, target=pb.target, seed=pb.seed)  # fmt: skip

    def _extended(self, duration: float, o: StepOutcome) -> float:
        """Twice as long, or as long as the sample its undecided criteria name needs (+10 %),
        whichever is longer, up to 8 × the probe duration."""
        need = max((c.requests_needed or 0 for c in o.criteria if c.result == "indeterminate"),
                   default=0)  # fmt: skip
        got = max(1, o.validity.requests)
        longer = max(2 * duration, duration * need / got * 1.1 if need else 0.0)
        return float(math.ceil(min(8 * probe_duration(self.pb), longer)))

    def _overhead(self) -> float:
        return max(self._overheads[-3:]) if self._overheads else DEFAULT_OVERHEAD_S

    def _judge_probe(self, value: float, o: StepOutcome, attempt: int, wall: float) -> Probe:
        frac = o.validity.load_fraction
        short = frac is not None and frac < self.pb.validity.min_load_fraction
        verdict, failed, open_ = probe_verdict(o.validity.valid, short, o.criteria)
        ratio, binding = worst_ratio(o.criteria)
        return Probe(
            value=value,
            verdict=verdict,
            step=o.step.id,
            duration_s=o.step.duration_s,
            requests=o.validity.requests,
            valid=o.validity.valid,
            failed=failed,
            undecided=open_,
            worst_ratio=ratio,
            binding=binding,
            attempt=attempt,
            wall_s=round(wall, 1),
        )

    async def _predict_limit(self, first: StepOutcome) -> dict[str, Any]:
        """The simulator's limit, calibrated on the search's first probe."""
        from pdx.accept.search.predict import LimitModel, predict

        try:
            model = LimitModel(self.pb, self.playbook_dir, self.axis, first.step,
                               first.report, first.records,
                               dict(self.preflight or {}))  # fmt: skip
            return await asyncio.to_thread(predict, model)
        except Exception as exc:  # a failed prediction only costs the search its head start
            self.problems.append(f"search prediction failed: {type(exc).__name__}: {exc}")
            return {"predicted_limit": None, "why_not": f"{type(exc).__name__}: {exc}"}

    def _report_extra(self, criteria: list[judge.CriterionResult]) -> dict[str, Any]:
        extra = super()._report_extra(criteria)
        if self.capacity is not None:
            extra["baseline"] = {"kind": "colocated", "summary": self.capacity, "counts": {},
                                 "steps": [], "capacity": self.capacity}  # fmt: skip
        return extra

    def _write(self, complete: bool) -> Any:
        self._complete = complete
        return super()._write(complete)

    def _verdict(
        self, valid: bool, criteria: list[judge.CriterionResult]
    ) -> tuple[Literal["GO", "NO-GO", "INCONCLUSIVE"], int]:
        """GO when every searched condition has a limit (its probes there were GO), NO-GO when
        one is NO-GO at the range's good end, INCONCLUSIVE otherwise or when cut short. (A
        search's NO-GO probes are expected: ``valid`` says whether every probe was valid.)"""
        code = search_exit_code(self.searches) if self.searches and self._complete else 3
        names: dict[int, Literal["GO", "NO-GO", "INCONCLUSIVE"]] = {
            0: "GO", 1: "NO-GO", 3: "INCONCLUSIVE"}  # fmt: skip
        return names[code], code
