"""``pdx accept playbooks/vllm-pd.yaml`` end to end: a real vLLM pair, Locust, a killed prefill.

About three and a half minutes on two cores (the pair's start included): the killed-prefill
step is cut from 150 s to 90 s (the restart, 25-45 s on two cores since each instance's worker
stays on its own core, still fits with room), the normal step to 45 s and 60 replays
(``conditions.normal.duration_s``, ``judgement.replay_requests``): what it must show, KV moved
through NIXL with none failed or degraded, needs no p99. The verdict may therefore be GO or
INCONCLUSIVE (a p99 or a 1 % rate the shorter sample cannot decide); no criterion may fail,
and the killed-prefill step must show what it is there for.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner
from vllm_helpers import engine_or_skip

from pdx.accept.report import Report
from pdx.cli.main import app

PLAYBOOK = Path(__file__).resolve().parents[2] / "playbooks" / "vllm-pd.yaml"

pytestmark = [pytest.mark.slow, pytest.mark.alone, pytest.mark.timeout(1200)]


def test_vllm_pd_playbook(tmp_path: Path) -> None:
    engine_or_skip()
    short = ["conditions.normal.duration_s=45", "conditions.prefill-killed.duration_s=90",
             "judgement.replay_requests=60"]  # fmt: skip
    args = ["accept", str(PLAYBOOK), "--out", str(tmp_path), "--no-progress"]
    result = CliRunner().invoke(app, [*args, *(a for s in short for a in ("--set", s))])
    (path,) = list(tmp_path.glob("*/report.json"))
    data = json.loads(path.read_text())
    Report.model_validate(data)
    failed = [c for c in data["criteria"] if c["result"] == "fail"]
    reasons_seen = [st["summary"]["degrade_reasons"] for st in data["steps"]]
    assert data["valid"] and data["complete"] and not failed, (failed, reasons_seen)
    assert result.exit_code == {"GO": 0, "INCONCLUSIVE": 3}[data["verdict"]]
    assert data["preflight"]["measure_kv"]["result"]["engine"] == "vllm"
    normal, killed = data["steps"]
    # KV really moved on the normal step: transfers through NIXL, none failed, none degraded.
    assert normal["summary"]["transfer_outcomes"] == {
        "ok": normal["summary"]["routes"]["disaggregated"]
    }
    assert normal["summary"]["degraded"] == 0 and normal["summary"]["failed"] == 0
    assert any("vllm:nixl_bytes_transferred_sum" in k and "decode-0" in k
               for k in normal["metrics_delta"])  # fmt: skip
    # The kill: prefill died 4 s in, requests went to decode alone (labelled), none failed,
    # the deploy restarted prefill and disaggregated requests came back within the step.
    (event,) = killed["fault_events"]
    assert event["event"].startswith("prefill-0 killed")
    s = killed["summary"]
    assert s["failed"] == 0 and s["degraded"] > 0
    reasons = {r.split(":")[0] for r in s["degrade_reasons"]}
    assert reasons <= {"prefill_unavailable", "prefill_failed", "prefill_timeout",
                       "kv_load_failed", "circuit_open"}, reasons  # fmt: skip
    assert killed["recovery_s"] is not None and s["routes"].get("disaggregated", 0) > 0
