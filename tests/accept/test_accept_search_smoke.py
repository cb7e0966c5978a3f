"""``pdx accept --search rate`` on the smoke pair for real, then plain runs either side of it.

The capacity C the search finds must hold up: the same playbook at 0.7·C is GO, at 1.5·C
NO-GO. The probes are the short smoke steps of ``SHORT_SMOKE`` (smoke_helpers.py), which judge
what 10 s can prove, on one deployment (``search.fresh_deploy=false``: a fresh deploy per probe
would double the test's time); the method is the one a full search uses. The range starts at
16 req/s (the pair carries about 60 on two cores) and the bracket may be 12 req/s wide: 7 probes
where 8:128 at 8 req/s took 10-14 (about 40 s less); 1.5·C still lies past the bracket for any
C of 24 or more.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jsonschema
import pytest
from smoke_helpers import SHORT_SMOKE
from typer.testing import CliRunner

from pdx.accept.report import SCHEMA_PATH, Report, load_report
from pdx.cli.main import app

SMOKE = Path(__file__).resolve().parents[2] / "playbooks" / "smoke.yaml"

pytestmark = [pytest.mark.slow, pytest.mark.alone]


def _sets(extra: list[str]) -> list[str]:
    return [a for s in [*SHORT_SMOKE, *extra] for a in ("--set", s)]


def _only_report(out: Path) -> dict:
    (path,) = list(out.glob("*/report.json"))
    data = json.loads(path.read_text())
    jsonschema.validate(data, json.loads(SCHEMA_PATH.read_text()))
    Report.model_validate(data)
    return data


@pytest.mark.timeout(900)  # a 360 s search budget, the deploy, then two plain runs
def test_search_rate_then_either_side_of_the_capacity(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "search"
    args = ["accept", str(SMOKE), "--search", "rate", "--search-range", "16:128",
            "--search-resolution", "12", "--search-budget-s", "360", "--out", str(out),
            "--no-progress", *_sets(["search.fresh_deploy=false"])]  # fmt: skip
    r = runner.invoke(app, args)
    data = _only_report(out)
    assert r.exit_code == 0, (r.output, data["problems"])
    (s,) = data["search"]
    assert s["outcome"] == "found", s
    good, bad = s["bracket"]
    assert s["limit"] == good and 16 <= good < bad <= 128 and bad - good <= 12
    assert data["verdict"] == "GO" and data["complete"]
    probes = s["probes"]
    assert len(probes) == len(data["steps"]) and probes[0]["value"] == 16.0
    # every probe is a judged step: its GO or NO-GO comes from that step's own criteria
    by_step = {st["id"]: st for st in data["steps"]}
    for p in probes:
        assert p["step"] in by_step and by_step[p["step"]]["rate_rps"] == p["value"]
        if p["verdict"] == "NO-GO":
            assert p["failed"], p
    assert any(p["verdict"] == "GO" and p["value"] == good for p in probes)
    assert any(p["verdict"] != "GO" and p["value"] == bad for p in probes)
    assert s["prediction"]["calibrated_on"] == probes[0]["step"]
    assert s["prediction"]["curve"], "the simulator's curve is drawn beside the probes"
    assert any(name.startswith("envelope-") for name in data["plots"])
    md = (next(out.glob("*/report.md"))).read_text()
    assert "## Search: rate under normal" in md and "bracket [" in md
    assert load_report(next(out.glob("*"))).search == data["search"]

    capacity = float(good)
    for factor, code, verdict in ((0.7, 0, "GO"), (1.5, 1, "NO-GO")):
        where = tmp_path / f"x{factor}"
        rate = float(f"{capacity * factor:.3g}")
        seconds = max(10, math.ceil(90 / rate))  # the sample 5 % rates need, as the probes had
        load = ["matrix.concurrency=null", f"matrix.rate_rps=[{rate}]"]
        plain = ["accept", str(SMOKE), "--out", str(where), "--no-progress",
                 *_sets([*load, f"matrix.duration_s={seconds}"])]  # fmt: skip
        r = runner.invoke(app, plain)
        rep = _only_report(where)
        assert (r.exit_code, rep["verdict"]) == (code, verdict), (
            factor,
            rate,
            r.output,
            rep["what_to_change"],
        )
