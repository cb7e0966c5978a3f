"""What to set, from what the run measured: the report's ``recommendations``.

Each recommendation is ``{"value", "why", "numbers"}``: the setting, one sentence with the
figures behind it, and those figures as data.

- ``local_prefill_max_tokens`` (``router.local_prefill_max_tokens``: prompts shorter than
  this prefill on decode): every step simulated again with each candidate threshold (0, and
  one above each prompt length the run sent) on the link that step measured; the candidate
  whose worst latency-criterion margin over all steps is largest wins (the smaller on a tie);
- ``kv_streams``, ``chunk_size_kb``: ``pdx probe-link``'s own recommendations for the links
  the steps measured (the most stripes any step's link needs; the baseline's chunk sweep);
- ``codec``: the least lossy KV codec (lossless first, then by reconstruction error, each
  measured on a Gaussian bf16 tensor here) that brings the slowest step's KV under both
  probe-link rules: demand ≤ 70 % of the measured goodput, and transfer ≤ 20 % of the TTFT
  budget (P99 transfer within 10–20 % of the end-to-end budget);
- ``prefill_decode_ratio``: prefill and decode instances each pool needs to stay under 70 %
  busy at the busiest step, at the recommended threshold (prefill busy time as the servers
  reported it, decode's from the simulator with the measured step times), checked by
  simulating that step with those pools;
- ``congestion_control``: with loss measured on a step's link (the router hop's own drop
  count under target.netns, else the probe's), what a loss-based algorithm could reach there
  (Mathis: MSS / RTT × 1.22 / √p) against the goodput the step measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pdx.accept.playbook import Criteria
from pdx.accept.predict.prediction import DeployFacts, simulate_step
from pdx.accept.report import RECOMMENDATION_NAMES

NAMES = RECOMMENDATION_NAMES  # the report schema owns the list
LATENCY = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")
TARGET_BUSY = 0.7
MSS = 1448


@dataclass
class StepInput:
    """One step as the recommendations see it."""

    id: str
    input_tokens: int
    criteria: Criteria
    fields: dict[str, Any] | None  # the simulator config of its prediction (None: no link)
    workload: Any
    link: dict[str, Any]  # the probe summary of its link (step's own, else the baseline's)
    probe_report: dict[str, Any] | None
    summary: dict[str, Any]
    elapsed_s: float
    router: dict[str, int] = field(default_factory=dict)  # netns: the router hop's counters

    def loss_pct(self) -> tuple[float, str]:
        """The worst loss measured on this step's link, and by what: the router hop's count of
        wire packets it dropped during the step (netns), else the probe's UDP probes."""
        c = self.router
        if c.get("down_packets_in"):
            return 100.0 * c.get("down_dropped_loss", 0) / c["down_packets_in"], (
                "the router hop dropped that share of the step's wire packets")  # fmt: skip
        probe = max(float(self.link.get("loss_down_pct") or 0),
                    float(self.link.get("loss_up_pct") or 0))  # fmt: skip
        return probe, "the step's UDP probes"


@dataclass
class RunInput:
    """Everything the recommendations read."""

    steps: list[StepInput]
    facts: DeployFacts
    baseline: dict[str, Any] | None  # the pre-flight probe-link report
    kv_bytes_per_token: float | None
    extra: dict[str, Any] = field(default_factory=dict)


def rec(value: Any, why: str, **numbers: Any) -> dict[str, Any]:
    """One recommendation."""
    return {"value": value, "why": why, "numbers": numbers}


def recommend(run: RunInput) -> dict[str, dict[str, Any]]:
    """The six recommendations (value null with the reason when the run cannot tell)."""
    local = local_prefill(run)
    threshold = local["value"]
    return {
        "local_prefill_max_tokens": local,
        "kv_streams": kv_streams(run),
        "chunk_size_kb": chunk_size(run),
        "codec": codec(run),
        "prefill_decode_ratio": pd_ratio(run, threshold),
        "congestion_control": congestion(run),
    }


# --- local prefill threshold -------------------------------------------------------------


def _margins(predicted: dict[str, float | None], crit: Criteria) -> list[tuple[float, str]]:
    out = []
    for name in LATENCY:
        limit, value = getattr(crit, name), predicted.get(name)
        if limit and value is not None:
            out.append(((limit - value) / limit, name))
    second = predicted.get("second_token_p50_ms")
    if not out and second is not None:
        out.append((-float(second), "second_token_p50_ms"))
    return out


