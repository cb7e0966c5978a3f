"""The simulator as pdx accept uses it: first token from prefill, second token, fixed prefill
cost, a lognormal prefill spread, round trips per transfer and pipelined loss recovery."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdx.sim.config import SimConfig
from pdx.sim.engine import run_mode
from pdx.sim.link import LinkModel
from pdx.sim.metrics import summarize
from pdx.sim.workload import Workload

# An 8B-class model on round numbers: 2 x 8e9 FLOP per token at 1e14 FLOP/s = 0.16 ms/token;
# a decode step reads 16 GB at 1 TB/s = 16 ms (plus the KV it holds).
BASE = {
    "prefill_flops": 1e14,
    "decode_hbm_bytes_per_s": 1e12,
    "weight_bytes": 16e9,
    "model_params": 8e9,
    "kv_bytes_per_token": 131072,
    "decode_weight_reads": "per_step",
    "link_bytes_per_s": 1e8,  # 800 Mbit/s
    "link_rtt_s": 0.04,
    "modes": ["disaggregated"],
}


def cfg(**changes: object) -> SimConfig:
    return SimConfig.model_validate({**BASE, **changes})


ONE = Workload([0.0], [1024], [16], "one 1k prompt")


def test_first_token_from_prefill_arrives_before_the_kv() -> None:
    decode = run_mode(cfg(), ONE, "disaggregated")
    prefill = run_mode(cfg(first_token_from="prefill"), ONE, "disaggregated")
    pf_s = 1024 * 2 * 8e9 / 1e14
    # pdx's flow: half a round trip to the prefill site, the prefill, half a round trip back
    assert prefill.first_token_s[0] == pytest.approx(0.02 + pf_s + 0.02)
    assert prefill.prefill_start_s[0] == pytest.approx(0.02)
    # decode's flow: the first token waits for the KV and the first decode step
    assert decode.first_token_s[0] > decode.ready_s[0] - 1e-12
    assert prefill.first_token_s[0] < prefill.ready_s[0]
    # the second token is decode's first step after the KV is in
    step_s = (16e9 + (1024 + 16) * 131072) / 1e12
    assert prefill.second_token_s[0] == pytest.approx(prefill.ready_s[0] + step_s, rel=0.05)
    m = summarize(prefill, cfg(first_token_from="prefill"))
    # TPOT as vLLM and pdx accept compute it: (E2E - TTFT) / (n - 1), 15 decode steps in 15 gaps
    e2e = prefill.finish_s[0]
    assert m.tpot_p50_s == pytest.approx((e2e - prefill.first_token_s[0]) / 15)


def test_one_token_answers_need_no_kv_transfer_and_have_no_tpot() -> None:
    wl = Workload([0.0, 0.0], [1024, 1024], [1, 1], "two one-token answers")
    c = cfg(first_token_from="prefill")
    tr = run_mode(c, wl, "disaggregated")
    assert all(math.isnan(x) for x in tr.transfer_start_s)
    assert tr.finish_s == tr.first_token_s
    m = summarize(tr, c)
    assert math.isnan(m.tpot_p50_s) and m.goodput_fraction == 1.0


def test_fixed_prefill_cost_and_spread() -> None:
    fixed = run_mode(cfg(prefill_fixed_s=0.05), ONE, "disaggregated")
    plain = run_mode(cfg(), ONE, "disaggregated")
    assert fixed.prefill_end_s[0] - fixed.prefill_start_s[0] == pytest.approx(
        plain.prefill_end_s[0] - plain.prefill_start_s[0] + 0.05
    )
    n = 400
    wl = Workload([i * 10.0 for i in range(n)], [1024] * n, [2] * n, "spaced")
    spread = run_mode(cfg(prefill_time_sigma=0.5), wl, "disaggregated")
    dur = np.asarray(spread.prefill_end_s) - np.asarray(spread.prefill_start_s)
    median = 1024 * 2 * 8e9 / 1e14
    ratio = np.log(dur / median)
    # lognormal factor with median 1 and sigma 0.5: sample median and spread close to those
    assert abs(float(np.median(ratio))) < 0.1
    assert float(np.std(ratio)) == pytest.approx(0.5, rel=0.15)


def test_round_trips_per_transfer_add_rtt_to_the_link_time() -> None:
    one = run_mode(cfg(first_token_from="prefill"), ONE, "disaggregated")
    two = run_mode(cfg(first_token_from="prefill", link_round_trips=2), ONE, "disaggregated")
    wire_s = 1024 * 131072 / 1e8
    assert one.link_time_s[0] == pytest.approx(wire_s + 0.04)
    assert two.link_time_s[0] == pytest.approx(wire_s + 0.08)


def test_pipelined_loss_costs_at_most_one_round_trip_stall_costs_more() -> None:
    wire = 1024 * 131072
    stall = LinkModel(cfg(link_loss=0.01), seed=1)
    piped = LinkModel(cfg(link_loss=0.01, link_loss_recovery="pipelined"), seed=1)
    s = [stall.transfer(1024) for _ in range(200)]
    p = [piped.transfer(1024) for _ in range(200)]
    # pipelined: the goodput already holds the resends, so the link time is the bytes' alone,
    # and a loss among the last round trip's segments costs exactly one more round trip
    assert all(t.link_busy_s == pytest.approx(wire / 1e8) for t in p)
    assert {round(t.extra_latency_s, 9) for t in p} <= {0.04, 0.08}
    assert any(t.extra_latency_s == pytest.approx(0.08) for t in p)
    # stall: resends take link time and every lossy round trip stalls one more
    assert all(t.link_busy_s > wire / 1e8 for t in s)
    assert np.mean([t.extra_latency_s for t in s]) > np.mean([t.extra_latency_s for t in p])


def test_published_compat_refuses_first_token_from_prefill() -> None:
    from pdx.sim.config import PUBLISHED_ILLUSTRATION

    with pytest.raises(ValueError, match="first token from decode"):
        SimConfig.model_validate(
            {**PUBLISHED_ILLUSTRATION, "compat": "published", "first_token_from": "prefill"}
        )


def test_layerwise_overlap_starts_the_transfer_after_the_first_layer() -> None:
    off = run_mode(cfg(), ONE, "disaggregated")
    on = run_mode(cfg(kv_overlap="layerwise", model_layers=32), ONE, "disaggregated")
    pf_s = 1024 * 2 * 8e9 / 1e14
    wire_s = 1024 * 131072 / 1e8
    assert off.transfer_start_s[0] == pytest.approx(off.prefill_end_s[0])
    assert on.transfer_start_s[0] == pytest.approx(pf_s / 32)
    # the link is the bottleneck here (1.34 s of bytes against 0.16 s of prefill): the last
    # byte leaves one full wire time after the first layer, not after the whole prefill
    assert on.ready_s[0] == pytest.approx(pf_s / 32 + wire_s + 0.04)
    assert off.ready_s[0] - on.ready_s[0] == pytest.approx(pf_s - pf_s / 32)
    # a fast link: the last layer's own bytes follow the end of prefill
    fast = cfg(kv_overlap="layerwise", model_layers=32, link_bytes_per_s=1e11)
    tr = run_mode(fast, ONE, "disaggregated")
    assert tr.ready_s[0] == pytest.approx(pf_s + 1024 * 131072 / 1e11 / 32 + 0.04)
    with pytest.raises(ValueError, match="kv_overlap off"):
        from pdx.sim.config import PUBLISHED_ILLUSTRATION

        SimConfig.model_validate(
            {**PUBLISHED_ILLUSTRATION, "compat": "published", "kv_overlap": "layerwise"}
        )


def test_fair_link_shares_its_rate_between_transfers_in_flight() -> None:
    # two prompts at once on two prefill instances: both transfers start together
    wl = Workload([0.0, 0.0], [1024, 1024], [2, 2], "pair")
    wire_s = 1024 * 131072 / 1e8
    fifo = run_mode(cfg(prefill_instances=2), wl, "disaggregated")
    fair = run_mode(cfg(prefill_instances=2, link_sharing="fair"), wl, "disaggregated")
    assert sorted(fifo.link_time_s) == pytest.approx([wire_s + 0.04, 2 * wire_s + 0.04])
    assert fair.link_time_s == pytest.approx([2 * wire_s + 0.04] * 2)
    assert fair.link_busy_s == pytest.approx(fifo.link_busy_s)
    # one joins halfway through the other's: the first gets half the rate from then on
    late = Workload([0.0, wire_s / 2], [1024, 1024], [2, 2], "late")
    tr = run_mode(cfg(prefill_instances=2, link_sharing="fair"), late, "disaggregated")
    first, second = tr.link_time_s
    assert first == pytest.approx(1.5 * wire_s + 0.04)
    assert second == pytest.approx(1.5 * wire_s + 0.04)
    assert tr.ready_s[1] - tr.ready_s[0] == pytest.approx(wire_s / 2)
