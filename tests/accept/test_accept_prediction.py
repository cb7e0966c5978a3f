"""The simulator beside each step: judging a measured figure against its prediction, the
playbook options that feed it, the settings it recommends, calibration and report diff."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from pdx.accept.judge.criteria import CriterionResult
from pdx.accept.playbook import load_playbook
from pdx.accept.predict import advice
from pdx.accept.predict.prediction import compare, judge, sim_fields, simulate_step, step_workload
from pdx.accept.report import (
    SCHEMA_VERSION,
    Recommendation,
    Report,
    StepReport,
    diff_predictions,
    diff_recommendations,
    load_report,
    no_recommendations,
    smallest_margin,
)
from pdx.accept.steps import expand_steps
from pdx.cli.main import app
from pdx.errors import ConfigError, InputError
from pdx.sim.calibrate import calibrate, compute_fits, model_fields

PLAYBOOKS = Path(__file__).resolve().parents[2] / "playbooks"
KV = {"kv_bytes_per_token": 131072, "params_active": 8.0e9, "params_total": 8.0e9,
      "dtype": "bf16", "model": "llama-3.1-8b"}  # fmt: skip


def test_a_figure_is_within_beyond_or_undecided_by_its_whole_interval() -> None:
    rng = np.random.default_rng(3)
    near = (100 + rng.normal(0, 2, 200)).tolist()
    far = (200 + rng.normal(0, 2, 200)).tolist()
    assert judge(100.0, near, 0.5, 0.95, 25)["result"] == "within"
    e = judge(100.0, far, 0.5, 0.95, 25)
    assert e["result"] == "beyond" and e["error_pct"] == pytest.approx(100, abs=2)
    assert e["interval"][0] > 125
    # five values spread 60..140: the median's interval reaches both sides of ±25 %
    assert judge(100.0, [60, 80, 100, 120, 140], 0.5, 0.95, 25)["result"] == "undecided"
    # no prediction: measured, not compared
    assert judge(None, near, 0.5, 0.95, 25)["result"] == "not_compared"


def test_one_figure_beyond_makes_the_step_unexplained() -> None:
    rows = [{"ok": True, "ttft_ms": 100.0 + i % 5, "tpot_ms": 20.0, "itl_ms": [30.0, 20.0],
             "pdx": {"transfer_ms": 500.0 + i % 7}} for i in range(60)]  # fmt: skip
    predicted = {"ttft_p50_ms": 102.0, "ttft_p99_ms": 104.0, "second_token_p50_ms": 132.0,
                 "tpot_p50_ms": 20.0, "transfer_p50_ms": 200.0}  # fmt: skip
    figures, unexplained = compare(predicted, rows, 0.95, 25)
    assert unexplained and figures["transfer_p50_ms"]["result"] == "beyond"
    assert figures["ttft_p50_ms"]["result"] == "within"
    assert figures["second_token_p50_ms"]["measured"] == pytest.approx(132, abs=3)
    predicted["transfer_p50_ms"] = 503.0
    assert not compare(predicted, rows, 0.95, 25)[1]


def _fields(rtt_ms: float, gbps: float, loss_pct: float = 0.0) -> dict[str, Any]:
    model = model_fields({"preflight": {"measure_kv": {"result": KV}}})
    compute = {"prefill_flops": 1e14, "decode_hbm_bytes_per_s": 1e12}
    link = {
        "rtt_p50_ms": rtt_ms,
        "loss_down_pct": loss_pct,
        "down_runs": [{"streams": 1, "gbps": gbps / 2}, {"streams": 4, "gbps": gbps}],
    }
    facts = advice.DeployFacts(1, 1, 8, 512, 4, 1024, "raw", "cubic")  # fmt: skip
    fields = sim_fields(compute, model, link, facts)
    assert fields is not None
    return fields


def _records(n: int, prompt: int, gap_s: float) -> list[dict[str, Any]]:
    return [{"t_intended_s": i * gap_s, "input_len": prompt, "output_tokens": 16}
            for i in range(n)]  # fmt: skip


def test_the_step_prediction_follows_the_measured_link() -> None:
    wl = step_workload(_records(10, 1024, 20.0))  # no transfer waits for another
    fast = simulate_step(_fields(10, 1.0), wl)
    slow = simulate_step(_fields(80, 0.2), wl)
    kv_bits = 1024 * 131072 * 8
    # 4 stripes (Stat + Get): two round trips, then the bytes at the 4-stream goodput
    assert fast["transfer_p50_ms"] == pytest.approx(2 * 10 + kv_bits / 1e9 * 1e3, rel=0.01)
    assert slow["transfer_p50_ms"] == pytest.approx(2 * 80 + kv_bits / 0.2e9 * 1e3, rel=0.01)
    # the first token comes from prefill: the link's rate does not move it, its RTT does
    assert slow["ttft_p50_ms"] - fast["ttft_p50_ms"] == pytest.approx(70, rel=0.01)
    assert slow["second_token_p50_ms"] > slow["transfer_p50_ms"]


def test_netns_playbook_options_validate() -> None:
    pb = load_playbook(PLAYBOOKS / "cross-dc-lite.yaml")
    steps = expand_steps(pb)
    assert 5 <= len(steps) <= 9 and pb.prediction.enabled
    assert {s.network for s in steps} == set(pb.matrix.network)
    with pytest.raises(ConfigError, match="exclude"):
        load_playbook(PLAYBOOKS / "cross-dc-lite.yaml", dotted=["matrix.exclude=[{colour: 1}]"])
    with pytest.raises(ConfigError, match="at_s must be"):
        load_playbook(
            PLAYBOOKS / "cross-dc-lite.yaml",
            dotted=["conditions.wan40.wan_events=[{at_s: 99, set: {loss: 0.01}}]"],
        )
    with pytest.raises(ConfigError, match=r"needs preflight\.probe_link"):
        load_playbook(PLAYBOOKS / "cross-dc-lite.yaml", dotted=["preflight.probe_link=false"])


def test_congestion_control_from_mathis_bound() -> None:
    # 0.1 % loss at 40 ms: one CUBIC stream reaches 1448 x 8 / 0.04 x 1.22 / 0.0316 = 11 Mbit/s
    assert advice.mathis_bps(0.04, 0.001) == pytest.approx(11.18e6, rel=0.01)
    assert advice.mathis_bps(0.01, 0.001) == pytest.approx(4 * advice.mathis_bps(0.04, 0.001))


def _step(sid: str, figures: dict[str, Any] | None, unexplained: bool | None) -> StepReport:
    return StepReport(id=sid, index=0, input_tokens=1024, output_tokens=16, concurrency=1,
                      rate_rps=None, network="wan10", condition={}, duration_s=40,
                      elapsed_s=40, summary={}, valid=True, validity_problems=[],
                      metrics_delta={}, prediction=figures,
                      unexplained=unexplained)  # fmt: skip


def _report(threshold: int, err: float, unexplained: bool) -> Report:
    fig = {"ttft_p50_ms": {"predicted": 100.0, "measured": 100 + err, "error_pct": err,
                           "result": "beyond" if unexplained else "within"}}  # fmt: skip
    recs = no_recommendations("not computed")
    recs["local_prefill_max_tokens"] = Recommendation(value=threshold, why="because")
    return Report(name="r", verdict="GO", valid=True, complete=True, exit_code=0,
                  started_at="", finished_at="", target={}, criteria=[], validity=[],
                  recommendations=recs, steps=[_step("s00-x", fig, unexplained)], formulas={},
                  playbook={}, environment={})  # fmt: skip


def test_report_diff_shows_prediction_error_and_recommendation_changes() -> None:
    a, b = _report(512, 40.0, True), _report(2049, 5.0, False)
    rows = diff_predictions(a, b)
    ttft = next(r for r in rows if r["metric"] == "ttft_p50_ms")
    assert ttft["a_error_pct"] == 40 and ttft["b_error_pct"] == 5
    assert (ttft["a_result"], ttft["b_result"]) == ("beyond", "within")
    flag = next(r for r in rows if r["metric"] == "unexplained")
    assert (flag["a_result"], flag["b_result"]) == (True, False)
    recs = {r["name"]: r for r in diff_recommendations(a, b)}
    assert set(recs) == set(advice.NAMES)
    assert recs["local_prefill_max_tokens"]["changed"]
    assert (recs["local_prefill_max_tokens"]["a_value"], recs["codec"]["changed"]) == (512, False)
    assert smallest_margin(a) is None  # no criteria
    b.criteria = [_criterion("ttft_p50_ms", 3000, 8000), _criterion("tpot_p50_ms", 450, 600)]
    small = smallest_margin(b)
    assert small is not None and small["criterion"] == "tpot_p50_ms"
    assert small["margin_pct"] == pytest.approx(25.0)


def _criterion(name: str, measured: float, threshold: float) -> CriterionResult:
    return CriterionResult(name=name, step="s00-x", measured=measured, threshold=threshold,
                           margin=threshold - measured, passed=True, unit="ms",
                           result="pass")  # fmt: skip


def test_a_schema_1_report_loads_with_its_list_as_what_to_change(tmp_path: Path) -> None:
    data = json.loads(_report(512, 0, False).model_dump_json())
    data.update(schema_version=1, recommendations=["lower the load"])
    data.pop("what_to_change")
    (tmp_path / "report.json").write_text(json.dumps(data))
    r = load_report(tmp_path)
    assert r.what_to_change == ["lower the load"] and r.schema_version == SCHEMA_VERSION
    assert r.recommendations["codec"].value is None


def _measured_report(tmp_path: Path) -> Path:
    """A report as a run on an 8B-class roofline would write it: the servers' timings are the
    roofline's (prefill 0.16 ms/token + 12 ms fixed, decode step (weights + KV) / 1 TB/s)."""
    steps = []
    for i, n in enumerate((1024, 2048, 4096)):
        prefill_ms = n * 0.16 + 12.0
        step_ms = (16e9 + n * 131072) / 1e12 * 1e3
        t = {"prefill": {"p50": prefill_ms, "p90": prefill_ms * 1.1, "count": 10},
             "first_decode_step": {"p50": step_ms, "count": 10},
             "kv_store": {"p50": n * 131072 / 2e9 * 1e3, "count": 10}}  # fmt: skip
        xfer_ms = 2 * 40 + n * 131072 * 8 / 0.8e9 * 1e3
        steps.append({"id": f"s0{i}-in{n}", "input_tokens": n, "output_tokens": 16,
                      "concurrency": 1,
                      "summary": {"requests": 10, "achieved_rps": 0.25, "timings_ms": t,
                                  "transfer_ms": {"p50": xfer_ms}},
                      "preflight": {"probe_link": {"summary": {"rtt_p50_ms": 40.0,
                                                               "loss_down_pct": 0.0}}},
                      "prediction_model": {"fields": {"link_round_trips": 2.0}}})  # fmt: skip
    # two users: each server figure holds a wait behind the other's work, left out of the fit
    crowded = json.loads(json.dumps(steps[0]))
    t = crowded["summary"]["timings_ms"]
    t["prefill"]["p50"] *= 2
    t["first_decode_step"]["p50"] *= 10
    steps.append({**crowded, "id": "s03-in1024-c2", "concurrency": 2})
    report = {"name": "measured", "steps": steps, "preflight": {"measure_kv": {"result": KV}}}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    return path


