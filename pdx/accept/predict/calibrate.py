"""The simulator calibrated on vLLM's own timings, for the steps of an ``engine: vllm`` run.

pdx's pair reports its server timings per request (prefill, KV store, the first decode step);
vLLM reports its own, summed, in the ``vllm:`` series the gateway re-exposes per instance, and
a step's ``metrics_delta`` holds what each instance did during the step:

- prefill: prefill's ``vllm:time_to_first_token_seconds`` (arrival at the prefill server →
  its one token: scheduling and the forward pass) per request → ``prefill_flops``;
- decode step: decode's ``vllm:inter_token_latency_seconds`` per token at its mean batch
  (``vllm:iteration_tokens_total`` per iteration) → the decode step the simulator derives
  from ``decode_hbm_bytes_per_s``;
- the pull: decode asks prefill's NIXL agent for the blocks (UCX over TCP) after the gateway
  hands it the KV parameters. How many round trips of the link that costs is NIXL's and UCX's
  protocol (a read request, the data in TCP windows that may have shrunk while the
  connection idled, decode noticing the pull is done on its next poll), not pdx's: it is
  calibrated on the run's *clean* steps (no loss, no cut, no kill, no events), a line through
  (probed RTT, transfer p50 − the bytes at the probed goodput − one decode step): its slope is
  ``link_round_trips``, its intercept ``link_fixed_s``. Those steps' transfer figures are
  fitted, not predicted; the lossy and faulted steps, and every TTFT and TPOT, are predicted.

vLLM's ``transfer_ms`` is the gateway's decode call → decode's first token, so the predicted
figure is the same span: the transfer's start → the first token (``first_token_from:
decode``); the gateway sits in the decode site, so the prefill call and its answer cross the
link first (``prefill_over_link``).
"""

from __future__ import annotations

from typing import Any

from pdx.accept.load.metrics import split_key

# The simulator's fields for vLLM's flow (above): the first token from decode's first step,
# the prompt across the link to prefill and its answer back.
VLLM_FLOW: dict[str, Any] = {"first_token_from": "decode", "prefill_over_link": True}


def _mean(delta: dict[str, float], name: str, role: str) -> float | None:
    """Mean of a histogram over the instances of one role during the step (sum / count)."""
    total = count = 0.0
    for key, value in delta.items():
        sample, labels = split_key(key)
        if not labels.get("pdx_instance", "").startswith(role):
            continue
        if sample == name + "_sum":
            total += value
        elif sample == name + "_count":
            count += value
    return total / count if count > 0 else None


def engine_compute(
    steps: list[tuple[Any, Any]], model: dict[str, Any]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``prefill_flops`` and ``decode_hbm_bytes_per_s`` from vLLM's own timings: the median
    over the steps (``(step, report)`` pairs) that have them, and how each was derived."""
    params, weights, kv_tok = (
        model["model_params"],
        model["weight_bytes"],
        model["kv_bytes_per_token"],
    )
    flops: list[float] = []
    hbm: list[float] = []
    for step, report in steps:
        delta = report.metrics_delta or {}
        prefill_s = _mean(delta, "vllm:time_to_first_token_seconds", "prefill")
        if prefill_s:
            flops.append(2 * params * step.input_tokens / prefill_s)
        itl_s = _mean(delta, "vllm:inter_token_latency_seconds", "decode")
        # decode's mean batch: the tokens of its iterations / the iterations
        batch = _mean(delta, "vllm:iteration_tokens_total", "decode") or 1.0
        if itl_s:
            hbm.append((weights + max(1.0, batch) * step.input_tokens * kv_tok) / itl_s)
    fields: dict[str, Any] = {"prefill_fixed_s": 0.0}
    fits: list[dict[str, Any]] = []
    how_prefill = "2 x params x prompt / prefill's vllm:time_to_first_token_seconds mean"
    how_decode = (
        "(weights + mean batch x prompt KV) / decode's vllm:inter_token_latency_seconds mean"
    )
    for name, values, how in (
        ("prefill_flops", flops, how_prefill),
        ("decode_hbm_bytes_per_s", hbm, how_decode),
    ):
        if values:
            values.sort()
            fields[name] = values[len(values) // 2]
            fits.append({"param": name, "value": fields[name], "source": how + ", median over "
                         "steps", "points": len(values), "max_error_pct": None})  # fmt: skip
    return fields, fits


def pull_point(
    step: Any, report: Any, link: dict[str, Any], goodput_bps: float | None, model: dict[str, Any]
) -> tuple[float, float] | None:
    """(probed RTT p50 s, the pull's own time s) of a step that shipped KV over a measured
    link: its transfer p50 less the KV's bytes at the probed goodput and one decode step."""
    xfer = (report.summary.get("transfer_ms") or {}).get("p50")
    rtt_ms = link.get("rtt_p50_ms")
    itl_s = _mean(report.metrics_delta or {}, "vllm:inter_token_latency_seconds", "decode")
    if not xfer or not rtt_ms or not goodput_bps or itl_s is None:
        return None
    wire_s = step.input_tokens * model["kv_bytes_per_token"] * 8 / goodput_bps
    return float(rtt_ms) / 1e3, max(0.0, float(xfer) / 1e3 - wire_s - itl_s)


def pull_fit(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """``(link_round_trips, link_fixed_s)``: a least-squares line through (RTT, pull time) of
    steps at RTTs at least 1.5x apart, both kept >= 0; from one RTT only the round trips (no
    fixed part can be told apart from them). None without a point."""
    if not points:
        return None
    rtts = [r for r, _ in points]
    if max(rtts) < 1.5 * min(rtts):
        r = sum(rtts) / len(rtts)
        t = sum(v for _, v in points) / len(points)
        return (t / r if r > 0 else 0.0), 0.0
    n = len(points)
    mr, mt = sum(rtts) / n, sum(v for _, v in points) / n
    slope = sum((r - mr) * (v - mt) for r, v in points) / sum((r - mr) ** 2 for r in rtts)
    slope = max(0.0, slope)
    return slope, max(0.0, mt - slope * mr)
