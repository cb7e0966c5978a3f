"""``pdx accept`` end to end against a real OpenAI-compatible streaming server (external URL)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from typer.testing import CliRunner

from pdx.accept.report import SCHEMA_PATH, Report, load_report, report_schema
from pdx.cli.main import app

ROOT = Path(__file__).resolve().parents[2]
# This server is a plain OpenAI endpoint: it moves no KV and keeps no per-request pdx records,
# so the KV gates have nothing to read; a playbook for it leaves them unjudged (null), as
# playbooks/external-endpoint.yaml does; with their defaults the run is INCONCLUSIVE.
NO_KV_GATES = dict.fromkeys(("transfer_success_min", "retry_rate_max", "silent_fallback_max",
                             "output_mismatch_max", "kv_stranded_max_s"))  # fmt: skip


def _playbook(tmp_path: Path, url: str, **matrix: Any) -> Path:
    doc = {
        "name": "url-check",
        "target": {"url": url},
        "matrix": {
            "input_tokens": [16],
            "output_tokens": [6],
            "concurrency": [1, 3],
            "duration_s": 3,
            **matrix,
        },
        "criteria": {"ttft_p50_ms": 2000, "ttft_p99_ms": 5000, "tpot_p99_ms": 1000, **NO_KV_GATES},
        "validity": {"min_requests": 10, "min_duration_s": 1.5, "min_load_fraction": 0.5},
        # 3 s steps cannot bound a p99 (that needs 299 requests): judge point estimates here,
        # labelled as such; the confidence machinery has its own tests and the smoke run.
        "judgement": {"confidence": 0},
    }
    path = tmp_path / "pb.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _only_report(out: Path) -> Path:
    dirs = [d for d in out.iterdir() if d.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


def test_schema_file_matches_the_model() -> None:
    assert json.loads(SCHEMA_PATH.read_text()) == json.loads(json.dumps(report_schema()))


@pytest.mark.slow
@pytest.mark.alone
def test_go_then_no_go_with_override_then_diff(sse_server, tmp_path: Path) -> None:
    pb = _playbook(tmp_path, sse_server.url)
    runner = CliRunner()
    go = runner.invoke(app, ["accept", str(pb), "--out", str(tmp_path / "a"), "--no-progress"])
    assert go.exit_code == 0, go.output
    assert go.stdout.startswith("GO — run VALID")
    assert "on point estimates (no confidence)" in go.stdout.splitlines()[0]
    a_dir = _only_report(tmp_path / "a")
    data = json.loads((a_dir / "report.json").read_text())
    _validate(data)
    assert data["verdict"] == "GO" and data["valid"] and data["complete"]
    names = {c["name"] for c in data["criteria"]}
    assert {"ttft_p50_ms", "ttft_p99_ms", "tpot_p99_ms", "error_rate_max"} <= names
    for c in data["criteria"]:
        assert set(c) >= {"name", "measured", "threshold", "margin", "passed", "step"}
        assert c["confidence"] == 0 and c["result"] == "pass" and c["requests_needed"] is None
        assert c["method"].startswith(("point estimate", "count", "no data")), c
    step = data["steps"][1]
    assert step["concurrency"] == 3 and step["summary"]["ok"] >= 10
    assert step["summary"]["usage_from_server"] == step["summary"]["ok"]
    assert "ttft" in step["summary"]["locust_csv"]  # Locust's own view kept alongside
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert key in data["formulas"]
    assert (a_dir / "raw" / step["id"] / "locust_stats.csv").is_file()
    assert list((a_dir / "raw" / step["id"]).glob("requests-*.jsonl"))
    html = (a_dir / "report.html").read_text()
    assert "Verdict: GO" in html and "data:image/png;base64," in html and 'src="http' not in html
    assert (a_dir / "report.md").read_text().startswith("# Acceptance report: url-check")

    nogo = runner.invoke(
        app,
        [
            "accept",
            str(pb),
            "--out",
            str(tmp_path / "b"),
            "--no-progress",
            "--json",
            "--set",
            "criteria.ttft_p99_ms=0.001",
            "--set",
            "matrix.concurrency=[2]",
        ],
    )
    assert nogo.exit_code == 1, nogo.output
    b = json.loads(nogo.stdout)
    _validate(b)
    assert b["verdict"] == "NO-GO" and b["valid"]
    failed = [c for c in b["criteria"] if not c["passed"]]
    assert [c["name"] for c in failed] == ["ttft_p99_ms"]
    assert failed[0]["margin"] < 0 and failed[0]["threshold"] == 0.001
    assert any("TTFT over SLA" in r for r in b["what_to_change"])
    assert any("no tested load meets the latency SLA" in r for r in b["what_to_change"])

    b_dir = _only_report(tmp_path / "b")
    show = runner.invoke(app, ["report", "show", str(b_dir)])
    assert show.exit_code == 0 and "NO-GO" in show.stdout and "ttft_p99_ms" in show.stdout
    diff = runner.invoke(app, ["report", "diff", str(a_dir), str(b_dir), "--json"])
    assert diff.exit_code == 0, diff.output
    rows = json.loads(diff.stdout)["rows"]
    assert {r["status"] for r in rows if r["criterion"] == "ttft_p99_ms"} >= {"only in A"}
    bad = runner.invoke(app, ["report", "show", str(tmp_path)])
    assert bad.exit_code == 2 and "report.json" in bad.stderr


def test_invalid_run_is_no_go_and_says_why(sse_server, tmp_path: Path) -> None:
    pb = _playbook(tmp_path, sse_server.url, concurrency=[1], duration_s=2)
    result = CliRunner().invoke(
        app,
        [
            "accept",
            str(pb),
            "--out",
            str(tmp_path),
            "--no-progress",
            "--json",
            "--set",
            "validity.min_requests=100000",
            "--set",
            "preflight.measure_kv=true",
            "--set",
            "preflight.model_preset=llama-3.1-8b",
        ],
    )
    assert result.exit_code == 1, result.output
    data = json.loads(result.stdout)
    assert data["verdict"] == "NO-GO" and not data["valid"]
    assert all(c["passed"] for c in data["criteria"])  # criteria met, run still refused
    assert "validity.min_requests 100000" in data["validity"][0]["problems"][0]
    assert "not valid" in data["what_to_change"][0]
    kv = data["preflight"]["measure_kv"]["result"]
    assert kv["kv_bytes_per_token"] == 131072  # Llama-3.1-8B, bf16: 2·32·8·128·2


def test_progress_lines_on_stderr_when_it_is_not_a_terminal(sse_server, tmp_path: Path) -> None:
    """A script or CI log sees the run move (stdout stays the JSON report)."""
    pb = _playbook(tmp_path, sse_server.url, concurrency=[1, 2], duration_s=2)
    result = CliRunner().invoke(app, ["accept", str(pb), "--out", str(tmp_path), "--json"])
    data = json.loads(result.stdout)
    lines = [line.split(" ", 1)[1] for line in result.stderr.strip().splitlines()]
    assert lines[0] == f"target: starting (the running target {sse_server.url})"
    assert lines[1].startswith("target: ready at ") and lines[2].startswith("pre-flight: ")
    steps = [line for line in lines if line.startswith("step ")]
    assert [s.split(":")[0] for s in steps] == [
        f"step 1/2 {data['steps'][0]['id']}",
        f"step 1/2 {data['steps'][0]['id']}",
        f"step 2/2 {data['steps'][1]['id']}",
        f"step 2/2 {data['steps'][1]['id']}",
    ]
    assert "started (2 s of load planned)" in steps[0] and " requests, " in steps[1]
    assert lines[-1].startswith(f"verdict: {data['verdict']} (exit {result.exit_code}); report: ")
    quiet = CliRunner().invoke(
        app, ["accept", str(pb), "--out", str(tmp_path), "--json", "--no-progress"]
    )
    assert quiet.stderr == ""


def test_failed_requests_are_counted_not_timed(sse_server, tmp_path: Path) -> None:
    sse_server.cfg.fail_every = 4
    pb = _playbook(tmp_path, sse_server.url, concurrency=[2], duration_s=2)
    result = CliRunner().invoke(
        app, ["accept", str(pb), "--out", str(tmp_path), "--no-progress", "--json"]
    )
    assert result.exit_code == 1
    s = json.loads(result.stdout)["steps"][0]["summary"]
    assert s["failed"] > 0 and s["ttft_ms"]["count"] == s["ok"]
    assert s["error_rate"] == pytest.approx(s["failed"] / s["requests"])
    assert any("HTTP 500" in e for e in s["errors"])


@pytest.mark.slow
@pytest.mark.alone
@pytest.mark.parametrize(
    ("sig", "code", "name"), [(signal.SIGINT, 130, "Ctrl-C"), (signal.SIGTERM, 143, "SIGTERM")]
)
def test_ctrl_c_writes_partial_report_and_stops_locust(
    sse_server, tmp_path: Path, sig: signal.Signals, code: int, name: str
) -> None:
    pb = _playbook(tmp_path, sse_server.url, concurrency=[2], duration_s=60)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from pdx.cli.main import main; main()",
            "accept",
            str(pb),
            "--out",
            str(tmp_path / "out"),
            "--no-progress",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A shell that starts jobs in the background ignores SIGINT for them, and children
        # inherit that; Ctrl-C is what this test is about, so give the run the terminal default.
        preexec_fn=_default_sigint,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list((tmp_path / "out").glob("*/raw/*/requests-*")):
        time.sleep(0.2)
    children = _children(proc.pid)
    assert children, "locust should be running"
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # pdx dumps every thread's stack to stderr
        time.sleep(2)
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"pdx accept did not stop within 90 s of Ctrl-C; stderr tail:\n{err[-6000:]}")
    assert proc.returncode == code, err
    assert f"interrupted ({name}); partial report" in err
    report = load_report(_only_report(tmp_path / "out"))
    assert not report.complete and report.verdict == "NO-GO"
    assert any(f"interrupted ({name})" in p for p in report.problems)
    for pid in children:
        assert not _alive(pid), f"child {pid} still running"


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        out += [int(x) for x in task.read_text().split()]
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def _validate(data: dict[str, Any]) -> None:
    """Against the shipped JSON Schema and the pydantic model."""
    Report.model_validate(data)
    jsonschema.validate(data, json.loads(SCHEMA_PATH.read_text()))


def test_unreachable_url_could_not_run(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        pb = _playbook(tmp_path, f"http://127.0.0.1:{port}")
        result = CliRunner().invoke(
            app,
            ["accept", str(pb), "--out", str(tmp_path / "r"), "--no-progress",
             "--set", "target.ready_timeout_s=1"],
        )  # fmt: skip
    assert result.exit_code == 2
    assert result.stderr.startswith("error: could not run") or "not reachable" in result.stderr
    report = load_report(_only_report(tmp_path / "r"))
    assert not report.complete and any("not reachable" in p for p in report.problems)


@pytest.mark.slow
@pytest.mark.alone
def test_open_loop_step_with_two_locust_workers(sse_server, tmp_path: Path) -> None:
    doc = {
        "name": "open",
        "target": {"url": sse_server.url},
        "matrix": {"input_tokens": [8], "output_tokens": [4], "rate_rps": [20], "duration_s": 4},
        "load": {"workers": 2, "open_loop_users": 4},
        "criteria": NO_KV_GATES,
        "judgement": {"confidence": 0},
        "validity": {"min_requests": 20, "min_duration_s": 2, "min_load_fraction": 0.6},
    }
    pb = tmp_path / "open.yaml"
    pb.write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(
        app, ["accept", str(pb), "--out", str(tmp_path / "r"), "--no-progress", "--json"]
    )
    assert result.exit_code == 0, result.output
    step = json.loads(result.stdout)["steps"][0]
    assert step["rate_rps"] == 20 and step["valid"]
    s = step["summary"]
    assert 0.6 * 20 <= s["achieved_rps"] <= 1.5 * 20  # Poisson: achieved vs target, reported
    records = list((_only_report(tmp_path / "r") / "raw" / step["id"]).glob("requests-*.jsonl"))
    assert len(records) == 2  # one file per worker: both workers sent load


@pytest.mark.slow
@pytest.mark.alone
def test_repeat_runs_the_playbook_n_times_and_compares(sse_server, tmp_path: Path) -> None:
    pb = _playbook(tmp_path, sse_server.url, concurrency=[2], duration_s=2)
    doc = yaml.safe_load(pb.read_text())
    doc["judgement"] = {"confidence": 0.95}
    doc["criteria"] = {"ttft_p50_ms": 2000, "error_rate_max": 0.0, **NO_KV_GATES}
    pb.write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(
        app, ["accept", str(pb), "--out", str(tmp_path / "r"), "--no-progress", "--json",
              "--repeat", "2"],
    )  # fmt: skip
    data = json.loads(result.stdout)
    assert data["runs"] == 2 and len(data["reports"]) == 2
    assert (
        result.exit_code
        == data["exit_code"]
        == {"GO": 0, "NO-GO": 1, "INCONCLUSIVE": 3}[data["verdict"]]
    )
    for d in data["reports"]:
        _validate(json.loads((Path(d) / "report.json").read_text()))
    (root,) = [d for d in (tmp_path / "r").iterdir() if d.is_dir()]
    assert root.name.endswith("url-check-repeat") and (root / "repeat.json").is_file()
    row = next(r for r in data["rows"] if r["criterion"] == "ttft_p50_ms")
    assert len(row["measured"]) == 2 and row["mean"] == pytest.approx(sum(row["measured"]) / 2)
    assert row["cv"] is not None and row["mean_interval"][0] <= row["mean"]
    assert row["unstable"] == (row["step"] in data["unstable_steps"])
