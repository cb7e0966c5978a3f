"""Gates for P/D failures seen in the field: pure record logic, then each provoked for real.

The slow tests deploy the real pair and break it on purpose: a lossy codec (wrong greedy
tokens), decode recomputing quietly while the store evicts objects (silent fallback), decode
killed between Get and Release (stranded KV), a transfer that never answers (overdue).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdx.accept.judge.criteria import CriterionResult
from pdx.accept.judge.gates import (
    engine_silent_fallback,
    held_objects,
    idle_burst,
    overdue,
    silent_fallback,
    stranded,
)
from pdx.accept.judge.repeat import summarize_runs
from pdx.accept.report import Report

ROOT = Path(__file__).resolve().parents[2]


def _ts(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"


def test_stranded_kv_from_audit_and_request_records() -> None:
    t = 1_800_000_000.0
    audit = [
        {"ts": _ts(t), "event": "put", "kv_id": "a", "bytes": 1000, "outcome": "ok"},
        {"ts": _ts(t + 0.02), "event": "release", "kv_id": "a", "outcome": "deleted"},
        {"ts": _ts(t), "event": "put", "kv_id": "b", "bytes": 2000, "outcome": "ok"},
        {"ts": _ts(t + 1.0), "event": "put", "kv_id": "c", "bytes": 500, "outcome": "ok"},
        {"ts": _ts(t + 3.0), "event": "expire", "kv_id": "c", "outcome": "deleted"},
    ]
    decode = [{"ts": _ts(t + 0.1), "event": "request", "kv_id": "b"}]
    rows = [{"t_intended_s": t - 0.01, "elapsed_ms": 60.0, "pdx": {"kv_id": "a"}}]
    objs = held_objects(audit, decode, rows)
    assert objs["a"].end_from == "client" and objs["b"].end_from == "decode"
    assert objs["c"].end_from == "created"  # no request record names it: never reached decode
    got = stranded(list(objs.values()), bound_s=0.5, observed_s=t + 5.0)
    # a: released before its request ended (0); b: still held 4.9 s after decode's end;
    # c: held 2 s from its creation until it expired.
    assert got["kv_stranded_max_s"] == pytest.approx(4.9, abs=2e-3)
    assert got["kv_stranded_over_bound"] == 2 and got["kv_stranded_still_held"] == 1
    assert got["kv_stranded_byte_s"] == pytest.approx(2000 * 4.9 + 500 * 2.0, rel=1e-3)
    assert got["kv_stranded_worst"]["kv_id"] == "b"


def test_silent_fallback_reads_decode_figures_not_the_label() -> None:
    def row(kv_bytes: int, local_ms: float, route: str = "disaggregated") -> dict[str, Any]:
        pdx = {"route": route, "kv_bytes": kv_bytes, "timings_ms": {"local_prefill": local_ms}}
        return {"ok": True, "output_tokens": 8, "pdx": pdx}

    rows = [row(2800, 0.0), row(0, 4.2), row(2800, 3.0), row(0, 5.0, "local")]
    assert silent_fallback(rows) == {"labelled_disaggregated": 3, "silent_fallback": 2}
    assert silent_fallback([{"ok": True, "output_tokens": 8}]) is None  # not a pdx target


def test_overdue_counts_late_and_never_answered_requests() -> None:
    rows = [
        {"elapsed_ms": 100.0},
        {"elapsed_ms": 2500.0, "ok": False},  # answered, but past 2 s + 2 × 0.1 s
        {"elapsed_ms": 3000.0, "unfinished": True},  # still waiting past the limit
        {"elapsed_ms": 500.0, "unfinished": True},  # cut off before its deadline: not judged
    ]
    got = overdue(rows, deadline_s=2.0, rtt_s=0.1)
    assert (got["overdue"], got["overdue_judged"]) == (2, 3)
    assert got["overdue_limit_s"] == pytest.approx(2.2)


def test_idle_burst_against_the_steady_rest() -> None:
    rows = [{"ok": True, "t_intended_s": 100.0 + i * 0.1, "ttft_ms": 300.0 if i < 5 else 10.0}
            for i in range(60)]  # fmt: skip
    got = idle_burst(rows, 100.0, burst_s=1.0)
    assert got is not None
    assert got["burst_requests"] == 10 and got["steady_requests"] == 40
    assert got["idle_ttft_ratio"] == pytest.approx(got["burst_ttft_p99_ms"] / 10.0)
    # a load generator that sent its first request 3 s late: the burst starts there
    late = [{**r, "t_intended_s": r["t_intended_s"] + 3.0} for r in rows]
    assert idle_burst(late, 100.0, burst_s=1.0) == got


def _report(values: list[tuple[float, tuple[float, float]]]) -> list[Report]:
    out = []
    for measured, interval in values:
        c = CriterionResult(
            name="ttft_p99_ms", step="s00-x", measured=measured, threshold=100, margin=0,
            passed=True, unit="ms", result="pass", confidence=0.95, interval=interval,
        )  # fmt: skip
        out.append(Report(name="r", verdict="GO", valid=True, complete=True, exit_code=0,
                          started_at="", finished_at="", target={}, criteria=[c], validity=[],
                          what_to_change=[], steps=[], formulas={}, playbook={},
                          environment={}))  # fmt: skip
    return out


def test_repeat_flags_runs_that_disagree_beyond_their_intervals() -> None:
    steady = summarize_runs(_report([(50, (45, 55)), (52, (47, 58))]), [Path("a"), Path("b")], 0.95)
    (row,) = steady.rows
    assert not row.unstable and steady.verdict == "GO" and row.mean == 51
    assert row.cv == pytest.approx(1.41421 / 51, rel=1e-4)
    assert row.mean_interval is not None and row.mean_interval[0] < 51 < row.mean_interval[1]
    split = summarize_runs(_report([(50, (45, 55)), (90, (80, 99))]), [Path("a"), Path("b")], 0.95)
    assert split.rows[0].unstable and split.unstable_steps == ["s00-x"]
    assert split.verdict == "INCONCLUSIVE" and split.exit_code == 3


# --- provoked for real -------------------------------------------------------------------


def _playbook(tmp_path: Path, name: str, deploy_set: list[str], **extra: Any) -> Path:
    doc = {
        "name": name,
        "target": {
            "deploy": "default",
            "deploy_set": [
                "router.local_prefill_max_tokens=8",
                "router.degrade_p99_ms=1000",
                *deploy_set,
            ],
            "extra_body": {"ignore_eos": True, "return_token_ids": True},
        },
        "matrix": {
            "input_tokens": [48],
            "output_tokens": [8],
            "concurrency": [3],
            "duration_s": 8,
            "network": extra.pop("network", ["normal"]),
        },
        "criteria": {
            "ttft_p99_ms": None,
            "transfer_success_min": None,
            "retry_rate_max": None,
            "degrade_rate_max": None,
        },
        "validity": {"min_requests": 5, "min_duration_s": 3, "min_load_fraction": 0.2},
        "load": {"warmup_requests": 1},
        **extra,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _accept(playbook: Path, out: Path, during: Callable[[Path], None] | None = None) -> dict:
    """``pdx accept`` as a subprocess; ``during(report_dir)`` runs alongside it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "from pdx.cli.main import main; main()", "accept", str(playbook),
         "--out", str(out), "--no-progress", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    helper = None
    if during is not None:
        helper = threading.Thread(target=during, args=(out,), daemon=True)
        helper.start()
    try:
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    if helper is not None:
        helper.join(timeout=30)
    assert proc.returncode in (0, 1, 3), stderr.decode()[-3000:]
    data: dict = json.loads(stdout)
    Report.model_validate(data)
    return data


