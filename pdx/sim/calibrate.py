"""Fit the simulator's compute and link parameters to a measured ``pdx accept`` run.

The input is a report.json as plain data (the simulator does not depend on the acceptance
package): its pre-flight measure-kv gives the model (KV bytes per token, parameters), each
step's ``summary`` gives the servers' own per-request figures (``timings_ms``: prefill,
local prefill, KV store put, decode's wait for the KV, first decode step) at that step's
prompt length, and a step's link probe and KV transfers give the link. What is fitted:

- ``prefill_flops`` and ``prefill_fixed_s``: a least-squares line through (prompt tokens,
  median prefill time) over every step, remote and local prefills together (through the
  origin when the run has one prompt length): FLOP/s = 2 × active parameters / slope;
  ``prefill_time_sigma``: the spread around it, ln(p90 / p50) / 1.2816 per step of at least
  5 prefills (a lognormal's), the median over steps;
- ``decode_hbm_bytes_per_s``: per step, (weight bytes + prompt × KV bytes per token) / median
  first decode step, the median over steps (a batch of one: low-load steps);
- ``codec_encode_bytes_per_s``: KV bytes / median KV store put (prefill encodes and stores
  the KV before decode can read it); ``codec_decode_bytes_per_s``: KV bytes / (median wait of
  decode for the KV − median transfer), where that is positive;
- ``link_rtt_s``, ``link_loss``: the step's probe (RTT p50, downstream loss);
  ``link_bytes_per_s``: the KV transfers' own goodput, bytes / (median transfer − round trips ×
  RTT), beside the probe's goodput;
- the workload: the run's prompt lengths (weighted by requests), output length and rate.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdx.errors import InputError

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4, "float32": 4, "bfloat16": 2}


@dataclass
class Fit:
    """One fitted parameter, where it came from and how well the fit matches its points."""

    param: str
    value: float
    source: str
    points: int
    max_error_pct: float | None = None


@dataclass
class Calibration:
    """Simulator fields fitted to a run (``fields``), and the fit behind each."""

    report: str
    link_step: str | None
    fields: dict[str, Any]
    fits: list[Fit] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _p50(summary: dict[str, Any], *path: str) -> float | None:
    node: Any = summary
    for key in path:
        node = (node or {}).get(key)
    value = (node or {}).get("p50") if isinstance(node, dict) else None
    return float(value) if isinstance(value, int | float) and value > 0 else None


def model_fields(report: dict[str, Any]) -> dict[str, Any]:
    """KV bytes per token, active parameters and weight bytes from the pre-flight measure-kv."""
    kv = ((report.get("preflight") or {}).get("measure_kv") or {}).get("result")
    if not kv:
        raise InputError(
            "--calibrate",
            str(report.get("name", "report")),
            "a report with a pre-flight measure-kv (playbook preflight.measure_kv: true)",
        )
    per_token = float(kv["kv_bytes_per_token"]) + float(kv.get("sliding_bytes_per_token") or 0)
    dtype_bytes = DTYPE_BYTES.get(str(kv.get("dtype", "bf16")), 2)
    return {
        "kv_bytes_per_token": per_token,
        "model_params": float(kv["params_active"]),
        "weight_bytes": float(kv["params_total"]) * dtype_bytes,
        "model_preset": kv.get("model"),
    }


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(slope, intercept ≥ 0) of the least-squares line; through the origin when it must be."""
    xs = np.asarray([p[0] for p in points], dtype=float)
    ys = np.asarray([p[1] for p in points], dtype=float)
    if len(set(xs.tolist())) >= 2:
        slope, intercept = np.polyfit(xs, ys, 1)
        if intercept >= 0 and slope > 0:
            return float(slope), float(intercept)
    return float((xs * ys).sum() / (xs * xs).sum()), 0.0


def _max_error_pct(points: list[tuple[float, float]], predict: Any) -> float:
    return max(abs(predict(x) - y) / y * 100 for x, y in points)


