"""Statistics, metrics parsing and judging: the pure parts of an acceptance run."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from pdx.accept.judge.criteria import check_validity, judge_step
from pdx.accept.judge.stats import derive_rates, distribution, recovery_s, summarize
from pdx.accept.load.metrics import Snapshot, delta, parse_metrics, sample_key, split_key
from pdx.accept.playbook import Criteria, Validity
from pdx.accept.predict.remedies import kv_demand, load_caps
from pdx.accept.steps import Step

names = st.from_regex(r"pdx_[a-z_]{1,12}", fullmatch=True)
labels = st.dictionaries(
    st.from_regex(r"[a-z]{1,6}", fullmatch=True),
    st.from_regex(r"[A-Za-z0-9_:.]{0,8}", fullmatch=True),
)


@given(name=names, lab=labels)
def test_sample_keys_round_trip(name: str, lab: dict[str, str]) -> None:
    assert split_key(sample_key(name, lab)) == (name, lab)


@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=200))
def test_distribution_is_ordered(values: list[float]) -> None:
    d = distribution(values)
    assert d["count"] == len(values)
    assert min(values) <= d["p50"] <= d["p90"] <= d["p99"] <= d["max"] == max(values)


def test_metrics_delta_from_real_exposition() -> None:
    reg = CollectorRegistry()
    c = Counter("pdx_gateway_degradations", "d", ["reason"], registry=reg)
    h = Histogram("pdx_gateway_ttft_seconds", "t", registry=reg)
    Counter("other_total_thing", "not ours", registry=reg).inc()
    c.labels("circuit_open").inc(2)
    before = Snapshot(0.0, parse_metrics(generate_latest(reg).decode()))
    c.labels("circuit_open").inc(3)
    c.labels("RETRY_BUDGET_EXHAUSTED").inc()
    h.observe(0.2)
    after = Snapshot(1.0, parse_metrics(generate_latest(reg).decode()))
    d = delta(before, after)
    assert d['pdx_gateway_degradations_total{reason="circuit_open"}'] == 3
    assert d['pdx_gateway_degradations_total{reason="RETRY_BUDGET_EXHAUSTED"}'] == 1
    assert d["pdx_gateway_ttft_seconds_count"] == 1
    assert not any(k.startswith("other") or k.endswith("_created") for k in after.samples)
    assert after.total("pdx_gateway_degradations_total") == 6


def test_engine_series_merged_by_the_gateway_are_kept_per_instance() -> None:
    from pdx.serving.engines.metrics import merge

    def engine(transferred: float) -> str:
        reg = CollectorRegistry()
        h = Histogram("vllm:nixl_bytes_transferred", "bytes", registry=reg)
        h.observe(transferred)
        return generate_latest(reg).decode()

    before = parse_metrics(merge([("decode-0", engine(100.0))]).decode())
    after = parse_metrics(merge([("decode-0", engine(4196.0))]).decode())
    d = delta(Snapshot(0.0, before), Snapshot(1.0, after))
    assert d['vllm:nixl_bytes_transferred_sum{pdx_instance="decode-0"}'] == 4096.0


def _rows(ttfts: list[float], *, failed: int = 0, pdx: dict | None = None) -> list[dict]:
    rows = [
        {"t_intended_s": 100.0 + i, "ok": True, "ttft_ms": t, "tpot_ms": 2.0, "itl_ms": [2.0],
         "e2e_ms": t + 10, "output_tokens": 5, "queue_ms": 0.0, "pdx": pdx}
        for i, t in enumerate(ttfts)
    ]  # fmt: skip
    rows += [{"t_intended_s": 200.0, "ok": False, "error": "HTTP 500: x", "queue_ms": 0.0}] * failed
    return rows


def test_judging_margins_and_absent_data() -> None:
    step = Step(0, 8, 4, 2, None, "normal", 10.0)
    xfer = {"route": "disaggregated", "transfer_outcome": "ok", "retries": 1, "transfer_ms": 3.0,
            "kv_id": "k"}  # fmt: skip
    summary = summarize(_rows([10.0] * 98 + [500.0] * 2, failed=1, pdx=xfer), elapsed_s=10.0)
    derive_rates(summary, {"pdx_kv_evicted_total": 2.0})
    assert summary["retry_rate"] == 1.0 and summary["transfer_success"] == 1.0
    assert summary["eviction_rate"] == pytest.approx(2 / 100)
    crit = Criteria(ttft_p99_ms=100, transfer_success_min=0.999, error_rate_max=0.0)
    got = {c.name: c for c in judge_step(step, summary, crit)}
    assert got["ttft_p99_ms"].margin == pytest.approx(100 - got["ttft_p99_ms"].measured)
    assert not got["ttft_p99_ms"].passed
    assert got["transfer_success_min"].margin == pytest.approx(1.0 - 0.999)
    assert not got["retry_rate_max"].passed and not got["error_rate_max"].passed
    # No transfers at all (every prompt prefilled locally): the transfer, retry and stranded-KV
    # criteria have no sample: not_measured (never a pass), and the note says what would
    # measure them; latency criteria with no data are not measured either.
    local = summarize(_rows([10.0] * 5, pdx={"route": "local"}), elapsed_s=5.0)
    derive_rates(local, {})
    res = {c.name: c for c in judge_step(step, local, crit)}
    for name in ("transfer_success_min", "retry_rate_max", "kv_stranded_max_s"):
        assert res[name].result == "not_measured" and not res[name].passed, name
    assert "no KV transfer" in res["transfer_success_min"].note
    assert "local_prefill_max_tokens" in res["transfer_success_min"].note
    empty = summarize([], elapsed_s=0.0)
    derive_rates(empty, {})
    got_empty = {c.name: c for c in judge_step(step, empty, crit)}["ttft_p99_ms"]
    assert got_empty.result == "not_measured" and not got_empty.passed


def test_validity_rules() -> None:
    step = Step(0, 8, 4, 4, None, "normal", 10.0)
    summary = {"requests": 50, "achieved_concurrency": 1.0}
    v = check_validity(step, summary, 10.0, Validity(min_requests=20, min_load_fraction=0.9))
    assert not v.valid and "25% of target 4" in v.problems[0]
    open_step = Step(1, 8, 4, None, 10.0, "normal", 10.0)
    ok = check_validity(open_step, {"requests": 95, "achieved_rps": 9.5}, 10.0, Validity())
    assert ok.valid and ok.load_fraction == pytest.approx(0.95)


def test_recovery_after_link_restore() -> None:
    def b(t: float, p50: float | None, failed: int = 0, degraded: int = 0) -> dict:
        return {"t_s": t, "ttft_p50_ms": p50, "failed": failed, "degraded": degraded}

    bins = [b(0, 10), b(1, 12), b(2, 11), b(3, 300, degraded=2), b(4, 200, degraded=1),
            b(5, 40), b(6, 14), b(7, 11)]  # fmt: skip
    assert recovery_s(bins, down_at_s=3, down_for_s=1) == 2.0  # t=6: clean and ≤ 1.5 × 11
    assert recovery_s(bins[3:], down_at_s=3, down_for_s=1) is None  # no pre-fault baseline


def test_load_caps_and_kv_demand_in_recommendations() -> None:
    steps = [Step(i, 1024, 64, c, None, "normal", 60.0) for i, c in enumerate((1, 8, 32))]
    summaries = [{"ttft_ms": {"p99": v}} for v in (100.0, 400.0, 3000.0)]
    crit = Criteria(ttft_p99_ms=500)
    failed = [c for s, sm in zip(steps, summaries, strict=True)
              for c in judge_step(s, sm, crit) if not c.passed]  # fmt: skip
    (cap,) = load_caps(failed, list(zip(steps, summaries, strict=True)))
    assert cap.startswith("cap load at 8 users for in=1024/out=64 tokens on normal")
    # 10 GB of KV in 10 s = 8 Gbit/s = 80 % of a 10 Gbit/s link: needs a codec >= 1.1x.
    (line,) = kv_demand([(steps[0], {"kv_bytes": 10e9, "elapsed_s": 10.0})], link_gbps=10)
    assert "8 Gbit/s = 80.0% of 10 Gbit/s" in line and "ratio >= 1.1x" in line


def _trace_row(line: int, input_len: int, ideal: int, kv_bytes: int) -> dict:
    return {"trace_line": line, "session": line % 2, "input_len": input_len,
            "ideal_cached_tokens": ideal, "queue_ms": 1.0,
            "pdx": {"route": "disaggregated", "kv_bytes": kv_bytes}}  # fmt: skip


def test_trace_summary_counts_what_crossed_not_what_was_offered() -> None:
    from pdx.accept.judge.stats import NIXL_BYTES, trace_summary

    rows = [_trace_row(1, 100, 0, 4000), _trace_row(2, 100, 50, 4000)]
    pdx_pair = trace_summary(rows, {})
    assert pdx_pair is not None
    assert pdx_pair["ideal_hit_ratio"] == 0.25
    assert pdx_pair["kv_bytes_total"] == 8000
    assert pdx_pair["kv_bytes_from"] == "the responses' pdx.kv_bytes"
    # vLLM: decode's NIXL pulls moved only the blocks it lacked; that figure wins over the
    # whole-prompt kv_bytes each response names
    mdelta = {
        sample_key(NIXL_BYTES, {"pdx_instance": "decode-0"}): 6000.0,
        sample_key("vllm:prefix_cache_hits_total", {"pdx_instance": "decode-0"}): 50.0,
        sample_key("vllm:prefix_cache_queries_total", {"pdx_instance": "decode-0"}): 200.0,
    }
    vllm_pair = trace_summary(rows, mdelta)
    assert vllm_pair is not None
    assert vllm_pair["kv_bytes_total"] == 6000
    assert vllm_pair["kv_bytes_per_request"] == 3000
    assert vllm_pair["kv_bytes_from"] == NIXL_BYTES
    assert vllm_pair["engine_hit_ratio"] == {"decode-0": 0.25}
    assert trace_summary([{"input_len": 5}], {}) is None


def test_trace_summary_names_the_policy_and_the_share_offloaded() -> None:
    from pdx.accept.judge.stats import trace_summary

    rows = [_trace_row(i, 100, 0, 4000) for i in range(3)]
    for r in rows:
        r["pdx"]["offload"] = {"policy": "uncached"}
    rows[0]["pdx"]["route"] = "local"
    got = trace_summary(rows, {})
    assert got is not None
    assert got["policy"] == "uncached" and got["offloaded_share"] == 2 / 3
    assert trace_summary([_trace_row(1, 100, 0, 4000)], {})["policy"] is None  # type: ignore[index]


def test_kv_rate_per_transfer_and_cross_traffic_beside_it_in_the_report() -> None:
    from pdx.accept.report.content import fault_lines
    from pdx.accept.report.schema import Report, StepReport

    rows = [
        {**row, "pdx": {"kv_bytes": 125_000_000, "transfer_ms": ms}}
        for row, ms in zip(_rows([10.0] * 3), (1000.0, 2000.0, 4000.0), strict=True)
    ]
    summary = summarize(rows, elapsed_s=10.0)
    assert summary["kv_transfer_gbps_p50"] == 0.5  # 1 Gbit in 2 s, the median transfer
    kernel = {"emulator": "userspace", "summary": "down rate 1000 Mbit/s",
              "cross_traffic_achieved": {"down": {"flows": 2, "cc": "cubic",
                                                  "median_mbit": 487.1}}}  # fmt: skip
    step = StepReport(id="s0", index=0, network="shared", condition={}, input_tokens=1,
                      output_tokens=1, concurrency=1, rate_rps=None, duration_s=10,
                      elapsed_s=10, valid=True, validity_problems=[], summary=summary,
                      metrics_delta={}, kernel=kernel)  # fmt: skip
    report = Report.model_construct(steps=[step])
    text = "\n".join(fault_lines(report))
    assert ("cross-traffic down: 2 cubic flow(s), median 487 Mbit/s over the step; KV beside "
            "them: 500 Mbit/s per transfer") in text  # fmt: skip
    assert "KV" + " paced" not in text  # a step that does not say what paced it: nothing said
    for cap, said in ((0.5, "KV paced to 500 Mbit/s"), (None, "KV unpaced")):
        paced = step.model_copy(update={"kernel": {**kernel, "kv_link_cap_gbps": cap}})
        text = "\n".join(fault_lines(Report.model_construct(steps=[paced])))
        assert f"{said} (kv.max_link_gbps / max_link_share); per transfer it moved 500" in text


def test_offload_windows_show_a_policy_turning_during_the_step() -> None:
    from pdx.accept.judge.stats import offload_windows

    rows = [_trace_row(i, 100, 0, 4000) for i in range(8)]
    for i, r in enumerate(rows):
        r["t_intended_s"] = 1000.0 + 1.5 * i  # 0, 1.5, ... 10.5 s
        if i >= 4:
            r["pdx"]["route"] = "local"
    got = offload_windows(rows)
    assert [w["start_s"] for w in got] == [0.0, 5.0, 10.0]
    assert [w["requests"] for w in got] == [4, 3, 1]
    assert [w["offloaded_share"] for w in got] == [1.0, 0.0, 0.0]
    assert offload_windows([{"input_len": 3}]) == []
