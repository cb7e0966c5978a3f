"""A trace replayed by ``pdx accept`` against pdx's own pair (playbooks/trace-replay.yaml, a
window of it): every request carries its trace line, the step says the trace's ideal prefix hit
ratio, the cached prefix decode reported and the KV that crossed, and ``pdx simulate`` on the
same trace predicts those bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdx.cli.main import app
from pdx.traces.formats import read_trace
from pdx.traces.schedule import Window, plan
from pdx.traces.stats import ideal_cached

ROOT = Path(__file__).resolve().parents[2]
PLAYBOOK = ROOT / "playbooks" / "trace-replay.yaml"
TRACE = ROOT / "playbooks" / "traces" / "chat-sessions.jsonl"
WINDOW = 80  # requests: the first 80 of the trace's 160

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_trace_replay_end_to_end_and_the_simulator_agrees_on_the_bytes(tmp_path: Path) -> None:
    args = ["accept", str(PLAYBOOK), "--out", str(tmp_path), "--no-progress", "--json",
            "--set", f"load.workload.max_requests={WINDOW}", "--set", "validity.min_requests=50",
            "--set", "matrix.duration_s=12", "--set", "validity.min_duration_s=5"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code in (0, 1, 3), result.output
    data = json.loads(result.stdout)
    (step,) = data["steps"]
    assert step["id"].startswith("s00-trace-r") and step["valid"], step["validity_problems"]
    tr = step["summary"]["trace"]
    planned, _ = plan(read_trace(TRACE), Window(max_requests=WINDOW, time_scale=0.25))
    window = read_trace(TRACE)
    window.requests = [p.request for p in planned]
    ideal = sum(ideal_cached(window)) / sum(r.input_tokens for r in window.requests)
    assert tr["requests"] == WINDOW and tr["sessions"] == len({r.session for r in window.requests})
    assert tr["ideal_hit_ratio"] == pytest.approx(ideal)
    # decode's own prefix cache served the trace's reuse, to the block (vLLM's counters: none)
    assert tr["reported_cached_ratio"] == pytest.approx(ideal) and tr["engine_hit_ratio"] == {}
    assert tr["policy"] == "uncached" and tr["offloaded_share"] == 1.0
    assert tr["send_lag_ms"]["p50"] < 50
    report_dir = next(p for p in tmp_path.iterdir() if p.is_dir())
    md = (report_dir / "report.md").read_text()
    assert "## Trace replay" in md and f"{100 * ideal:.1f} %" in md
    # every request crossed the link (uncached parts of 16+ tokens, local below 8), only what
    # decode lacked: the simulator, replaying the same window with the deployed model's KV per
    # token and per-instance prefix caches, ships the same bytes
    per_token = data["preflight"]["measure_kv"]["result"]["kv_bytes_per_token"]
    sim = CliRunner().invoke(app, [
        "simulate", "--workload", str(TRACE), "--format", "mooncake", "--length-scale",
        "0.03125", "--time-scale", "0.25", "--max-requests", str(WINDOW), "--mode",
        "disaggregated", "--model-preset", "llama-3.1-8b", "--kv-bytes-per-token",
        str(per_token), "--local-prefill-max-tokens", "7", "--prefix-cache-blocks", "100000",
        "--json",
    ])  # fmt: skip
    assert sim.exit_code == 0, sim.output
    predicted = json.loads(sim.stdout)["disaggregated"]["kv_shipped_bytes"]
    measured = tr["kv_bytes_total"]
    assert abs(predicted - measured) / measured < 0.05, (predicted, measured)


def test_offload_policies_side_by_side_on_the_same_window(tmp_path: Path) -> None:
    """matrix.offload: the window replayed under length, then uncached, on one deployment; the
    second policy's step finds no cache the first one warmed (its tokens are salted by step)."""
    args = ["accept", str(PLAYBOOK), "--out", str(tmp_path), "--no-progress", "--json",
            "--set", f"load.workload.max_requests={WINDOW}", "--set", "validity.min_requests=50",
            "--set", "matrix.duration_s=12", "--set", "validity.min_duration_s=5",
            "--set", "matrix.offload=[length,uncached]",
            "--set", "judgement.replay_requests=0"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code in (0, 1, 3), result.output
    data = json.loads(result.stdout)
    length, uncached = data["steps"]
    assert length["id"].endswith("-normal-length") and uncached["id"].endswith("-normal-uncached")
    by_step = {sid: [c["advisory"] for c in data["criteria"] if c["step"] == sid]
               for sid in (length["id"], uncached["id"])}  # fmt: skip
    assert by_step[uncached["id"]] and all(by_step[uncached["id"]])  # judged beside, advisory
    assert by_step[length["id"]] and not any(by_step[length["id"]])  # the verdict is length's
    lt, ut = length["summary"]["trace"], uncached["summary"]["trace"]
    assert (lt["policy"], ut["policy"]) == ("length", "uncached")
    ideal = ut["ideal_hit_ratio"]
    assert ut["reported_cached_ratio"] == pytest.approx(ideal)  # no warm cache from step 1
    assert lt["offloaded_share"] == ut["offloaded_share"] == 1.0
    saved = 1 - ut["kv_bytes_total"] / lt["kv_bytes_total"]
    assert abs(saved - ideal) < 0.10, (saved, ideal)  # fewer bytes by about the reused share
    off = data["offload"]
    assert off["candidate"] == "length" and off["policies"] == ["length", "uncached"]
    (cell,) = off["cells"]
    assert cell["order"] == ["length", "uncached"]
    (versus,) = cell["versus"]
    sides = cell["policies"]
    assert sides["uncached"]["kv_bytes"] == ut["kv_bytes_total"]
    assert versus["kv_bytes_ratio"] == pytest.approx(lt["kv_bytes_total"] / ut["kv_bytes_total"],
                                                     rel=1e-3)  # fmt: skip
    assert versus["verdict"] in ("pays", "costs", "mixed", "no difference shown")
    for side in sides.values():
        assert side["goodput_rps"]["interval"] is not None and side["requests"] == WINDOW
        # the simulator on the same window, each policy with prefix caches: the bytes it ships
        assert side["predicted_kv_bytes"] == pytest.approx(side["kv_bytes"], rel=0.05)
        lo, hi = side["ttft_p90_ms"]["interval"]
        assert lo <= side["ttft_p90_ms"]["value"] <= hi
    report_dir = next(p for p in tmp_path.iterdir() if p.is_dir())
    md = (report_dir / "report.md").read_text()
    assert "## Offload policies" in md and versus["line"] in md
    # the simulator, each policy on the same window with prefix caches, predicts the ratio
    shipped = {}
    for policy in ("length", "uncached"):
        sim = CliRunner().invoke(app, [
            "simulate", "--workload", str(TRACE), "--format", "mooncake", "--length-scale",
            "0.03125", "--time-scale", "0.25", "--max-requests", str(WINDOW), "--mode",
            "disaggregated", "--model-preset", "llama-3.1-8b", "--kv-bytes-per-token", "512",
            "--local-prefill-max-tokens", "7", "--prefix-cache-blocks", "100000",
            "--offload-policy", policy, "--json",
        ])  # fmt: skip
        assert sim.exit_code == 0, sim.output
        shipped[policy] = json.loads(sim.stdout)["disaggregated"]["kv_shipped_bytes"]
    predicted = shipped["length"] / shipped["uncached"]
    assert predicted == pytest.approx(versus["kv_bytes_ratio"], rel=0.05), predicted


def test_threshold_search_finds_the_least_egress_at_the_best_goodput(tmp_path: Path) -> None:
    """--search router.offload.threshold_tokens on the trace: a ladder of thresholds, each a
    judged probe on one deployment; the pick is GO, ships the fewest bytes of those the sample
    cannot tell from the best goodput, and comes with llm-d's and Dynamo's settings."""
    args = ["accept", str(PLAYBOOK), "--out", str(tmp_path), "--no-progress", "--json",
            "--search", "router.offload.threshold_tokens", "--search-range", "16:64",
            "--set", "load.workload.max_requests=48", "--set", "validity.min_requests=30",
            "--set", "matrix.duration_s=6", "--set", "validity.min_duration_s=3",
            "--set", "search.fresh_deploy=false", "--set", "preflight.measure_kv=false",
            "--set", "judgement.replay_requests=0", "--set", "judgement.zero_rate_bound=0.2",
            "--set", "search.max_extensions=0",
            # judged on TTFT and errors alone: 48 requests cannot show the rate criteria
            *[a for c in ("transfer_success_min", "retry_rate_max", "degrade_rate_max",
                          "silent_fallback_max", "output_mismatch_max")
              for a in ("--set", f"criteria.{c}=null")]]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code in (0, 1, 3), result.output
    data = json.loads(result.stdout)
    (search,) = data["search"]
    assert search["param"] == "router.offload.threshold_tokens" and search["policy"] == "uncached"
    points = search["points"]
    assert [p["value"] for p in points] == [16, 32, 64]  # the ladder, LO doubling up to HI
    assert [s["id"].rsplit("-", 1)[1] for s in data["steps"]][:3] == ["t16", "t32", "t64"]
    # the window's uncached parts are 32 tokens but one of 63: at 64 prompts stay local (but
    # one whose session's previous turn decode had not cached yet when it was routed)
    shares = [p["offloaded_share"] for p in points]
    assert shares[:2] == [1.0, 1.0] and shares[2] < 0.1
    assert points[2]["kv_bytes"] < points[1]["kv_bytes"] / 10
    best = max(points, key=lambda p: p["goodput_rps"]["value"])
    for v in search["indistinguishable"]:
        p = next(p for p in points if p["value"] == v)
        assert p["goodput_rps"]["interval"][1] >= best["goodput_rps"]["interval"][0]
    if search["outcome"] == "found":
        pick = next(p for p in points if p["value"] == search["limit"])
        same = [p for p in points if p["value"] in search["indistinguishable"]
                and p["verdict"] == "GO"]  # fmt: skip
        assert pick["verdict"] == "GO" and pick["kv_bytes"] == min(p["kv_bytes"] for p in same)
        lo, hi = search["bracket"]
        assert lo <= search["limit"] <= hi and search["confirmed"]
        s = search["settings"]
        assert f"nonCachedTokens: {search['limit']}" in s["llm-d"]
        assert f'"eff_isl_threshold": {search["limit"]}' in s["dynamo"]
        assert f"threshold_tokens: {search['limit']}" in s["pdx"]
        assert result.exit_code == 0
    else:  # the sample decided otherwise: the report says why, and the exit code follows
        assert search["outcome"] in ("no_go", "disputed") and result.exit_code in (1, 3)