def compute_fits(
    steps: list[dict[str, Any]], model: dict[str, Any]
) -> tuple[dict[str, Any], list[Fit]]:
    """Prefill, decode-step and codec fields from the steps' server timings.

    Only the steps with one user at a time, when the run has any: with more, a server's own
    figures hold waits behind the others' work (a local prefill queued behind another, a first
    decode step frozen by another's local prefill), which the simulator models itself.
    """
    fields: dict[str, Any] = {}
    fits: list[Fit] = []
    alone = [s for s in steps if s.get("concurrency") == 1]
    steps = alone or steps
    kv_tok, params, weights = (model["kv_bytes_per_token"], model["model_params"],
                               model["weight_bytes"])  # fmt: skip
    prefill_pts: list[tuple[float, float]] = []
    for s in steps:
        sm, n = s.get("summary") or {}, float(s["input_tokens"])
        for key in ("prefill", "local_prefill"):
            ms = _p50(sm, "timings_ms", key)
            if ms is not None:
                prefill_pts.append((n, ms / 1e3))
    if prefill_pts:
        slope, fixed = _line(prefill_pts)
        fields["prefill_flops"] = 2 * params / slope
        fields["prefill_fixed_s"] = fixed
        err = _max_error_pct(prefill_pts, lambda x: slope * x + fixed)
        fits.append(
            Fit(
                "prefill_flops",
                fields["prefill_flops"],
                "line through (prompt tokens, median prefill s)",
                len(prefill_pts),
                err,
            )
        )
        fits.append(Fit("prefill_fixed_s", fixed, "its intercept", len(prefill_pts), err))
    sigmas = []
    for s in steps:
        for key in ("prefill", "local_prefill"):
            d = ((s.get("summary") or {}).get("timings_ms") or {}).get(key) or {}
            if (d.get("count") or 0) >= 5 and d.get("p50") and d.get("p90"):
                sigmas.append(max(0.0, float(np.log(d["p90"] / d["p50"])) / 1.2816))
    if sigmas:
        fields["prefill_time_sigma"] = min(3.0, statistics.median(sigmas))
        fits.append(Fit("prefill_time_sigma", fields["prefill_time_sigma"],
                        "ln(p90 / p50) / 1.2816 of prefill times, median over steps",
                        len(sigmas)))  # fmt: skip
    hbm, enc, dec = [], [], []
    for s in steps:
        sm, n = s.get("summary") or {}, float(s["input_tokens"])
        kv_bytes = n * kv_tok
        step_ms = _p50(sm, "timings_ms", "first_decode_step")
        if step_ms is not None:
            hbm.append((weights + kv_bytes) / (step_ms / 1e3))
        store_ms = _p50(sm, "timings_ms", "kv_store")
        if store_ms is not None:
            enc.append(kv_bytes / (store_ms / 1e3))
        ready_ms, xfer_ms = _p50(sm, "timings_ms", "decode_kv_ready"), _p50(sm, "transfer_ms")
        if ready_ms is not None and xfer_ms is not None and ready_ms > xfer_ms:
            dec.append(kv_bytes / ((ready_ms - xfer_ms) / 1e3))
    for name, values, how in (
        ("decode_hbm_bytes_per_s", hbm, "(weights + prompt KV) / median first decode step"),
        ("codec_encode_bytes_per_s", enc, "KV bytes / median KV store put"),
        ("codec_decode_bytes_per_s", dec, "KV bytes / (median KV wait - median transfer)"),
    ):
        if values:
            fields[name] = statistics.median(values)
            spread = (max(values) - min(values)) / fields[name] * 100 if len(values) > 1 else None
            fits.append(Fit(name, fields[name], how + ", median over steps", len(values), spread))
    return fields, fits


def _step_probe(report: dict[str, Any], step: dict[str, Any]) -> dict[str, Any]:
    """The step's own link probe, else the run's baseline probe (summary figures)."""
    own = ((step.get("preflight") or {}).get("probe_link") or {}).get("summary")
    if own:
        return dict(own)
    base = ((report.get("preflight") or {}).get("probe_link") or {}).get("summary")
    return dict(base or {})


