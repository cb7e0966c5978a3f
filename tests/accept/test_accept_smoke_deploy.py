"""The smoke playbook end to end: real ``pdx deploy``, real Locust, one KV link break."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from typer.testing import CliRunner

from pdx.accept.report import SCHEMA_PATH, Report
from pdx.cli.main import app

SMOKE = Path(__file__).resolve().parents[2] / "playbooks" / "smoke.yaml"

pytestmark = [pytest.mark.slow, pytest.mark.alone]


def _report(out: Path) -> dict:
    (path,) = list(out.glob("*/report.json"))
    data = json.loads(path.read_text())
    Report.model_validate(data)
    jsonschema.validate(data, json.loads(SCHEMA_PATH.read_text()))
    return data


def test_smoke_go_with_fault_step(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["accept", str(SMOKE), "--out", str(tmp_path), "--no-progress"]
    )
    data = _report(tmp_path)
    assert result.exit_code == 0, (result.output, data["what_to_change"])
    assert data["verdict"] == "GO" and data["valid"] and data["complete"]
    # A defensible GO: every criterion decided at 95 % with its interval clearing the threshold.
    assert data["confidence"] == 0.95
    for c in data["criteria"]:
        assert c["result"] == "pass" and c["requests_needed"] is None, c
        if c["name"] == "link_verdict":  # the probe's own rules, each bounded in its report
            assert c["sample"] > 0 and c["method"].startswith("pdx probe-link rules"), c
            continue
        assert c["interval"] is not None and c["sample"] > 0
        low, high = c["interval"]
        if c["method"].startswith(("order", "Clopper", "Garwood")):  # the whole interval clears
            clears = low >= c["threshold"] if c["name"].endswith("_min") else high <= c["threshold"]
            assert high is not None and clears, c
    names = {c["name"] for c in data["criteria"]}
    assert {"silent_fallback_max", "output_mismatch_max", "kv_stranded_max_s",
            "overdue_requests_max"} <= names  # fmt: skip
    normal, fault = data["steps"]
    assert normal["summary"]["routes"].get("disaggregated", 0) > 0  # KV really crossed the link
    assert normal["summary"]["transfer_ms"]["p99"] is not None
    # The fault really fired: the proxy counted the link going down and refused connections.
    assert fault["proxy"]["link_down_events"] == 1
    assert fault["proxy"]["connections_refused"] + fault["summary"]["retries"] > 0
    events = [e["event"] for e in fault["fault_events"]]
    assert events[0].startswith("link down") and events[1] == "link up"
    # ... and the service reacted: degraded to local prefill, no request failed.
    assert fault["summary"]["degraded"] > 0 and fault["summary"]["failed"] == 0
    # KV whose transfer failed in the cut was released once the link was back, not at its TTL.
    assert 0 < fault["summary"]["kv_stranded_max_s"] <= 6 and fault["kv_stranded_byte_s"] > 0
    assert normal["summary"]["replayed"] == 300 and normal["summary"]["replay_mismatches"] == 0
    # every threshold of 0 that passed bounds its rate to 1 % or less (judgement.zero_rate_bound)
    for c in data["criteria"]:
        if c["threshold"] == 0 and c["unit"] == "fraction":
            assert c["rate_bound"] is not None and c["rate_bound"] <= 0.01, c
    assert {c["name"] for c in data["criteria"] if c["result"] == "not_measured"} == set()
    assert all(s["summary"]["drain_s"] <= s["summary"]["drain_limit_s"] + 5 for s in data["steps"])
    assert any(k.startswith("pdx_gateway_degradations_total") for k in fault["metrics_delta"])
    assert any(s.startswith("fault-") for s in data["plots"])
    md = next(tmp_path.glob("*/report.md")).read_text()
    assert "Faults and how the service reacted" in md and "link-down events 1" in md
    _check_preflight(data, md)


def _check_preflight(data: dict, md: str) -> None:
    """measure-kv sized the deployed tiny model; probe-link measured the KV store's host."""
    kv = data["preflight"]["measure_kv"]
    assert (kv["model"], kv["dtype"]) == ("tiny-llama", "fp32")
    assert kv["result"]["requests"] == [
        {"seq": 48, "kv_bytes": 48 * 512, "growing_bytes": 48 * 512, "sliding_bytes": 0,
         "state_bytes": 0}
    ]  # fmt: skip
    probe = data["preflight"]["probe_link"]
    store_host = data["target"]["kv_store"].rsplit(":", 1)[0]
    assert probe["server"].rsplit(":", 1)[0] == store_host
    s = probe["summary"]
    assert s["down_gbps"] > 0 and s["rtt_p50_ms"] is not None and s["chunks"]
    demand = probe["report"]["kv_demand"]
    rps = max(step["summary"]["achieved_rps"] for step in data["steps"])
    assert demand["rps"] == rps and demand["gbps"] == pytest.approx(48 * 512 * rps * 8 / 1e9)
    assert s["verdict"] == "GO"  # a few hundred kbit/s of KV on loopback
    assert "**probe-link** to a probe server at the KV store" in md


def test_smoke_inconclusive_when_the_sample_cannot_prove_999(tmp_path: Path) -> None:
    """99.9 % transfer success needs 2,995 transfers without failure: an 8 s step cannot say."""
    args = [
        "accept",
        str(SMOKE),
        "--out",
        str(tmp_path),
        "--no-progress",
        "--json",
        "--set",
        "criteria.transfer_success_min=0.999",
        "--set",
        "matrix.network=[normal]",
        "--set",
        "matrix.duration_s=8",
        "--set",
        "validity.min_duration_s=4",
        "--set",
        "preflight.probe_link=false",
    ]
    result = CliRunner().invoke(app, args)
    data = json.loads(result.stdout)
    assert data == _report(tmp_path)
    facts = {k: v for k, v in data["steps"][0]["summary"].items() if k.startswith("kv_stranded")}
    assert result.exit_code == 3 and data["verdict"] == "INCONCLUSIVE", (
        data["what_to_change"],
        facts,
    )
    assert data["exit_code"] == 3 and data["valid"]
    assert not any(c["result"] == "fail" for c in data["criteria"])
    c = next(c for c in data["criteria"] if c["name"] == "transfer_success_min")
    assert c["result"] == "indeterminate" and c["interval"][0] < 0.999
    n = c["sample"]
    if data["steps"][0]["summary"]["transfers_succeeded"] == n:  # none failed
        assert c["requests_needed"] == 2995
    assert any("undecided: run it for at least" in r and "transfers" in r
               for r in data["what_to_change"])  # fmt: skip