def _evaluate(run: RunInput, threshold: int) -> tuple[float, float, str, dict[str, Any]]:
    worst, where, margins = math.inf, "-", []
    per_step: dict[str, Any] = {}
    for s in run.steps:
        if s.fields is None or s.workload is None:
            continue
        fields = {**s.fields, "local_prefill_max_tokens": max(0, threshold - 1)}
        predicted = simulate_step(fields, s.workload)
        per_step[s.id] = {k: predicted.get(k) for k in ("ttft_p50_ms", "tpot_p50_ms",
                                                         "second_token_p50_ms")}  # fmt: skip
        for margin, name in _margins(predicted, s.criteria):
            margins.append(margin)
            if margin < worst:
                worst, where = margin, f"{name} of {s.id.split('-', 1)[0]}"
    mean = sum(margins) / len(margins) if margins else -math.inf
    return worst, mean, where, per_step


def local_prefill(run: RunInput) -> dict[str, Any]:
    """The threshold with the best worst-case latency margin over the run's steps."""
    lengths = sorted({s.input_tokens for s in run.steps if s.fields is not None})
    if not lengths:
        return rec(None, "no step measured its link: nothing to simulate the threshold with")
    current = run.facts.local_prefill_max_tokens
    candidates = sorted({0, *(n + 1 for n in lengths)})
    tried: list[dict[str, Any]] = []
    for c in candidates:
        worst, mean, where, per_step = _evaluate(run, c)
        tried.append({"value": c, "worst_margin": worst, "mean_margin": mean, "worst": where,
                      "steps": per_step})  # fmt: skip
    # the best worst case (to the percent), then the best mean margin, then the smaller value
    best = max(tried, key=lambda t: (round(t["worst_margin"], 2), round(t["mean_margin"], 3),
                                     -t["value"]))  # fmt: skip
    value = best["value"]
    local = [n for n in lengths if n < value]
    shipped = [n for n in lengths if n >= value]
    share = (
        "every prompt length this run sent prefills on decode"
        if not shipped
        else "every prompt ships"
        if not local
        else f"prompts of {', '.join(map(str, local))} tokens prefill on decode, "
        f"{', '.join(map(str, shipped))} ship"
    )
    ranked = "; ".join(
        f"{t['value']}: worst margin {t['worst_margin'] * 100:.0f} % ({t['worst']}), mean "
        f"{t['mean_margin'] * 100:.0f} %"
        for t in tried
    )
    why = (
        f"{value} ({share}): simulated on each step's measured link and requests, it leaves "
        f"the largest worst-case latency margin, then mean margin (candidates — {ranked}); "
        f"now {current}"
    )
    return rec(value, why, current=current, candidates=tried)


# --- transport settings from probe-link ---------------------------------------------------


def kv_streams(run: RunInput) -> dict[str, Any]:
    """The most stripes any step's measured link needs (probe-link's kv.streams)."""
    seen = []
    for s in run.steps:
        r = (s.probe_report or {}).get("recommendations") or {}
        if "kv.streams" in (r.get("set") or {}):
            seen.append((int(r["set"]["kv.streams"]), s.id, r.get("why", "")))
    if not seen and run.baseline and (run.baseline.get("recommendations") or {}).get("set"):
        r = run.baseline["recommendations"]
        seen.append((int(r["set"].get("kv.streams", 1)), "baseline", r.get("why", "")))
    if not seen:
        return rec(None, "no link probe ran (preflight.probe_link)")
    n, where, why = max(seen)
    return rec(
        n,
        f"{n} stripe(s): on the link of {where} {why} (probe-link); now {run.facts.kv_streams}",
        per_step={sid: k for k, sid, _ in seen},
        current=run.facts.kv_streams,
    )


def chunk_size(run: RunInput) -> dict[str, Any]:
    """The chunk size the baseline probe's KV-chunk sweep chose."""
    base = run.baseline or {}
    chunk = ((base.get("recommendations") or {}).get("set") or {}).get("kv.chunk_size_kb")
    sweep = [
        f"{c['chunk_bytes'] // 1024} KiB {c['gbps']:.3f} Gbit/s"
        for c in base.get("chunks") or []
        if c.get("gbps")
    ]
    if chunk is None:
        return rec(None, "the pre-flight probe ran no KV-chunk sweep")
    why = (
        f"{chunk} KiB: the smallest chunk within 90 % of the best goodput in the pre-flight "
        f"sweep ({'; '.join(sweep)}); now {run.facts.chunk_size_kb}"
    )
    return rec(int(chunk), why, sweep=sweep, current=run.facts.chunk_size_kb)


# --- codec ---------------------------------------------------------------------------------


