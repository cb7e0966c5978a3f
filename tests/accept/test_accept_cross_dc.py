"""``playbooks/cross-dc-lite.yaml``: the pair across the packet-level WAN, each step beside the
simulator's prediction, the settings the run recommends, calibration from its report, and a
link made worse mid-step than its pre-flight measured (flagged unexplained). Root only."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from pdx.cli.main import app

PLAYBOOK = Path(__file__).resolve().parents[2] / "playbooks" / "cross-dc-lite.yaml"
PREFIX = "pdxcdlt"  # not the playbook's own prefix: a test never touches a user's namespaces
METRICS = {"ttft_p50_ms", "ttft_p99_ms", "second_token_p50_ms", "tpot_p50_ms", "transfer_p50_ms"}
SETTINGS = {"local_prefill_max_tokens", "kv_streams", "chunk_size_kb", "codec",
            "prefill_decode_ratio", "congestion_control"}  # fmt: skip

pytestmark = [
    pytest.mark.system,
    pytest.mark.slow,
    pytest.mark.skipif(any(shutil.which(t) is None for t in ("ip", "tc")), reason="needs ip, tc"),
]


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if line.startswith(PREFIX)]


def _run(out: Path, extra: list[str]) -> tuple[int, str, dict[str, Any]]:
    args = ["accept", str(PLAYBOOK), "--out", str(out), "--no-progress"]
    for item in [f"target.netns.prefix={PREFIX}", *extra]:
        args += ["--set", item]
    result = CliRunner().invoke(app, args)
    data = json.loads(next(out.glob("*/report.json")).read_text())
    return result.exit_code, result.output, data


@pytest.mark.timeout(600)  # four 25-45 s steps, a probe before each, the deploy: ~3 minutes
def test_cross_dc_lite_every_step_valid_and_predicted(tmp_path: Path) -> None:
    # The playbook's 50 s steps cut to 25 s: still past validity.min_duration_s (20 s) and
    # 20-60 requests a step, enough for the medians this test checks against the predictions;
    # but not at 200 Mbit/s, where one 1,024-token request takes ~7 s (128 MiB of KV): 25 s
    # held 4 requests, under validity.min_requests (5), so that step keeps 45 s (6-7 requests).
    # Four of the playbook's six steps: both prompt sizes at 10 ms, 40 ms at full rate and at
    # 200 Mbit/s (the prediction must follow the rate); 80 ms adds only a longer RTT, and loss
    # has its own test below.
    code, output, data = _run(
        tmp_path / "a",
        ["matrix.duration_s=25", "conditions.wan40-200m.duration_s=45",
         "matrix.network=[wan10,wan40,wan40-200m]"],
    )  # fmt: skip
    # INCONCLUSIVE is a verdict too: a 25 s step may leave a criterion its sample cannot
    # decide; what this test is about, valid steps beside their predictions, is checked below.
    assert code in (0, 1, 3), (output, data["problems"])
    assert data["valid"] and data["complete"], output
    assert all(s["valid"] for s in data["steps"]) and len(data["steps"]) == 4
    for s in data["steps"]:
        assert set(s["prediction"]) == METRICS, s["id"]
        assert isinstance(s["unexplained"], bool)
        e = s["prediction"]["transfer_p50_ms"]
        assert e["predicted"] > 0 and e["measured"] > 0 and e["error_pct"] is not None
        # each step was probed again under its own condition, and predicted from that probe
        assert s["prediction_model"]["link_from"] == "the step's own probe"
    by_net = {s["network"]: s for s in data["steps"]}
    # the prediction follows the link: 200 Mbit/s moves the same KV about 5x slower
    slow, fast = by_net["wan40-200m"], by_net["wan40"]
    ratio = (
        slow["prediction"]["transfer_p50_ms"]["predicted"]
        / fast["prediction"]["transfer_p50_ms"]["predicted"]
    )
    assert 3 < ratio < 7
    summary = data["prediction_summary"]
    assert summary["predicted"] == 4 and summary["unexplained"] <= 2, summary
    recs = data["recommendations"]
    assert set(recs) == SETTINGS
    assert all(set(r) >= {"value", "why"} and r["why"] for r in recs.values())
    assert isinstance(recs["local_prefill_max_tokens"]["value"], int)
    assert (tmp_path / "a").glob("*/prediction-vs-measured.png")
    md = next((tmp_path / "a").glob("*/report.md")).read_text()
    assert "## Prediction vs measurement" in md and "## Recommended settings" in md
    assert _namespaces() == []

    # calibration from the measured run, then sizing from it
    report = next((tmp_path / "a").glob("*/report.json"))
    sim = CliRunner().invoke(app, ["simulate", "--calibrate", str(report), "--json"])
    assert sim.exit_code == 0, sim.output
    cal = json.loads(sim.output)
    assert cal["config"]["link_rtt_s"] > 0.009 and cal["config"]["prefill_flops"] > 0
    assert cal["disaggregated"]["ttft_p50_s"] > 0


@pytest.mark.timeout(400)
def test_loss_added_mid_step_is_unexplained(tmp_path: Path) -> None:
    """The step's probe sees a clean 40 ms link; 3 s into the load 8 % of the router hop's
    wire packets start to drop. On this link a 128 MiB transfer takes about 1.3 s clean, and
    2 s already with 3 % loss (BBR keeps much of its rate): every request after the first sees
    it, so the median's whole interval lies above the prediction's +25 %. A 2 s probe: a 1 s
    one at 40 ms RTT can under-measure the clean link (slow start), predicting slow itself."""
    code, output, data = _run(
        tmp_path,
        [
            "matrix.network=[wan40]",
            "matrix.input_tokens=[1024]",
            "matrix.concurrency=[1]",
            "matrix.exclude=[]",
            "matrix.duration_s=40",
            "preflight.probe_step_duration_s=2",
            "conditions.wan40.wan_events=[{at_s: 3, set: {loss: 0.08}}]",
        ],
    )
    assert code in (0, 1), (output, data["problems"])
    (step,) = data["steps"]
    assert step["valid"], step["validity_problems"]
    assert any("router hop: set loss=0.08" in e["event"] for e in step["fault_events"])
    assert step["preflight"]["probe_link"]["summary"]["loss_down_pct"] < 0.5
    assert step["unexplained"] is True, step["prediction"]
    assert step["prediction"]["transfer_p50_ms"]["result"] == "beyond"
    assert step["prediction"]["transfer_p50_ms"]["error_pct"] > 25
    assert data["prediction_summary"]["unexplained_steps"] == [step["id"]]
    assert "1 of 1 steps unexplained" in output
    assert _namespaces() == []
