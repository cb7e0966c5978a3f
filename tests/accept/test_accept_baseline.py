"""``baseline: colocated`` for real: the smoke pair's step beside its every-request-local twin."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from smoke_helpers import SHORT_SMOKE
from typer.testing import CliRunner

from pdx.accept.report import SCHEMA_PATH
from pdx.cli.main import app

SMOKE = Path(__file__).resolve().parents[2] / "playbooks" / "smoke.yaml"

pytestmark = [pytest.mark.slow, pytest.mark.alone]


def test_split_beside_colocated(tmp_path: Path) -> None:
    args = ["accept", str(SMOKE), "--baseline", "colocated", "--out", str(tmp_path),
            "--no-progress", *[a for s in SHORT_SMOKE for a in ("--set", s)]]  # fmt: skip
    r = CliRunner().invoke(app, args)
    (path,) = list(tmp_path.glob("*/report.json"))
    data = json.loads(path.read_text())
    jsonschema.validate(data, json.loads(SCHEMA_PATH.read_text()))
    assert r.exit_code == 0, (r.output, data["what_to_change"])
    base = data["baseline"]
    (row,) = base["steps"]
    assert row["step"] == data["steps"][0]["id"] and row["colocated_step"].endswith("-colocated")
    assert row["order"] == "split first"  # step 0; the next step would run its twin first
    # the split shipped KV; the twin prefilled every request where it decoded
    assert row["split"]["disaggregated"] > 0 and row["colocated"]["disaggregated"] == 0
    assert row["colocated"]["requests"] > 0
    for side in ("split", "colocated"):
        for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "goodput_rps"):
            assert row[side][k]["value"] is not None and row[side][k]["interval"] is not None
    assert row["verdict"] in ("pays", "costs", "mixed", "no difference shown")
    assert row["line"].startswith(row["step"])
    # the twin is judged and shown, never deciding: it is not among the run's criteria
    assert row["colocated_criteria"] and all(
        not c["step"].endswith("colocated") for c in data["criteria"]
    )
    assert (tmp_path / path.parent.name / "raw" / row["colocated_step"]).is_dir()
    md = (path.parent / "report.md").read_text()
    assert "## Split vs colocated" in md and row["line"] in md
    # loose thresholds say so: smoke's 2 s TTFT p50 against a tiny model's tens of ms
    loose = {n["name"]: n for n in data["not_a_constraint"]}
    assert "ttft_p50_ms" in loose and loose["ttft_p50_ms"]["headroom"] > 10
    assert "## Not a constraint here" in md
