"""``pdx accept``: deploy or target, apply network conditions, load each step, judge, report.

:class:`AcceptRun` owns everything it starts (deploy process, fault proxy, Locust processes)
and stops all of it on any exit, including Ctrl-C, after writing a report marked incomplete.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pdx.accept.judge import criteria as judge
from pdx.accept.judge.gates import GateContext, StepGates
from pdx.accept.judge.link import judge_link, judge_link_per_step
from pdx.accept.judge.offload import advisory, step_body
from pdx.accept.judge.offload import compare as compare_policies
from pdx.accept.judge.stats import (
    FORMULAS,
    METRIC_NAMES,
    derive_rates,
    read_records,
    recovery_s,
    samples,
    span_s,
    summarize,
    timeline,
    trace_summary,
)
from pdx.accept.load.locust import LocustRun, read_locust_stats, resolve_locustfile, step_args
from pdx.accept.load.metrics import Snapshot, delta, scrape
from pdx.accept.load.resources import TreeSampler
from pdx.accept.playbook import Playbook, playbook_dict
from pdx.accept.predict import remedies
from pdx.accept.report import Report, StepReport, write_report
from pdx.accept.report.write import environment
from pdx.accept.steps import Step, expand_steps, step_criteria
from pdx.accept.target.netns import Topology
from pdx.accept.target.process import DeployProcess, check_reachable
from pdx.accept.target.proxy import ProxyLink, counters_delta, proxy_acts
from pdx.errors import MeasurementError, PdxError

ProgressFn = Callable[[int, Step, float], None]
"""Called about once a second: (step number, step, seconds into the step)."""
StageFn = Callable[[str], None]
"""Called as the run moves on (target up, pre-flight, each step's start and end): one line."""


@dataclass
class StepOutcome:
    """A finished step: its report part, raw records and judgement."""

    step: Step
    report: StepReport
    records: list[dict[str, Any]]
    criteria: list[judge.CriterionResult]
    validity: judge.ValidityResult


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def report_dir_for(out_root: Path, name: str) -> Path:
    """``reports/<UTC time>-<name>/`` (a suffix is added if that directory exists)."""
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    base = out_root / f"{stamp}-{name}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = Path(f"{base}-{n}")
    return path


class AcceptRun:
    """One execution of a playbook. ``report`` / ``report_dir`` are set even when interrupted."""

    def __init__(
        self,
        pb: Playbook,
        playbook_path: Path,
        out_root: Path,
        progress: ProgressFn | None = None,
        stage: StageFn | None = None,
    ) -> None:
        self.pb = pb
        self.playbook_dir = playbook_path.resolve().parent
        self.steps = expand_steps(pb)
        self.report_dir = report_dir_for(out_root, pb.name)
        self.raw_dir = self.report_dir / "raw"
        self.progress = progress
        self.stage = stage or (lambda line: None)
        self.report: Report | None = None
        self.started_at = _now()
        self.outcomes: list[StepOutcome] = []
        self.problems: list[str] = []
        self.interrupted_by = "Ctrl-C"  # or "SIGTERM"; named in the report when cut short
        self.url = ""
        self.deploy: DeployProcess | None = None
        self.link: ProxyLink | None = None
        self.locust: LocustRun | None = None
        self.sampler: TreeSampler | None = None
        self.target_info: dict[str, Any] = {}
        self.preflight: dict[str, Any] | None = None
        self.topology: Topology | None = None
        self.gates: GateContext | None = None
        self.kv_measured: dict[str, Any] | None = None
        self.kv_sizing: dict[str, Any] | None = None  # pre-flight's KV need and budgets
        self.local_nets: set[str] = set()  # conditions whose requests all go pdx_route: local
        self.baseline_outcomes: list[StepOutcome] = []
        self.baseline_rows: list[dict[str, Any]] = []
        self.searches: list[dict[str, Any]] = []  # pdx accept --search fills it
        if pb.baseline == "colocated":
            from pdx.accept.judge.baseline import add_twins

            add_twins(self)

    @property
    def total_s(self) -> float:
        """Planned load time over all steps."""
        return sum(s.duration_s for s in self.steps)

    async def execute(self) -> Report:
        """Run every step; always stop what was started and write the report (partial if cut)."""
        self.raw_dir.mkdir(parents=True, exist_ok=True)
        locustfile = resolve_locustfile(self.pb.load, self.playbook_dir)
        complete = False
        self._stop_on_sigterm()
        try:
            self._size_kv()
            self.stage(f"target: starting ({self._target_kind()})")
            await self._start_target()
            self.stage(f"target: ready at {self.url}")
            self.stage("pre-flight: measuring the KV and probing the link")
            await self._preflight()
            self.gates = self._gate_context()
            if self.pb.load.warmup_requests and self.steps:
                from pdx.accept.load.warmup import warm_up

                self.stage(f"warm-up: {self.pb.load.warmup_requests} requests")
                self.target_info["warmup"] = await warm_up(
                    self.url, self.steps[0], self.pb.load.warmup_requests,
                    load=self.pb.load, target=self.pb.target, seed=self.pb.seed,
                )  # fmt: skip
            await self._run_steps(locustfile)
            complete = True
        except asyncio.CancelledError:
            self.problems.append(f"interrupted ({self.interrupted_by}) before every step ran")
            raise
        except PdxError as exc:
            self.problems.append(f"could not run: {exc}")
            raise
        finally:
            await self._stop_all()
            self.report = self._write(complete)
        return self.report

    async def _run_steps(self, locustfile: Path) -> None:
        """The matrix, step after step (a search runs its probes instead)."""
        if self.pb.baseline == "colocated":
            from pdx.accept.judge.baseline import run_with_twins

            await run_with_twins(self, locustfile)
            return
        for step in self.steps:
            outcome = await self._run_step(step, locustfile)
            for c in outcome.criteria if advisory(self.pb, step) else ():
                c.advisory = True  # matrix.offload: another policy, judged beside the verdict's
            self.outcomes.append(outcome)

    def _stop_on_sigterm(self) -> None:
        """SIGTERM (a CI timeout, a supervisor) stops the run like Ctrl-C: partial report."""
        task = asyncio.current_task()
        if task is None:
            return

        def on_term() -> None:
            self.interrupted_by = "SIGTERM"
            task.cancel()

        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_term)

    # --- target ------------------------------------------------------------------------------

    async def _start_target(self) -> None:
        t = self.pb.target
        if t.url is not None:
            self.url = t.url.rstrip("/")
            self.target_info = {"kind": "url", "url": self.url}
            await check_reachable(self.url + t.ready_path, min(t.ready_timeout_s, 10.0))
            return
        topology = await self._start_topology() if t.netns.enabled else None
        await self._start_pair(topology)

    async def _start_pair(self, topology: Topology | None) -> None:
        """``pdx deploy`` (in the topology's sites when there is one), ready to be loaded."""
        from pdx.accept.target.deploy import start_deploy

        t = self._with_audit(self.pb.target)

        def keep(proc: DeployProcess) -> None:
            self.deploy = proc

        started = await start_deploy(
            t,
            playbook_dir=self.playbook_dir,
            raw_dir=self.raw_dir,
            needs_proxy=self._needs_proxy(),
            on_process=keep,
            topology=topology,
        )
        self.deploy, self.url = started.process, started.url
        if started.proxy is not None:
            self.link = ProxyLink(started.proxy, kernel_shaping=t.netns.enabled)
        self.sampler = TreeSampler(self.deploy.pid) if self.deploy.pid else None
        self.target_info = started.info

    def _with_audit(self, t: Any) -> Any:
        """The deploy writes its KV store audit and decode's request records under raw/, with
        the KV budgets the pre-flight sized (:meth:`_size_kv`)."""
        from pdx.accept.preflight.budget import ttft_budget

        budgets = [*(self.kv_sizing or {}).get("deploy_set", []), *ttft_budget(self.pb, t)]
        if any(item.startswith("kv.audit_dir=") for item in t.deploy_set):
            return t.model_copy(update={"deploy_set": [*t.deploy_set, *budgets]})
        audit = (self.raw_dir / "kv-audit").resolve()
        engines = (self.raw_dir / "engines").resolve()  # engine: vllm keeps instance logs here
        extra = [f"kv.audit_dir={audit}", f"vllm.log_dir={engines}", *budgets]
        return t.model_copy(update={"deploy_set": [*t.deploy_set, *extra]})

    def _size_kv(self) -> None:
        """Before anything starts: each step's KV from measure-kv, the deploy's budgets raised
        to it where the playbook left them, and a run the machine cannot hold stopped here."""
        from pdx.accept.preflight.budget import size_kv, sizing_lines

        self.kv_sizing = size_kv(self.pb, self.playbook_dir, self.steps)
        if self.kv_sizing:
            self.preflight = {"kv_sizing": self.kv_sizing}
            for line in sizing_lines(self.kv_sizing):
                self.stage(f"pre-flight: {line}")

    def _audit_dirs(self) -> list[Path]:
        if self.pb.target.deploy is None:  # a deployment pdx did not start: what was given
            return [self.playbook_dir / d for d in self.pb.target.records_dirs]
        from pdx.accept.preflight.kv import deploy_config

        pb = self.pb.model_copy(update={"target": self._with_audit(self.pb.target)})
        cfg = deploy_config(pb.target, self.playbook_dir)
        # With engine: vllm there is no pdx KV store (no audit log), but decode's KV-load
        # failure records (the silent-fallback gate's) are written there.
        configured = cfg.kv
        return [Path(configured.audit_dir)] if configured.audit_dir else []

    def _gate_context(self) -> GateContext:
        """Deadlines and bounds of the gates, from the deploy config and the probed RTT."""
        from pdx.accept.judge.gates import gate_context

        return gate_context(self.pb, self.playbook_dir, self.url, self.preflight,
                            self._audit_dirs(), self.topology)  # fmt: skip

    def _needs_proxy(self) -> bool:
        """Whether any step needs the proxy (under netns only delay, jitter and cuts do)."""
        return any(self._proxy_acts(s) for s in self.steps)

    def _proxy_acts(self, step: Step) -> bool:
        kernel = self.pb.target.netns.enabled
        return proxy_acts(self.pb.conditions[step.network], kernel_shaping=kernel)

    async def _start_topology(self) -> Topology:
        from pdx.accept.target.netns import check_available

        check_available()
        self.topology = Topology(self.pb.target.netns)
        await self.topology.up()
        return self.topology

    # --- pre-flight --------------------------------------------------------------------------

    async def _preflight(self) -> None:
        pf = self.pb.preflight
        if not (pf.measure_kv or pf.probe_link):
            return
        from pdx.accept.preflight.kv import measure_kv

        self.preflight = self.preflight or {}
        # measure-kv sizes requests even when only the probe was asked for: it gives the demand
        kv = await asyncio.to_thread(measure_kv, self.pb, self.playbook_dir, self._planned_rps())
        if pf.measure_kv:
            self.preflight["measure_kv"] = kv
        if pf.probe_link:
            from pdx.accept.preflight.probe import probe_args, run_probe

            host = self.topology.prefill_addr if self.topology else self._kv_host()
            ns = (self.topology.prefill_ns, self.topology.decode_ns) if self.topology else None
            self.preflight["probe_link"] = await run_probe(
                host, ns, functools.partial(probe_args, self.pb.preflight)
            )
            self.preflight["_kv"] = kv  # for the demand at the achieved load; dropped at write

    def _planned_rps(self) -> float:
        return max((s.rate_rps or 0.0) for s in self.steps) or 1.0

    def _kv_host(self) -> str:
        store = str(self.target_info.get("kv_store") or "127.0.0.1:0")
        return store.rsplit(":", 1)[0].strip("[]")

    async def _stop_all(self) -> None:
        if self.locust is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.locust.stop())
        if self.link is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.link.clear())
        if self.deploy is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.deploy.stop())
        if self.topology is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.topology.down())

    # --- one step ----------------------------------------------------------------------------

    def _target_kind(self) -> str:
        t = self.pb.target
        if t.url is not None:
            return f"the running target {t.url}"
        return "a pair across network namespaces" if t.netns.enabled else "a pair on loopback"

    async def _run_step(self, step: Step, locustfile: Path) -> StepOutcome:
        of = f"/{len(self.steps)}" if step.index < len(self.steps) else ""  # search probes: open
        where = f"step {step.index + 1}{of} {step.id}"
        self.stage(f"{where}: started ({step.duration_s:g} s of load planned)")
        outcome = await self._load_and_judge(step, locustfile)
        v = outcome.validity
        self.stage(
            f"{where}: done in {outcome.report.elapsed_s:.1f} s, {v.requests} requests, "
            f"{'valid' if v.valid else 'NOT valid: ' + '; '.join(v.problems)}"
        )
        return outcome

    async def _load_and_judge(self, step: Step, locustfile: Path) -> StepOutcome:
        step_dir = self.raw_dir / step.id
        step_dir.mkdir(parents=True, exist_ok=True)
        cond = self.pb.conditions[step.network]
        metrics_url = self.url + self.pb.target.metrics_path
        before = await scrape(metrics_url)
        kernel = await self.topology.apply(cond) if self.topology else None
        step_link = await self._probe_step()
        router_before = await self.topology.counters() if self.topology else None
        proxy_before = await self.link.stats() if self.link else None
        if cond.idle_s:  # idle-gap: nothing is sent, then the load starts as a burst
            await asyncio.sleep(cond.idle_s)
        t0 = time.time()
        if self.link is not None:
            await self.link.apply(cond, t0)
        kill = self._schedule_kill(cond, t0)
        wan = self._schedule_wan_events(cond, kernel, t0)
        self.locust = LocustRun(locustfile, step_dir / "locust.log")
        args = step_args(self._step_playbook(step), step, self.url, step_dir)
        drain_limit_s = self._drain_limit_s()
        run = asyncio.create_task(
            self.locust.run(
                args, step.duration_s, step_dir / "locust", self.pb.load.workers, drain_limit_s
            )
        )
        tcp_watch = (
            asyncio.create_task(self.topology.watch_tcp(run))
            if self.topology is not None and kernel is not None
            else None
        )
        resources = await self._watch(step, run, t0)
        rc = await run
        tcp_readings = await tcp_watch if tcp_watch is not None else None
        drain_s = max(0.0, time.time() - t0 - step.duration_s)
        wan_events = await wan if wan is not None else []
        if rc not in (0, 1):  # 1 = Locust saw failed requests; anything else: it did not run
            tail = (step_dir / "locust.log").read_text(errors="replace").strip()[-400:]
            raise MeasurementError(f"Locust exited with code {rc} in {step.id}: {tail}")
        if self.link is not None:
            await self.link.clear()
        after = await scrape(metrics_url)
        proxy_after = await self.link.stats() if self.link else None
        if self.topology is not None and kernel is not None and router_before is not None:
            from pdx.accept.target.netns import counters_delta as router_delta

            kernel["router_counters"] = router_delta(router_before, await self.topology.counters())
            kernel["cross_traffic_achieved"] = await self.topology.stop_cross_traffic()
            kernel["kv_link_cap_gbps"] = self.gates.kv_link_cap_gbps if self.gates else None
            kernel["tcp"] = await self.topology.tcp_between_sites(tcp_readings)  # TCP's own RTT
        gate = await self._collect_gates(step, step_dir, t0)
        outcome = self._finish_step(
            step, step_dir, t0, rc, (before, after), (proxy_before, proxy_after), resources, gate
        )
        outcome.report.summary["drain_s"] = round(drain_s, 3)
        outcome.report.summary["drain_limit_s"] = drain_limit_s
        outcome.report.kernel = kernel
        outcome.report.preflight = {"probe_link": step_link} if step_link is not None else None
        outcome.report.fault_events += wan_events
        if kill is not None:
            outcome.report.fault_events.append(await kill)
            outcome.report.recovery_s = recovery_s(
                outcome.report.timeline, float(cond.kill_prefill_at_s or 0.0), 0.0
            )
        return outcome

    def _step_playbook(self, step: Step) -> Playbook:
        """The playbook the step's load is generated from (a local twin sends pdx_route, a
        step of matrix.offload its policy)."""
        body = step_body(self.pb.target.extra_body, step)
        if step.network in self.local_nets:
            body = {**body, "pdx_route": "local"}
        if body is self.pb.target.extra_body:
            return self.pb
        target = self.pb.target.model_copy(update={"extra_body": body})
        return self.pb.model_copy(update={"target": target})

    def _drain_limit_s(self) -> float:
        """How long requests still open when a step's load stops may take to end: their
        deadline + 2 × RTT (+ 1 s for Locust to notice), so each ends answered, errored or
        overdue — a hang is never cut off as "unfinished" before it is overdue."""
        if self.gates is None:
            return 0.0
        return round(self.gates.deadline_s + 2 * self.gates.rtt_s + 1.0, 3)

    async def _probe_step(self) -> dict[str, Any] | None:
        """The link under this step's condition, before its load (preflight.probe_each_step)."""
        pf = self.pb.preflight
        if not (pf.probe_each_step and pf.probe_link):
            return None
        from pdx.accept.preflight.probe import run_probe, step_probe_args, summary

        host = self.topology.prefill_addr if self.topology else self._kv_host()
        ns = (self.topology.prefill_ns, self.topology.decode_ns) if self.topology else None
        streams = self._deploy_facts().kv_streams if self.pb.target.deploy else pf.probe_streams
        probe = await run_probe(
            host, ns, lambda where: step_probe_args(self.pb.preflight, where, streams)
        )
        probe["summary"] = summary(probe)
        return probe

    def _deploy_facts(self) -> Any:
        from pdx.accept.predict.prediction import deploy_facts

        return deploy_facts(self.pb, self.playbook_dir)

    def _schedule_wan_events(
        self, cond: Any, kernel: dict[str, Any] | None, t0: float
    ) -> asyncio.Task[list[dict[str, Any]]] | None:
        """The step's router-hop changes (conditions.X.wan_events), timed from the load's start."""
        if not cond.wan_events or self.topology is None or kernel is None:
            return None
        events = self.topology.run_events(cond.wan_events, kernel["conditions"], t0)
        return asyncio.create_task(events)

    def _schedule_kill(self, cond: Any, t0: float) -> asyncio.Task[dict[str, Any]] | None:
        """The step's prefill kill (kill_prefill_at_s), as a task, when it has one."""
        if cond.kill_prefill_at_s is None or self.deploy is None or self.deploy.pid is None:
            return None
        from pdx.accept.target.engine_faults import kill_prefill

        endpoints = self.raw_dir / "deploy-endpoints.json"
        return asyncio.create_task(
            kill_prefill(self.deploy.pid, endpoints, cond.kill_prefill_index,
                         cond.kill_prefill_at_s, t0)
        )  # fmt: skip

    async def _collect_gates(self, step: Step, step_dir: Path, t0: float) -> StepGates | None:
        """The step's gate facts: silent fallback, replay, stranded KV, overdue, idle burst."""
        if self.gates is None:
            return None
        from pdx.accept.judge.gates import collect

        idle_s = self.pb.conditions[step.network].idle_s
        rows = read_records(step_dir)
        return await collect(self.gates, rows, t0, idle_s, step.index, step.input_tokens)

    async def _watch(self, step: Step, run: asyncio.Task[int], t0: float) -> list[dict[str, Any]]:
        samples: list[dict[str, Any]] = []
        last_bytes = (await self.link.stats())["bytes_total"] if self.link else 0
        last_t = time.time()
        while not run.done():
            await asyncio.wait({run}, timeout=1.0)
            now = time.time()
            sample: dict[str, Any] = {"t_s": round(now - t0, 3)}
            if self.sampler is not None:
                sample.update(self.sampler.sample())
            if self.link is not None:
                total = (await self.link.stats())["bytes_total"]
                sample["link_bytes_per_s"] = (total - last_bytes) / max(now - last_t, 1e-6)
                last_bytes = total
            last_t = now
            if len(sample) > 1:
                samples.append(sample)
            if self.progress is not None:
                self.progress(step.index, step, min(now - t0, step.duration_s))
        return samples

    def _finish_step(
        self,
        step: Step,
        step_dir: Path,
        t0: float,
        locust_rc: int,
        scrapes: tuple[Snapshot, Snapshot],
        proxy_counts: tuple[dict[str, Any] | None, dict[str, Any] | None],
        resources: list[dict[str, Any]],
        gate: StepGates | None = None,
    ) -> StepOutcome:
        before, after = scrapes
        rows = read_records(step_dir)
        elapsed = span_s(rows)
        summary = summarize(rows, elapsed)
        if gate is not None:
            summary.update(gate.facts)
            summary["gates_not_measured"] = gate.not_measured
        mdelta = delta(before, after) if before.error is None and after.error is None else {}
        derive_rates(summary, mdelta)
        if step.workload is not None:
            summary["trace"] = trace_summary(rows, mdelta)
        summary["locust_exit_code"] = locust_rc
        summary["locust_csv"] = read_locust_stats(step_dir / "locust")
        summary["metrics_errors"] = [e for e in (before.error, after.error) if e]
        cond = self.pb.conditions[step.network]
        validity = judge.check_validity(step, summary, elapsed, self.pb.validity)
        values = {**samples(rows), **(gate.samples if gate else {})}
        j = self.pb.judgement
        results = judge.judge_step(
            step, summary, step_criteria(self.pb, step), values, j.confidence, j.zero_rate_bound
        )
        summary.pop("_kv_stranded_holds_s", None)
        bins = timeline(rows, t0)
        rec_s = None
        if cond.link_down_at_s is not None and cond.link_down_for_s is not None:
            rec_s = recovery_s(bins, cond.link_down_at_s, cond.link_down_for_s)
        proxy = None
        if proxy_counts[0] is not None and proxy_counts[1] is not None:
            proxy = counters_delta(proxy_counts[0], proxy_counts[1])
        report = StepReport(
            id=step.id,
            index=step.index,
            network=step.network,
            condition=cond.model_dump(mode="json"),
            input_tokens=step.input_tokens,
            output_tokens=step.output_tokens,
            concurrency=step.concurrency,
            rate_rps=step.rate_rps,
            duration_s=step.duration_s,
            elapsed_s=elapsed,
            valid=validity.valid,
            validity_problems=validity.problems,
            summary=summary,
            metrics_delta=mdelta,
            proxy=proxy if self._proxy_acts(step) else None,
            fault_events=list(self.link.events) if self.link and self._proxy_acts(step) else [],
            timeline=bins,
            recovery_s=rec_s,
            kv_stranded_byte_s=summary.get("kv_stranded_byte_s"),
            resources=resources,
            raw={"records": f"raw/{step.id}/", "locust_csv": f"raw/{step.id}/locust_stats.csv"},
        )
        return StepOutcome(step, report, rows, results, validity)

    # --- report ------------------------------------------------------------------------------

    def _write(self, complete: bool) -> Report:
        from pdx.accept.report.plots import make_plots

        try:
            judge_link(self)
        except Exception as exc:  # the link figures must never cost the reviewer the report
            self.problems.append(f"link verdict failed: {type(exc).__name__}: {exc}")
        judge_link_per_step(self)
        criteria = [c for o in self.outcomes for c in o.criteria]
        validity = [o.validity for o in self.outcomes]
        valid = complete and bool(validity) and all(v.valid for v in validity)
        failed = [c for c in criteria if c.result == "fail"]
        verdict, exit_code = self._verdict(valid, criteria)
        step_data = [
            (o.step, {**o.report.summary, "elapsed_s": o.report.elapsed_s}) for o in self.outcomes
        ]
        settings, prediction_summary = self._predict()
        recs = remedies.recommendations(
            failed, [v for v in validity if not v.valid], step_data, self.pb.preflight.link_gbps
        )
        recs += remedies.undecided_steps(criteria, step_data)
        if not complete:
            recs.insert(0, "the run did not finish: rerun it to completion before signing off")
        steps = [o.report for o in self.outcomes]
        images: dict[str, str] = {}
        try:
            records = {o.report.id: o.records for o in self.outcomes}
            images = make_plots(steps, records, self.report_dir, self.searches)
        except Exception as exc:  # a plot must never cost the reviewer the report itself
            self.problems.append(f"plots failed: {type(exc).__name__}: {exc}")
        report = Report(
            name=self.pb.name,
            verdict=verdict,
            valid=valid,
            complete=complete,
            exit_code=exit_code,
            started_at=self.started_at,
            finished_at=_now(),
            target=self.target_info,
            criteria=criteria,
            not_judged=judge.not_judged(self.pb, self.steps),
            validity=validity,
            what_to_change=recs,
            recommendations=settings,
            prediction_summary=prediction_summary,
            steps=steps,
            formulas=FORMULAS,
            metric_names=METRIC_NAMES,
            confidence=self.pb.judgement.confidence,
            preflight=self.preflight,
            playbook=playbook_dict(self.pb),
            environment=environment(),
            plots=sorted(images),
            problems=self.problems,
            **self._report_extra(criteria),
        )
        write_report(report, self.report_dir, images)
        return report

    def _verdict(
        self, valid: bool, criteria: list[judge.CriterionResult]
    ) -> tuple[Literal["GO", "NO-GO", "INCONCLUSIVE"], int]:
        """The run's verdict and exit code (a search's come from its limits instead)."""
        verdict = judge.run_verdict(valid, criteria)
        return verdict, judge.EXIT_CODES[verdict]

    def _report_extra(self, criteria: list[judge.CriterionResult]) -> dict[str, Any]:
        """Report fields beyond a plain run's: the loose thresholds (a search adds its own)."""
        from pdx.accept.judge.baseline import summary as baseline_summary
        from pdx.accept.judge.criteria import loose_criteria

        extra: dict[str, Any] = {
            "not_a_constraint": loose_criteria(criteria),
            "search": self.searches or None,
        }
        if self.baseline_rows:
            extra["baseline"] = baseline_summary(self.baseline_rows)
        extra["offload"] = compare_policies(self.pb, self.outcomes, self.playbook_dir,
                                            self.preflight)  # fmt: skip
        return extra

    def _predict(self) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Each step's prediction (set on its report) and the run's recommendations."""
        from pdx.accept.report import no_recommendations

        if not self.pb.prediction.enabled:
            why = "prediction.enabled is off (the recommendations come from the simulator)"
            return no_recommendations(why), None
        try:
            from pdx.accept.predict.forecast import predict_run

            steps = [(o.step, o.report, o.records) for o in self.outcomes]
            pre = {**(self.preflight or {}), "_kv": self.kv_measured}
            return predict_run(self.pb, self.playbook_dir, steps, pre)
        except Exception as exc:  # the prediction must never cost the reviewer the report
            self.problems.append(f"prediction failed: {type(exc).__name__}: {exc}")
            return no_recommendations(f"prediction failed: {exc}"), None