def _wait_for(check: Callable[[], Any], timeout_s: float = 120.0) -> Any:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        got = check()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError("timed out waiting for the run to reach a step")


def _step_running(out: Path, step_prefix: str) -> Path:
    """The report directory, once the step's load generator has written its first record."""

    def found() -> Path | None:
        for f in out.glob(f"*/raw/{step_prefix}-*/requests-*.jsonl"):
            if f.stat().st_size > 0:
                return f.parents[2]
        return None

    path: Path = _wait_for(found)
    return path


def _criterion(data: dict, name: str, step_prefix: str) -> dict:
    return next(c for c in data["criteria"] if c["name"] == name and
                c["step"].startswith(step_prefix))  # fmt: skip


@pytest.mark.slow
@pytest.mark.alone
def test_lossy_codec_and_quiet_recompute_fail_their_gates(tmp_path: Path) -> None:
    """int4 KV changes greedy tokens; decode recomputing quietly while objects are evicted."""
    pb = _playbook(
        tmp_path,
        "gates-output",
        ["kv.codec=int4", "decode.kv_load_failure_policy=recompute", "kv.store_budget_bytes=6000"],
        conditions={"normal": {"idle_s": 2}},  # and a first burst after 2 s of idle
    )
    data = _accept(pb, tmp_path / "out")
    assert data["verdict"] == "NO-GO" and data["exit_code"] == 1
    mismatch = _criterion(data, "output_mismatch_max", "s00")
    assert mismatch["result"] == "fail" and mismatch["measured"] > 0
    summary = data["steps"][0]["summary"]
    example = summary["replay_mismatch_examples"][0]
    assert example["disaggregated"] != example["local"]  # the very token ids, side by side
    fallback = _criterion(data, "silent_fallback_max", "s00")
    assert fallback["result"] == "fail" and fallback["interval"][0] > 0.01
    # The label hid it: those requests say disaggregated and not degraded; decode's own
    # figures (no KV bytes, a local prefill) and its per-request records say otherwise.
    assert summary["silent_fallback"] > 0 and summary["degraded"] < summary["silent_fallback"]
    audit_dir = next((tmp_path / "out").glob("*/raw/kv-audit"))
    decode = [json.loads(x) for x in (audit_dir / "decode-0-requests.jsonl").read_text().split()]
    quiet = [d for d in decode if d.get("route") == "disaggregated" and d["local_prefill"]]
    assert quiet and all(d["prompt_tokens_from_kv"] == 0 and not d["degraded"] for d in quiet)
    # The idle-gap burst is judged against the same step's steady TTFT p99.
    idle = _criterion(data, "idle_ttft_ratio_max", "s00")
    assert summary["burst_requests"] > 0 and summary["steady_requests"] > 0
    assert idle["measured"] == pytest.approx(
        summary["burst_ttft_p99_ms"] / summary["steady_ttft_p99_ms"]
    )
    # The burst (a second of requests) is far below the 299 that bound a p99 from above: the
    # gate can fail on its lower bound but never pass on it.
    assert idle["interval"][1] is None and idle["method"].startswith("burst p99")
    assert idle["result"] in ("fail", "indeterminate")
    md = next((tmp_path / "out").glob("*/report.md")).read_text()
    assert "## Gates: what the servers' own records show" in md and "after 2 s idle" in md


