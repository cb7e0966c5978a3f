"""Sweeps over one parameter, and the smallest value of a parameter that meets an SLO."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import ValidationError

from pdx.config import set_dotted, validation_problems
from pdx.errors import ConfigError, InputError
from pdx.sim.config import NUMERIC_FIELDS, SimConfig, is_integer_field
from pdx.sim.metrics import ModeResult
from pdx.sim.runner import simulate
from pdx.sim.workload import build_workload

WORKLOAD_PARAMS = ("workload.rate_per_s", "workload.requests", "workload.output_tokens")
SWEEPABLE = (*NUMERIC_FIELDS, *WORKLOAD_PARAMS)
#: Parameters where more is never worse, so a bisection for the smallest one is sound.
MORE_IS_BETTER = (
    "link_bytes_per_s",
    "prefill_flops",
    "decode_hbm_bytes_per_s",
    "prefill_instances",
    "decode_instances",
    "colocated_instances",
)  # not max_decode_batch / decode_kv_budget_bytes: bigger batches help TTFT but hurt ITL
#: The modes a parameter can change; others are not simulated during find-min.
PARAM_MODES: dict[str, tuple[str, ...]] = {
    "link_bytes_per_s": ("disaggregated",),
    "colocated_instances": ("colocated",),
    "chunked_prefill_tokens": ("colocated",),
    "prefill_instances": ("disaggregated",),
    "decode_instances": ("disaggregated",),
    "local_prefill_max_tokens": ("disaggregated",),
}
BISECTION = "bisection (assumes every SLO metric is non-increasing as {param} grows)"


def is_integer_param(param: str) -> bool:
    """True when the parameter holds whole numbers (instances, tokens, requests)."""
    return param in ("workload.requests", "workload.output_tokens") or (
        param in NUMERIC_FIELDS and is_integer_field(param)
    )


def check_param(param: str) -> str:
    """A parameter a sweep can vary, or a clear error."""
    if param not in SWEEPABLE:
        raise InputError("sweep parameter", param, f"one of {', '.join(SWEEPABLE)}")
    return param


def parse_sweep(text: str) -> tuple[str, list[float]]:
    """``PARAM=a:b:n`` → the parameter and ``n`` values from ``a`` to ``b`` (integers rounded)."""
    param, sep, spec = text.partition("=")
    parts = spec.split(":")
    if not sep or len(parts) != 3:
        raise InputError(
            "--sweep", text, "PARAM=start:stop:count, e.g. link_bytes_per_s=5e9:40e9:8"
        )
    check_param(param.strip())
    try:
        lo, hi, n = float(parts[0]), float(parts[1]), int(parts[2])
    except ValueError:
        raise InputError("--sweep", text, "numbers in start:stop:count") from None
    if n < 2 or lo >= hi:
        raise InputError("--sweep", text, "start < stop and count >= 2")
    values = np.linspace(lo, hi, n)
    if is_integer_param(param.strip()):
        values = np.unique(np.round(values))
    return param.strip(), [float(v) for v in values]


def with_value(cfg: SimConfig, param: str, value: float) -> SimConfig:
    """A copy of ``cfg`` with ``param`` (a field or ``workload.x``) set to ``value``."""
    data = cfg.model_dump()
    set_dotted(data, param, int(value) if is_integer_param(param) else value)
    try:
        return SimConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{param}={value:g}", validation_problems(exc)) from None


@dataclass
class SweepPoint:
    """The figures at one value of the swept parameter."""

    value: float
    colocated: ModeResult | None
    disaggregated: ModeResult | None


@dataclass
class SweepResult:
    """A sweep: the points, and where the plot went."""

    param: str
    points: list[SweepPoint]
    percentile_method: str
    plot_path: str | None = None


def run_sweep(cfg: SimConfig, param: str, values: list[float]) -> SweepResult:
    """Simulate every value of ``param``; the workload is drawn once unless it is swept."""
    shared = None if param.startswith("workload.") else build_workload(cfg.workload)
    points = []
    method = ""
    for value in values:
        report = simulate(with_value(cfg, param, value), shared)
        method = report.percentile_method
        points.append(SweepPoint(value, report.colocated, report.disaggregated))
    return SweepResult(param, points, method)


@dataclass
class Evaluation:
    """One value tried by find-min and whether every SLO held there."""

    value: float
    ok: bool
    metrics: dict[str, float]


@dataclass
class FindMinResult:
    """The smallest value of ``param`` meeting every SLO (``None`` if none in range)."""

    param: str
    slo: dict[str, float]
    modes: list[str]
    answer: float | None
    searched_lo: float
    searched_hi: float
    method: str
    evaluations: list[Evaluation] = field(default_factory=list)


def parse_slo(items: list[str]) -> dict[str, float]:
    """``ttft_p99_s=2.5`` items → {metric: bound}. ``*_s`` are upper bounds, goodput lower."""
    allowed = [
        f
        for f, t in ModeResult.__annotations__.items()
        if f.endswith("_s") or f == "goodput_fraction"
    ]
    out: dict[str, float] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or key.strip() not in allowed:
            raise InputError("--slo", item, f"METRIC=VALUE with METRIC one of {', '.join(allowed)}")
        try:
            out[key.strip()] = float(raw)
        except ValueError:
            raise InputError("--slo", item, "a number after '='") from None
    if not out:
        raise InputError("--slo", "", "at least one METRIC=VALUE, e.g. ttft_p99_s=5")
    return out


def _meets(result: ModeResult, slo: dict[str, float]) -> tuple[bool, dict[str, float]]:
    got = {k: float(getattr(result, k)) for k in slo}
    ok = all((got[k] >= v) if k == "goodput_fraction" else (got[k] <= v) for k, v in slo.items())
    return ok and not any(math.isnan(x) for x in got.values()), got


class _Search:
    """Evaluates one value of the parameter over the chosen modes, with a cache."""

    def __init__(self, cfg: SimConfig, param: str, slo: dict[str, float], modes: list[str]):
        self.cfg, self.param, self.slo = cfg, param, slo
        self.modes = modes
        self.workload = build_workload(cfg.workload)
        self.seen: dict[float, Evaluation] = {}

    def ok(self, value: float) -> bool:
        if value not in self.seen:
            cfg = with_value(self.cfg, self.param, value).model_copy(update={"modes": self.modes})
            report = simulate(cfg, self.workload)
            verdicts = [_meets(getattr(report, m), self.slo) for m in self.modes]
            metrics = {
                f"{m}.{k}": v
                for m, (_, got) in zip(self.modes, verdicts, strict=True)
                for k, v in got.items()
            }
            self.seen[value] = Evaluation(value, all(v for v, _ in verdicts), metrics)
        return self.seen[value].ok


def _default_range(cfg: SimConfig, param: str) -> tuple[float, float]:
    current = getattr(cfg, param)
    if is_integer_param(param):
        return 1.0, float(max(64, 4 * (current or 1)))
    if current is None:
        raise InputError("--range", None, f"LOW:HIGH ({param} is unset, so no default range)")
    return current / 1024, current * 1024


def find_min(
    cfg: SimConfig,
    param: str,
    slo: dict[str, float],
    value_range: tuple[float, float] | None = None,
    rel_tol: float = 0.01,
) -> FindMinResult:
    """Smallest ``param`` in the range where every SLO holds, by bisection.

    Integers are exact; real values are narrowed (geometrically) until the bracket is within
    ``rel_tol``, and the answer is its upper end (a value that was simulated and met the SLO).
    """
    if param not in MORE_IS_BETTER:
        raise InputError("--find-min", param, f"one of {', '.join(MORE_IS_BETTER)}")
    modes: list[str] = [m for m in cfg.modes if m in PARAM_MODES.get(param, cfg.modes)]
    if not modes:
        raise InputError("--mode", ",".join(cfg.modes), f"a mode that {param} affects")
    lo, hi = value_range or _default_range(cfg, param)
    if not 0 < lo < hi:
        raise InputError("--range", f"{lo:g}:{hi:g}", "0 < low < high")
    search = _Search(cfg, param, slo, modes)
    result = FindMinResult(param, slo, modes, None, lo, hi, BISECTION.format(param=param))
    if search.ok(lo):
        result.answer = lo
    elif search.ok(hi):
        result.answer = _bisect(search, lo, hi, is_integer_param(param), rel_tol)
    result.evaluations = sorted(search.seen.values(), key=lambda e: e.value)
    return result


def _bisect(search: _Search, lo: float, hi: float, integer: bool, rel_tol: float) -> float:
    """``lo`` fails, ``hi`` meets; narrow the bracket."""
    while (hi - lo > 1) if integer else (hi / lo > 1 + rel_tol):
        mid = float((lo + hi) // 2) if integer else math.sqrt(lo * hi)
        if search.ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


def render_value(param: str, value: float) -> str:
    """A swept value as the user would write it."""
    return f"{int(value)}" if is_integer_param(param) else f"{value:.4g}"


def plain_modes(results: list[Any]) -> list[str]:
    """Modes present in a list of sweep points."""
    return [m for m in ("colocated", "disaggregated") if any(getattr(p, m) for p in results)]
