"""A search on an ``engine: vllm`` playbook gets the simulator's limit too: calibrated on its
first probe's ``vllm:`` series and NIXL pull, as a run's forecast is (no vLLM needed here:
the first probe's report is what the search hands the model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdx.accept.playbook import load_playbook
from pdx.accept.report import StepReport
from pdx.accept.search.limit import Axis
from pdx.accept.search.predict import PULL_ROUND_TRIPS, LimitModel, predict
from pdx.accept.steps import expand_steps

PLAYBOOKS = Path(__file__).resolve().parents[2] / "playbooks"
# the embedded tiny model as vLLM serves it (pre-flight measure-kv of an engine: vllm run)
KV = {"kv_bytes_per_token": 4096, "params_active": 4.2e6, "params_total": 4.2e6,
      "dtype": "bf16", "model": "tiny-llama-mha"}  # fmt: skip
PREFILL_S, ITL_S, TRANSFER_MS, BASE_RTT_MS, GBPS = 0.012, 0.004, 90.0, 0.05, 1.0


def _series(name: str, instance: str, total: float, count: float) -> dict[str, float]:
    labels = f'{{model_name="tiny",pdx_instance="{instance}"}}'
    return {f"{name}_sum{labels}": total, f"{name}_count{labels}": count}


def _first_probe(tokens: int, requests: int = 40) -> tuple[StepReport, list[dict[str, Any]]]:
    """What the first probe's step report and records hold for the model: vLLM's own
    timings over the step, the transfer p50, each request's send time and lengths."""
    delta = {
        **_series("vllm:time_to_first_token_seconds", "prefill-0", PREFILL_S * requests,
                  requests),
        **_series("vllm:inter_token_latency_seconds", "decode-0", ITL_S * 7 * requests,
                  7 * requests),
        # unrelated instances' series are not mixed in
        **_series("vllm:time_to_first_token_seconds", "decode-0", 5.0 * requests, requests),
    }  # fmt: skip
    summary = {"transfer_ms": {"p50": TRANSFER_MS}, "ttft_ms": {"p50": 150.0}}
    report = StepReport.model_construct(summary=summary, metrics_delta=delta)
    records = [{"t_intended_s": 0.5 * i, "input_len": tokens, "output_tokens": 8}
               for i in range(requests)]  # fmt: skip
    return report, records


def _preflight() -> dict[str, Any]:
    down = [{"direction": "down", "streams": 1, "gbps": GBPS}]
    link = {"rtt_ms": {"p50": BASE_RTT_MS}, "loss": {"down": 0.0},
            "throughput": {"down_gbps": GBPS, "runs": down}}  # fmt: skip
    return {"measure_kv": {"result": KV}, "probe_link": {"report": link}}


def _model(axis: Axis) -> LimitModel:
    pb = load_playbook(PLAYBOOKS / "vllm-cross-dc.yaml")
    step = expand_steps(pb)[0]
    report, records = _first_probe(step.input_tokens)
    return LimitModel(pb, PLAYBOOKS, axis, step, report, records, _preflight())


def test_the_compute_and_the_pull_come_from_the_first_probes_vllm_series() -> None:
    axis = Axis("rtt_ms", 10.0, 400.0)
    m = _model(axis)
    assert m.why_not() is None
    assert m.fields is not None
    tokens = m.step.input_tokens
    assert m.fields["prefill_flops"] == pytest.approx(2 * KV["params_active"] * tokens / PREFILL_S)
    assert m.fields["first_token_from"] == "decode" and m.fields["prefill_over_link"]
    # the pull the first probe measured (transfer p50 − wire time − one decode step), at the
    # RTT it ran on (the pre-flight link's plus the axis's good end): one round trip of it,
    # the rest fixed
    rtt_s = (BASE_RTT_MS + axis.best) / 1e3
    wire_s = tokens * KV["kv_bytes_per_token"] * 8 / (GBPS * 1e9)
    pull_s = TRANSFER_MS / 1e3 - wire_s - ITL_S
    assert m.fields["link_round_trips"] == PULL_ROUND_TRIPS
    assert m.fields["link_fixed_s"] == pytest.approx(pull_s - PULL_ROUND_TRIPS * rtt_s)


def test_the_predicted_transfer_meets_the_first_probe_and_grows_a_round_trip_per_rtt() -> None:
    axis = Axis("rtt_ms", 10.0, 400.0)
    m = _model(axis)
    at_first, farther = m.figures(axis.best), m.figures(axis.best + 100.0)
    assert at_first["transfer_p50_ms"] == pytest.approx(TRANSFER_MS, rel=0.05)
    grow = farther["transfer_p50_ms"] - at_first["transfer_p50_ms"]
    assert grow == pytest.approx(100.0 * PULL_ROUND_TRIPS, rel=0.05)
    # the first token waits for the prompt's trip to prefill and back and for the pull
    ttft_grow = farther["ttft_p50_ms"] - at_first["ttft_p50_ms"]
    assert ttft_grow == pytest.approx(100.0 * (1 + PULL_ROUND_TRIPS), rel=0.1)
    r = predict(m)
    limit = r["predicted_limit"] or r["extrapolated_limit"]
    assert limit is not None and r["curve"], r
    # the report says how the pull was taken
    assert r["pull"]["round_trips"] == PULL_ROUND_TRIPS
    assert r["pull"]["at_rtt_ms"] == pytest.approx(BASE_RTT_MS + axis.best)
    assert r["pull"]["fixed_ms"] == pytest.approx(m.fields["link_fixed_s"] * 1e3, abs=1e-3)
    # the limit is where the binding criterion's threshold is reached
    ratio, binding, _ = m.ratio(limit)
    assert ratio == pytest.approx(1.0, abs=0.05), (binding, ratio)


def test_a_first_probe_without_vllm_series_says_why_there_is_no_prediction() -> None:
    pb = load_playbook(PLAYBOOKS / "vllm-cross-dc.yaml")
    step = expand_steps(pb)[0]
    _report, records = _first_probe(step.input_tokens)
    bare = StepReport.model_construct(summary={"transfer_ms": {"p50": TRANSFER_MS}},
                                      metrics_delta={})  # fmt: skip
    m = LimitModel(pb, PLAYBOOKS, Axis("rate", 1.0, 8.0), step, bare, records, _preflight())
    why = m.why_not()
    assert why is not None and "vllm: series" in why and "prefill_flops" in why
    assert predict(m)["predicted_limit"] is None