def link_fits(
    report: dict[str, Any], step: dict[str, Any], model: dict[str, Any], round_trips: float
) -> tuple[dict[str, Any], list[Fit]]:
    """RTT and loss from the step's probe; the KV's goodput from the step's transfers."""
    probe = _step_probe(report, step)
    fields: dict[str, Any] = {"link_round_trips": round_trips}
    fits: list[Fit] = []
    rtt_s = float(probe.get("rtt_p50_ms") or 0.0) / 1e3
    if probe.get("rtt_p50_ms") is not None:
        fields["link_rtt_s"] = rtt_s
        fits.append(Fit("link_rtt_s", rtt_s, f"{step['id']}: probe RTT p50", 1))
    if probe.get("loss_down_pct") is not None:
        fields["link_loss"] = min(0.5, float(probe["loss_down_pct"]) / 100)
        fits.append(Fit("link_loss", fields["link_loss"], f"{step['id']}: probe loss down", 1))
    xfer_ms = _p50(step.get("summary") or {}, "transfer_ms")
    wire = float(step["input_tokens"]) * model["kv_bytes_per_token"]
    if xfer_ms is not None and xfer_ms / 1e3 > round_trips * rtt_s:
        fields["link_bytes_per_s"] = wire / (xfer_ms / 1e3 - round_trips * rtt_s)
        fits.append(
            Fit(
                "link_bytes_per_s",
                fields["link_bytes_per_s"],
                f"{step['id']}: KV bytes / (median transfer - round trips x RTT)",
                1,
            )
        )
    elif probe.get("down_gbps"):
        fields["link_bytes_per_s"] = float(probe["down_gbps"]) * 1e9 / 8
        fits.append(
            Fit(
                "link_bytes_per_s",
                fields["link_bytes_per_s"],
                f"{step['id']}: probe goodput store -> decode (no transfers)",
                1,
            )
        )
    return fields, fits


def _workload(steps: list[dict[str, Any]]) -> dict[str, Any]:
    weights: dict[int, float] = {}
    outs: list[int] = []
    rates: list[float] = []
    for s in steps:
        sm = s.get("summary") or {}
        n = int(sm.get("requests") or 0)
        if n:
            weights[int(s["input_tokens"])] = weights.get(int(s["input_tokens"]), 0) + n
            outs.append(int(s["output_tokens"]))
            rates.append(float(sm.get("achieved_rps") or 0.0))
    if not weights:
        return {}
    lengths = sorted(weights)
    return {
        "prompt_tokens": lengths,
        "prompt_weights": [weights[x] for x in lengths],
        "output_tokens": statistics.median_low(outs),
        "rate_per_s": float(f"{max(statistics.mean(rates), 1e-3):.4g}"),
    }


def calibrate(report: dict[str, Any], link_step: str | None = None) -> Calibration:
    """Simulator fields for the run in ``report`` (a report.json as data)."""
    steps = [s for s in report.get("steps") or [] if (s.get("summary") or {}).get("requests")]
    if not steps:
        raise InputError("--calibrate", str(report.get("name", "report")), "a report with steps")
    model = model_fields(report)
    fields: dict[str, Any] = {
        **model,
        "decode_weight_reads": "per_step",
        "first_token_from": "prefill",
        "link_loss_recovery": "pipelined",
        "link_sharing": "fair",
    }
    compute, fits = compute_fits(steps, model)
    fields.update(compute)
    chosen = steps[0]
    if link_step is not None:
        match = [s for s in steps if s["id"] == link_step or s["id"].split("-", 1)[0] == link_step]
        if not match:
            raise InputError("--calibrate-step", link_step, f"one of {[s['id'] for s in steps]}")
        chosen = match[0]
    used = (chosen.get("prediction_model") or {}).get("fields") or {}  # what the run predicted with
    link, lfits = link_fits(report, chosen, model, float(used.get("link_round_trips", 1)))
    fields.update(link)
    workload = _workload(steps)
    if workload:
        fields["workload"] = workload
    notes = []
    missing = [k for k in ("prefill_flops", "decode_hbm_bytes_per_s", "link_bytes_per_s")
               if k not in fields]  # fmt: skip
    if missing:
        notes.append(f"not in the report, left to the base config: {', '.join(missing)}")
    return Calibration(str(report.get("name", "")), chosen["id"], fields, fits + lfits, notes)


def read_report(path: str) -> dict[str, Any]:
    """A report.json (or the report directory holding one) as plain data."""
    import json
    from pathlib import Path

    p = Path(path)
    p = p / "report.json" if p.is_dir() else p
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise InputError("--calibrate", path, f"a pdx accept report.json ({exc})") from None
    if not isinstance(data, dict) or "steps" not in data:
        raise InputError("--calibrate", path, "a pdx accept report.json (no steps in it)")
    return data