@pytest.mark.slow
@pytest.mark.alone
def test_killed_decode_strands_kv_and_a_silent_transfer_is_overdue(tmp_path: Path) -> None:
    """s00: the KV link blackholed while decode's transfer deadline (20 s) outlasts the
    request's (2 s); s01: decode killed mid-step, the objects it fetched wait for their TTL.
    s01's link is 100 ms slow so that most of each request's time is a Get in flight: a kill
    at any moment then leaves objects the store serves to a decode that will never release
    them (on a fast link the Get-to-Release window is a few ms and a kill can miss it)."""
    pb = _playbook(
        tmp_path,
        "gates-hold",
        ["kv.via_proxy=true", "kv.kv_transfer_timeout_ms=20000"],
        network=["blackhole", "slow"],
        conditions={"blackhole": {}, "slow": {"delay_ms": 100}},
        judgement={"request_deadline_s": 2, "replay_requests": 0},
    )
    # With a 20 s transfer deadline the automatic stranded bound would be 20 s: state 1 s.
    doc = yaml.safe_load(pb.read_text())
    doc["criteria"]["kv_stranded_max_s"] = 1
    pb.write_text(yaml.safe_dump(doc))

    def break_things(out: Path) -> None:
        from pdx.faults.client import ControlClient

        report_dir = _step_running(out, "s00")
        endpoints = json.loads((report_dir / "raw" / "deploy-endpoints.json").read_text())
        time.sleep(1.5)
        proxy = endpoints["proxies"][0]
        ControlClient(proxy["control"], token=proxy["control_token"]).link_down(None, "blackhole")
        _step_running(out, "s01")  # the run brings the link up again between steps
        time.sleep(2.0)
        os.kill(int(endpoints["decode"][0]["pid"]), signal.SIGKILL)  # between Get and Release

    data = _accept(pb, tmp_path / "out", break_things)
    assert data["verdict"] == "NO-GO"
    late = _criterion(data, "overdue_requests_max", "s00")
    blackholed = data["steps"][0]["summary"]
    assert late["result"] == "fail" and blackholed["overdue"] > 0
    # The requests that waited were still waiting when the step ended: the run waited for
    # them up to their deadline + 2 x RTT, then recorded them, overdue, not lost.
    assert blackholed["unfinished"] > 0 and blackholed["drain_s"] >= 2.0
    assert blackholed["overdue"] >= blackholed["unfinished"]
    held = _criterion(data, "kv_stranded_max_s", "s01")
    assert held["result"] == "fail" and held["measured"] > 1
    s01 = data["steps"][1]
    assert s01["kv_stranded_byte_s"] > 0 and s01["summary"]["kv_stranded_still_held"] > 0
    assert s01["summary"]["kv_stranded_worst"]["deleted_by"] == "still held"


