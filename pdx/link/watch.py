"""``pdx link-watch``: keep measuring a link after go-live, within a stated byte budget, and
judge it with the same rules as ``probe-link``'s verdict, exported as Prometheus series.

One *window* is: UDP probes every ``interval_ms`` for ``window_s`` (RTT, jitter, loss per
direction), then, when due, a short TCP goodput sample capped in bytes and a path-MTU search
capped in size. Each window opens its own session with the probe server, so a server restart
or an outage costs the windows it lasts and nothing else. Loss and the RTT p99 are judged over
a rolling ``loss_window_s`` (a 0.1 % loss limit needs ~3,000 probes to be shown, more than one
window holds), with the verdict's own code (:func:`pdx.link.verdict.judge`), so an alert on
the exported rule status fires on exactly what a ``probe-link`` run would fail.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Info

from pdx import __version__
from pdx.errors import InputError, MeasurementError
from pdx.link import phases
from pdx.link.client import ProbePlan, ProbeSession, parse_target
from pdx.link.stats import clopper_pearson, percentile, rfc3550_jitter
from pdx.link.verdict import VerdictRules, judge
from pdx.units import MIB

RULE_STATES = ["pass", "fail", "indeterminate", "skip"]
VERDICTS = ["GO", "NO-GO", "INCONCLUSIVE"]
IPV4_UDP_HEADER = 28
TCP_OVERHEAD = 1.05  # TCP/IP headers and ACKs on top of a goodput sample's payload (MSS 1448)
CONTROL_BYTES_PER_WINDOW = 8 * 1024  # handshakes, hello, udp_stats, bye, their ACKs: an allowance
MTU_SEARCH_STEPS = 17  # a binary search over 64..65535 takes at most 16 steps, plus the first


@dataclass(frozen=True)
class WatchOptions:
    """What ``link-watch`` needs, validated at the command line."""

    target: str
    secret: bytes | None = None
    window_s: float = 10.0
    interval_ms: float = 50.0
    probe_bytes: int = 64
    loss_window_s: float = 300.0
    goodput_every_s: float = 60.0  # 0: never
    goodput_bytes: int = 8 * MIB
    goodput_s: float = 2.0
    goodput_streams: int = 1
    direction: str = "up"  # up: this host sends the sample; down: the server does
    mtu_every_s: float = 600.0  # 0: never
    mtu_max: int = 9000
    duration_s: float | None = None  # None: until stopped
    max_bytes_per_min: int = 16 * MIB
    connect_timeout_s: float = 5.0
    rules: VerdictRules = field(default_factory=VerdictRules)


def planned_bytes_per_min(opts: WatchOptions) -> dict[str, int]:
    """The most this watch sends in any minute, by kind (IP bytes; the server reflects the
    probes and, with ``direction`` down, sends the goodput sample instead). Goodput samples
    and MTU searches are at least a minute apart, so a minute holds at most one of each."""
    windows_per_min = 60.0 / opts.window_s
    probes = 60_000.0 / opts.interval_ms * (opts.probe_bytes + IPV4_UDP_HEADER)
    goodput = 0.0
    if opts.goodput_every_s > 0:
        share = 1.0 if opts.direction == "up" else 0.03  # down: only ACKs leave this host
        goodput = opts.goodput_bytes * TCP_OVERHEAD * share
    mtu = 0.0
    if opts.mtu_every_s > 0:  # every step of the search failing its 3 tries at the largest size
        mtu = MTU_SEARCH_STEPS * 3 * opts.mtu_max
    control = CONTROL_BYTES_PER_WINDOW * windows_per_min
    plan = {"probes": probes, "goodput": goodput, "mtu": mtu, "control": control}
    out = {k: math.ceil(v) for k, v in plan.items()}
    out["total"] = sum(out.values())
    return out


def check_options(opts: WatchOptions) -> dict[str, int]:
    """Refuse a plan the budget does not hold; the plan per minute otherwise."""
    parse_target(opts.target)
    if opts.direction not in ("up", "down"):
        raise InputError("--direction", opts.direction, "up or down")
    if opts.loss_window_s < opts.window_s:
        raise InputError(
            "--judge-window", opts.loss_window_s, f"at least --window ({opts.window_s:g})"
        )
    plan = planned_bytes_per_min(opts)
    if plan["total"] > opts.max_bytes_per_min:
        parts = ", ".join(f"{k} {v:,}" for k, v in plan.items() if k != "total")
        raise InputError(
            "--max-bytes-per-min",
            opts.max_bytes_per_min,
            f"at least what the plan sends in a minute, {plan['total']:,} B ({parts}); raise "
            "it, or lower --goodput-bytes or --mtu-max, or raise --interval-ms",
        )
    return plan


@dataclass
class Window:
    """What one window measured (``error`` set when it could not)."""

    started: float
    ended: float = 0.0
    sent: int = 0
    up_lost: int = 0
    down_lost: int = 0
    rtt_ms: list[float] = field(default_factory=list)
    jitter_ms: float | None = None
    goodput_gbps: float | None = None
    goodput_bytes: int = 0
    goodput_capped: bool = False
    mtu: int | None = None
    bytes_sent: dict[str, int] = field(default_factory=dict)
    error: str | None = None  # the window measured nothing
    notes: list[str] = field(default_factory=list)  # a goodput sample or MTU search that failed


class WatchMetrics:
    """The exported series, in their own registry."""

    def __init__(self, opts: WatchOptions, plan: dict[str, int]) -> None:
        r = self.registry = CollectorRegistry()
        Info("pdx_link_watch", "What link-watch watches", registry=r).info(
            {"target": opts.target, "version": __version__, "direction": opts.direction}
        )
        budget = Gauge(
            "pdx_link_budget_bytes_per_minute",
            "Most bytes the watch sends a minute",
            ["kind"],
            registry=r,
        )
        for kind, value in plan.items():
            budget.labels(kind).set(value)
        Gauge("pdx_link_window_seconds", "Seconds of UDP probes per window", registry=r).set(
            opts.window_s
        )
        Gauge("pdx_link_judged_window_seconds", "Seconds the rules judge", registry=r).set(
            opts.loss_window_s
        )
        self.up = Gauge("pdx_link_up", "1 when the last window measured the link", registry=r)
        self.windows = Counter("pdx_link_windows", "Windows by outcome", ["outcome"], registry=r)
        self.last = Gauge(
            "pdx_link_last_window_timestamp_seconds", "End of the last window", registry=r
        )
        self.rtt = Gauge(
            "pdx_link_rtt_seconds", "RTT of UDP probes", ["quantile", "window"], registry=r
        )
        self.jitter = Gauge("pdx_link_jitter_seconds", "RFC 3550 jitter, last window", registry=r)
        self.loss = Gauge(
            "pdx_link_loss_ratio",
            "Probe loss over the judged window, with its bounds at the rules' confidence",
            ["direction", "bound"],
            registry=r,
        )
        self.probes = Counter("pdx_link_probes_sent", "UDP probes sent", registry=r)
        self.lost = Counter("pdx_link_probes_lost", "UDP probes lost", ["direction"], registry=r)
        self.goodput = Gauge(
            "pdx_link_goodput_bits_per_second",
            "Last goodput sample (bound: estimate, or lower when the byte cap ended it)",
            ["direction", "bound"],
            registry=r,
        )
        self.goodput_at = Gauge(
            "pdx_link_goodput_timestamp_seconds", "When it was taken", registry=r
        )
        self.mtu = Gauge(
            "pdx_link_path_mtu_bytes", "Largest packet that crossed with DF set", registry=r
        )
        self.sent = Counter("pdx_link_sent_bytes", "Bytes the watch sent", ["kind"], registry=r)
        self.rule = Enum(
            "pdx_link_rule", "Each verdict rule's status", ["rule"], states=RULE_STATES, registry=r
        )
        self.measured = Gauge(
            "pdx_link_rule_measured",
            "What the rule judged (its unit)",
            ["rule", "unit"],
            registry=r,
        )
        self.threshold = Gauge(
            "pdx_link_rule_threshold", "The rule's limit (its unit)", ["rule", "unit"], registry=r
        )
        self.verdict = Enum(
            "pdx_link_verdict",
            "The link verdict over the judged window",
            states=VERDICTS,
            registry=r,
        )


class LinkWatch:
    """Windows one after another until ``duration_s`` or :meth:`stop`."""

    def __init__(self, opts: WatchOptions) -> None:
        self.opts = opts
        self.plan = check_options(opts)
        self.host, self.port = parse_target(opts.target)
        self.metrics = WatchMetrics(opts, self.plan)
        self.history: collections.deque[Window] = collections.deque()
        self.totals: dict[str, int] = collections.defaultdict(int)
        self.by_minute: dict[int, int] = collections.defaultdict(int)  # minutes since start
        self.windows = 0
        self.errors = 0
        self.last_goodput_gbps: float | None = None  # the last sample no byte cap ended
        self._next_goodput = 0.0
        self._next_mtu = 0.0
        self._stop = threading.Event()
        self._probes_stop = threading.Event()  # per window: run_probes sets it when it ends
        self.verdict: dict[str, Any] | None = None
        self.started = time.monotonic()

    def stop(self) -> None:
        """End the watch after the window under way (its probes stop at once)."""
        self._stop.set()
        self._probes_stop.set()

    def run(self, on_window: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Watch until the duration ends or :meth:`stop`; the summary."""
        deadline = math.inf if self.opts.duration_s is None else self.started + self.opts.duration_s
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left < 0.5 * self.opts.window_s:  # no half window left: not worth a window
                break
            record = self.window(min(self.opts.window_s, left))
            if on_window is not None:
                on_window(record)
            if record["error"] is not None:  # an outage: try again a window later
                self._stop.wait(min(self.opts.window_s, max(0.0, deadline - time.monotonic())))
        return self.summary()

    def summary(self) -> dict[str, Any]:
        """Windows, bytes sent against the budget, and the last judgement."""
        elapsed = time.monotonic() - self.started
        sent = dict(self.totals)
        total = sum(sent.values())
        return {
            "target": self.opts.target,
            "elapsed_s": round(elapsed, 3),
            "windows": self.windows,
            "failed_windows": self.errors,
            "sent_bytes": sent | {"total": total},
            "busiest_minute_bytes": max(self.by_minute.values(), default=0),
            "budget_bytes_per_min": self.plan,
            "verdict": self.judgement(),
        }

    # -- one window ---------------------------------------------------------------------
    def window(self, seconds: float) -> dict[str, Any]:
        """Measure one window and update the series; its record."""
        now = time.monotonic()
        w = Window(started=time.time())
        goodput_due = self.opts.goodput_every_s > 0 and now >= self._next_goodput
        mtu_due = self.opts.mtu_every_s > 0 and now >= self._next_mtu
        plan = ProbePlan(
            self.opts.goodput_streams if goodput_due else 1,
            self.opts.goodput_s if goodput_due else 0.0,
        )
        session = ProbeSession(
            self.host, self.port, self.opts.secret, self.opts.connect_timeout_s, plan=plan
        )
        try:
            with session:
                self._probe(session, w, max(seconds, self.opts.interval_ms / 1000.0))
                # A sample that fails keeps the window's probes (noted), and is not retried
                # before its time: a refusing server must not draw it every window.
                if goodput_due and not self._stop.is_set():
                    self._next_goodput = now + self.opts.goodput_every_s
                    self._extra(w, "goodput", lambda: self._goodput_sample(session, w))
                if mtu_due and not self._stop.is_set():
                    self._next_mtu = now + self.opts.mtu_every_s
                    self._extra(w, "mtu", lambda: self._mtu_search(session, w))
        except (MeasurementError, OSError) as exc:
            w.error = str(exc)
        w.bytes_sent["control"] = CONTROL_BYTES_PER_WINDOW
        w.ended = time.time()
        self._record(w)
        return self._window_record(w)

    def _probe(self, session: ProbeSession, w: Window, seconds: float) -> None:
        self._probes_stop = threading.Event()
        if self._stop.is_set():
            self._probes_stop.set()
        run = phases.run_probes(
            session,
            stream=0,
            duration_s=seconds,
            interval_ms=self.opts.interval_ms,
            probe_bytes=self.opts.probe_bytes,
            stop=self._probes_stop,
        )
        w.sent = run.sent
        w.up_lost = max(0, run.sent - run.server_received)
        w.down_lost = max(0, run.server_received - run.received)
        rtt = {seq: ns / 1e6 for seq, ns in run.rtt_ns_by_seq.items()}
        w.rtt_ms = list(rtt.values())
        if rtt:
            w.jitter_ms = rfc3550_jitter(rtt[s] for s in run.arrival_order)
        w.bytes_sent["probes"] = run.sent * (self.opts.probe_bytes + IPV4_UDP_HEADER)

    @staticmethod
    def _extra(w: Window, what: str, run: Callable[[], None]) -> None:
        try:
            run()
        except (MeasurementError, OSError) as exc:
            w.notes.append(f"{what} failed: {exc}")

    def _mtu_search(self, session: ProbeSession, w: Window) -> None:
        result = phases.discover_mtu(session, max_mtu=self.opts.mtu_max)
        w.mtu = result.mtu
        w.bytes_sent["mtu"] = result.bytes_sent

    def _goodput_sample(self, session: ProbeSession, w: Window) -> None:
        """A short sample in 10 ms bins: bytes over the bins from the first byte to the last.
        One the byte cap ended is a lower bound (slow start is in it) and judged by no rule."""
        interval = 0.01
        bins, _ = phases._one_round(
            session,
            self.opts.direction,
            self.opts.goodput_streams,
            self.opts.goodput_s,
            interval,
            self.opts.goodput_bytes,
        )
        moved = sum(bins.values())
        w.goodput_bytes = moved
        per_stream = max(1, self.opts.goodput_bytes // self.opts.goodput_streams)
        w.goodput_capped = moved >= per_stream * self.opts.goodput_streams
        busy = [i for i, n in bins.items() if n > 0]
        if busy:
            span = (max(busy) - min(busy) + 1) * interval
            w.goodput_gbps = moved * 8 / span / 1e9
            if not w.goodput_capped:
                self.last_goodput_gbps = w.goodput_gbps
        sent = moved * TCP_OVERHEAD if self.opts.direction == "up" else moved * 0.03
        w.bytes_sent["goodput"] = math.ceil(sent)

    # -- bookkeeping --------------------------------------------------------------------
    def _record(self, w: Window) -> None:
        m = self.metrics
        self.windows += 1
        minute = int((time.monotonic() - self.started) // 60)
        for kind, n in w.bytes_sent.items():
            self.totals[kind] += n
            self.by_minute[minute] += n
            m.sent.labels(kind).inc(n)
        m.windows.labels("error" if w.error else "ok").inc()
        m.last.set(w.ended)
        if w.error is not None:
            self.errors += 1
            m.up.set(0)
            return
        m.up.set(1)
        self.history.append(w)
        horizon = w.ended - self.opts.loss_window_s
        while self.history and self.history[0].ended < horizon:
            self.history.popleft()
        m.probes.inc(w.sent)
        m.lost.labels("up").inc(w.up_lost)
        m.lost.labels("down").inc(w.down_lost)
        if w.rtt_ms:
            for q in (0.5, 0.9, 0.99):
                m.rtt.labels(str(q), "last").set(percentile(w.rtt_ms, q * 100) / 1000)
        if w.jitter_ms is not None:
            m.jitter.set(w.jitter_ms / 1000)
        if w.goodput_gbps is not None:
            bound = "lower" if w.goodput_capped else "estimate"
            m.goodput.labels(self.opts.direction, bound).set(w.goodput_gbps * 1e9)
            m.goodput_at.set(w.ended)
        if w.mtu is not None:
            m.mtu.set(w.mtu)
        self._export_judgement()

    def rolling_report(self) -> dict[str, Any]:
        """The judged window as a ``probe-link`` report (what :func:`judge` reads)."""
        sent = sum(w.sent for w in self.history)
        up_lost = sum(w.up_lost for w in self.history)
        down_lost = sum(w.down_lost for w in self.history)
        rtts = [r for w in self.history for r in w.rtt_ms]
        report: dict[str, Any] = {"loss": {}, "rtt_ms": {}, "throughput": {}}
        if sent:
            reached = max(sent - up_lost, 0)
            report["loss"] = {
                "probes": sent,
                "up_count": up_lost,
                "down_count": down_lost,
                "up": 100.0 * up_lost / sent,
                "down": 100.0 * down_lost / reached if reached else 0.0,
            }
        if rtts:
            report["rtt_ms"] = {q: percentile(rtts, p) for q, p in (("p50", 50), ("p99", 99))}
        if self.last_goodput_gbps is not None:
            report["throughput"][f"{self.opts.direction}_gbps"] = self.last_goodput_gbps
        jitters = [w.jitter_ms for w in self.history if w.jitter_ms is not None]
        if jitters:  # the jitter and MTU rules: the worst window of the judged span
            report["jitter_ms"] = {"rfc3550": max(jitters)}
        mtus = [w.mtu for w in self.history if w.mtu is not None]
        if mtus:
            report["mtu"] = min(mtus)
        return report

    def judgement(self) -> dict[str, Any]:
        """The verdict over the judged window (rules that need a chunk sweep are skipped)."""
        if self.verdict is None:
            self.verdict = asdict(judge(self.rolling_report(), self.opts.rules))
        return self.verdict

    def _export_judgement(self) -> None:
        m = self.metrics
        report = self.rolling_report()
        rtts = [r for w in self.history for r in w.rtt_ms]
        if rtts:
            for q in (0.5, 0.9, 0.99):
                m.rtt.labels(str(q), "judged").set(percentile(rtts, q * 100) / 1000)
        loss = report["loss"]
        if loss:
            c = self.opts.rules.confidence
            reached = max(loss["probes"] - loss["up_count"], 0)
            for direction, k, n in (
                ("up", loss["up_count"], loss["probes"]),
                ("down", loss["down_count"], reached),
            ):
                low, high = clopper_pearson(k, n, c)
                m.loss.labels(direction, "estimate").set(k / n if n else 0.0)
                m.loss.labels(direction, "lower").set(low)
                m.loss.labels(direction, "upper").set(high)
        verdict = judge(report, self.opts.rules)
        self.verdict = asdict(verdict)
        for rule in verdict.rules:
            m.rule.labels(rule.name).state(rule.status)
            if rule.measured is not None and math.isfinite(rule.measured):
                m.measured.labels(rule.name, rule.unit).set(rule.measured)
            if rule.threshold is not None:
                m.threshold.labels(rule.name, rule.unit).set(rule.threshold)
        m.verdict.state(verdict.result)

    def _window_record(self, w: Window) -> dict[str, Any]:
        """One JSON line per window."""
        record: dict[str, Any] = {
            "at": round(w.ended, 3),
            "window_s": round(w.ended - w.started, 3),
            "error": w.error,
            "notes": list(w.notes),
            "bytes_sent": dict(w.bytes_sent),
        }
        if w.error is None:
            record |= {
                "probes": w.sent,
                "lost": {"up": w.up_lost, "down": w.down_lost},
                "rtt_ms": _rtt_figures(w.rtt_ms),
                "jitter_ms": None if w.jitter_ms is None else round(w.jitter_ms, 3),
                "goodput_gbps": w.goodput_gbps,
                "goodput_bytes": w.goodput_bytes,
                "goodput_capped": w.goodput_capped,
                "mtu": w.mtu,
                "mtu_capped": w.mtu is not None and w.mtu >= self.opts.mtu_max,
            }
            verdict = self.judgement()
            record["judged"] = {
                "seconds": self.opts.loss_window_s,
                "result": verdict["result"],
                "rules": {
                    r["name"]: {
                        "status": r["status"],
                        "measured": r["measured"],
                        "threshold": r["threshold"],
                    }
                    for r in verdict["rules"]
                },
            }
        return record


def _rtt_figures(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "min": round(min(values), 3),
        "p50": round(percentile(values, 50), 3),
        "p99": round(percentile(values, 99), 3),
        "max": round(max(values), 3),
    }