def test_calibration_recovers_the_roofline_the_timings_came_from(tmp_path: Path) -> None:
    data = json.loads(_measured_report(tmp_path).read_text())
    cal = calibrate(data, "s01")
    f = cal.fields
    assert f["prefill_flops"] == pytest.approx(2 * 8e9 / 0.16e-3, rel=1e-6)
    assert f["prefill_fixed_s"] == pytest.approx(0.012, rel=1e-6)
    assert f["decode_hbm_bytes_per_s"] == pytest.approx(1e12, rel=1e-6)
    assert f["codec_encode_bytes_per_s"] == pytest.approx(2e9, rel=1e-6)
    assert f["prefill_time_sigma"] == pytest.approx(math.log(1.1) / 1.2816, rel=1e-6)
    assert f["link_rtt_s"] == 0.04 and f["link_round_trips"] == 2.0
    assert f["link_bytes_per_s"] == pytest.approx(0.1e9, rel=1e-6)  # 800 Mbit/s
    assert cal.link_step == "s01-in2048"
    with pytest.raises(InputError, match="one of"):
        calibrate(data, "s09")
    fits = compute_fits(data["steps"], model_fields(data))[1]
    assert next(x for x in fits if x.param == "prefill_flops").max_error_pct == pytest.approx(0)


def test_simulate_calibrate_cli(tmp_path: Path) -> None:
    path = _measured_report(tmp_path)
    runner = CliRunner()
    result = runner.invoke(app, ["simulate", "--calibrate", str(path), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["config"]["prefill_flops"] == pytest.approx(1e14, rel=1e-6)
    assert {f["param"] for f in out["calibration"]["fits"]} >= {"prefill_flops", "link_rtt_s"}
    assert out["disaggregated"]["ttft_p50_s"] > 0
    table = runner.invoke(app, ["simulate", "--calibrate", str(tmp_path)])
    assert table.exit_code == 0 and "calibrated to measured" in table.output
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    refused = runner.invoke(app, ["simulate", "--calibrate", str(bad)])
    assert refused.exit_code == 2 and "no steps" in refused.output
    alone = runner.invoke(app, ["simulate", "--calibrate-step", "s00"])
    assert alone.exit_code == 2 and "--calibrate REPORT" in alone.output