def codec_table() -> list[dict[str, Any]]:
    """Every codec's ratio and relative error on a Gaussian bf16 tensor (1 × 512 × 1024)."""
    import torch

    from pdx.kv.codecs import get_codec
    from pdx.kv.codecs.registry import codec_names

    x = torch.randn(1, 512, 1024, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    rows = []
    for name in codec_names():
        c = get_codec(name)
        blob = c.encode(x, "key")
        err = ((c.decode(blob).float() - x.float()).norm() / x.float().norm()).item()
        rows.append({"codec": name, "ratio": x.numel() * 2 / len(blob), "rel_error": err,
                     "lossless": bool(getattr(c, "lossless", False))})  # fmt: skip
    # lossless first (most compression first), then lossy by reconstruction error
    return sorted(rows, key=lambda r: (not r["lossless"], -r["ratio"] if r["lossless"]
                                       else r["rel_error"]))  # fmt: skip


def _needed_ratio(run: RunInput) -> tuple[float, str]:
    need, why = 1.0, "no step shipped KV"
    for s in run.steps:
        xfer = (s.summary.get("transfer_ms") or {}).get("p50")
        bps = (s.fields or {}).get("link_bytes_per_s")
        if not xfer or not bps:
            continue
        rtt_ms = float(s.link.get("rtt_p50_ms") or 0.0)
        budget = s.criteria.ttft_p99_ms or s.criteria.ttft_p50_ms
        bytes_ms = max(float(xfer) - rtt_ms, 1e-3)  # the part that shrinks with the bytes
        by_time = bytes_ms / max(0.2 * budget - rtt_ms, 1e-3) if budget else 1.0
        demand = float(s.summary.get("kv_bytes") or 0) / max(s.elapsed_s, 1e-9)
        by_bw = demand / (TARGET_BUSY * bps)
        if max(by_time, by_bw) > need:
            need = max(by_time, by_bw)
            why = (
                f"{s.id.split('-', 1)[0]}: transfer p50 {xfer:.0f} ms against 20 % of the "
                f"{budget or 0:.0f} ms TTFT budget, KV demand {demand * 8 / 1e9:.3f} Gbit/s "
                f"against 70 % of {bps * 8 / 1e9:.3f} Gbit/s"
            )
    return need, why


def codec(run: RunInput) -> dict[str, Any]:
    """The least lossy codec whose ratio the slowest step needs."""
    need, where = _needed_ratio(run)
    if need <= 1.0:
        return rec("raw", f"raw: the KV fits the link uncompressed ({where}); now "
                   f"{run.facts.codec}", needed_ratio=need, current=run.facts.codec)  # fmt: skip
    table = codec_table()
    fits = [r for r in table if r["ratio"] >= need]
    pick = fits[0] if fits else max(table, key=lambda r: r["ratio"])
    kind = "lossless" if pick["lossless"] else f"relative error {pick['rel_error']:.3f}"
    if fits:
        why = (f"{pick['codec']} (ratio {pick['ratio']:.2f}, {kind}): the least lossy codec "
               f"giving the {need:.2f}x the KV needs ({where})")  # fmt: skip
    else:
        why = (f"{pick['codec']} (ratio {pick['ratio']:.2f}, {kind}) is the most any codec "
               f"gives, short of the {need:.2f}x needed ({where}): prefill those prompts "
               "locally (local_prefill_max_tokens) or use a faster link")  # fmt: skip
    why += f"; ratios on a Gaussian bf16 tensor, check your model with pdx measure-kv; now " \
           f"{run.facts.codec}"  # fmt: skip
    return rec(pick["codec"], why, needed_ratio=need, table=table, current=run.facts.codec)


# --- prefill : decode ----------------------------------------------------------------------


def _busy(s: StepInput, threshold: int | None) -> dict[str, Any] | None:
    from pdx.sim.config import SimConfig
    from pdx.sim.engine import run_mode
    from pdx.sim.metrics import summarize

    if s.fields is None or s.workload is None:
        return None
    fields = dict(s.fields)
    if threshold is not None:
        fields["local_prefill_max_tokens"] = max(0, threshold - 1)
    cfg = SimConfig.model_validate(fields)
    m = summarize(run_mode(cfg, s.workload, "disaggregated"), cfg)
    t = s.summary.get("timings_ms") or {}
    measured = (
        sum(
            float((t.get(k) or {}).get("mean") or 0) * float((t.get(k) or {}).get("count") or 0)
            for k in ("prefill", "kv_store")
        )
        / 1e3
        / max(s.elapsed_s, 1e-9)
    )
    return {"prefill_busy_measured": measured / cfg.prefill_instances,
            "prefill_busy": m.prefill_utilisation, "decode_busy": m.decode_utilisation,
            "prefill_queue_mean": m.prefill_queue_mean,
            "decode_queue_mean": m.decode_queue_mean}  # fmt: skip


def pd_ratio(run: RunInput, threshold: int | None) -> dict[str, Any]:
    """Instances per pool for ≤ 70 % busy at the busiest step, checked by simulation."""
    busy = {s.id: b for s in run.steps if (b := _busy(s, threshold)) is not None}
    if not busy:
        return rec(None, "no step measured its link: nothing to simulate the pools with")
    f = run.facts
    top_p = max(busy.items(), key=lambda kv: kv[1]["prefill_busy"])
    top_d = max(busy.items(), key=lambda kv: kv[1]["decode_busy"])
    n_p = math.ceil(top_p[1]["prefill_busy"] * f.prefill_instances / TARGET_BUSY - 1e-9)
    n_d = max(1, math.ceil(top_d[1]["decode_busy"] * f.decode_instances / TARGET_BUSY - 1e-9))
    if top_p[1]["prefill_busy"] > 0:
        n_p = max(1, n_p)
    step = next(s for s in run.steps if s.id == top_d[0])
    check = None
    if step.fields is not None:
        fields = {**step.fields, "prefill_instances": max(1, n_p), "decode_instances": n_d}
        if threshold is not None:
            fields["local_prefill_max_tokens"] = max(0, threshold - 1)
        check = simulate_step(fields, step.workload)
    sp, sd = top_p[0].split("-", 1)[0], top_d[0].split("-", 1)[0]
    why = (
        f"{n_p}:{n_d} — at the recommended threshold the busiest step keeps prefill "
        f"{top_p[1]['prefill_busy'] * 100:.0f} % busy ({sp}; the servers reported "
        f"{top_p[1]['prefill_busy_measured'] * 100:.0f} % at the run's own threshold) and decode "
        f"{top_d[1]['decode_busy'] * 100:.0f} % ({sd}), per instance of {f.prefill_instances}:"
        f"{f.decode_instances}; ≤ 70 % busy each needs {n_p}:{n_d}"
    )
    if check is not None:
        why += (
            f"; simulated with {n_p}:{n_d}: TTFT p50 {check['ttft_p50_ms']:.0f} ms, TPOT p50 "
            f"{(check['tpot_p50_ms'] or 0):.1f} ms"
        )
    if n_p == 0:
        why += " (no prompt ships at that threshold: the prefill site is idle)"
    return rec(f"{n_p}:{n_d}", why, busy=busy, check=check,
               current=f"{f.prefill_instances}:{f.decode_instances}")  # fmt: skip


# --- congestion control --------------------------------------------------------------------


def mathis_bps(rtt_s: float, loss: float) -> float:
    """Mathis et al.: one loss-based (Reno/CUBIC-like) stream's rate, MSS / RTT × 1.22 / √p."""
    return MSS * 8 / rtt_s * 1.22 / math.sqrt(loss)


def congestion(run: RunInput) -> dict[str, Any]:
    """BBR where loss would cap a loss-based algorithm under the goodput the KV needs."""
    current = run.facts.congestion_control
    worst: tuple[float, str, StepInput] | None = None
    for s in run.steps:
        loss, how = s.loss_pct()
        if loss > 0 and (worst is None or loss > worst[0]):
            worst = (loss, how, s)
    algos = {s.id: s.link.get("congestion_control") for s in run.steps if s.link}
    if worst is None:
        return rec(current, f"{current}: no step's link measured loss, so the algorithm does "
                   "not limit the KV here (the KV sockets use it; gRPC's use the system "
                   "default)", current=current, algorithms=algos)  # fmt: skip
    loss_pct, how, s = worst
    rtt_s = max(float(s.link.get("rtt_p50_ms") or 0.1), 0.1) / 1e3
    bound = mathis_bps(rtt_s, loss_pct / 100)
    goodput = float((s.fields or {}).get("link_bytes_per_s") or 0) * 8
    short = s.id.split("-", 1)[0]
    value = "bbr" if bound < goodput else current
    why = (
        f"{value}: {short} measured {loss_pct:.3g} % loss ({how}) at {rtt_s * 1e3:.0f} ms RTT, "
        f"where a "
        f"loss-based stream (CUBIC) is bounded to {bound / 1e6:.1f} Mbit/s (Mathis) against the "
        f"{goodput / 1e9:.3f} Gbit/s the link gave with {current}"
    )
    return rec(value, why, loss_pct=loss_pct, rtt_ms=rtt_s * 1e3, mathis_bps=bound,
               goodput_bps=goodput, current=current, algorithms=algos)  # fmt: skip