def test_the_vllm_silent_fallback_gate_reads_decode_failure_records(tmp_path: Path) -> None:
    def row(rid: str, route: str = "disaggregated") -> dict[str, Any]:
        return {"ok": True, "output_tokens": 8,
                "pdx": {"engine": "vllm", "route": route, "decode_request_id": rid}}  # fmt: skip

    rows = [row("cmpl-a-0-d"), row("cmpl-b-0-d"), row("cmpl-c-0-d", "local")]
    assert "kv.audit_dir is unset" in str(engine_silent_fallback(rows, []))
    assert "no KV-load failure record" in str(engine_silent_fallback(rows, [tmp_path]))
    records = tmp_path / "decode-0.kv-load-failures.jsonl"
    records.write_text('{"hook": "kv_load_failures"}\n')
    assert engine_silent_fallback(rows, [tmp_path]) == {
        "labelled_disaggregated": 2, "silent_fallback": 0}  # fmt: skip
    # vLLM's own id wraps the gateway's; a local request in the records is not a silent one.
    records.write_text('{"hook": "kv_load_failures"}\n{"request_id": "cmpl-cmpl-b-0-d-9f"}\n'
                       '{"request_id": "cmpl-cmpl-c-0-d"}\nnot json\n')  # fmt: skip
    assert engine_silent_fallback(rows, [tmp_path]) == {
        "labelled_disaggregated": 2, "silent_fallback": 1}  # fmt: skip
    rows.append({"ok": True, "output_tokens": 8, "pdx": {"route": "disaggregated"}})
    assert "do not name decode's request ids" in str(engine_silent_fallback(rows, [tmp_path]))


def test_a_namespace_run_says_what_protects_the_traffic_between_its_sites(tmp_path: Path) -> None:
    from pdx.accept.playbook import Target
    from pdx.accept.report.content import headline, target_line
    from pdx.accept.target.deploy import TLS_ACROSS, _across_sites

    def across(*sets: str) -> str:
        return _across_sites(Target(deploy="default", deploy_set=list(sets)), tmp_path)

    assert across() == TLS_ACROSS == "mutual TLS 1.3"
    assert across("tls.enabled=false") == "plaintext (the deploy's tls.enabled: false)"
    assert across("engine=vllm").startswith("plaintext (engine: vllm:")
    (report,) = _report([(50, (45, 55))])
    report.target = {"kind": "deploy", "url": "http://10.77.3.2:1", "netns": {
        "prefill": "p", "decode": "d", "across_sites": across("tls.enabled=false")}}  # fmt: skip
    assert headline(report).endswith("; PLAINTEXT across sites")
    assert "across sites: plaintext (the deploy's tls.enabled: false)" in target_line(report)
    report.target["netns"]["across_sites"] = TLS_ACROSS
    assert "PLAINTEXT" not in headline(report)
    assert target_line(report).endswith("across sites: mutual TLS 1.3")
    # a run with no capture (no target.netns) says why the gate has no sample, and only there
    from pdx.accept.judge.criteria import not_measured_note

    assert "needs target.netns" in not_measured_note("plaintext_on_link_max", {})
