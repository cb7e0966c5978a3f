"""The locustfile as users run it: a real Locust subprocess against a real streaming server."""

from __future__ import annotations

import csv
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from pdx.netaddr import listen_port

ROOT = Path(__file__).resolve().parents[2]
LOCUSTFILE = ROOT / "loadtests" / "locustfile.py"


def _locust(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--only-summary", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)


def _records(directory: Path) -> list[dict]:
    rows = []
    for f in directory.glob("requests-*.jsonl"):
        rows += [json.loads(line) for line in f.read_text().splitlines()]
    return rows


def _stats(prefix: Path) -> dict[str, dict[str, str]]:
    with open(f"{prefix}_stats.csv") as fh:
        return {row["Name"]: row for row in csv.DictReader(fh)}


def test_closed_loop_headless_csv(sse_server, tmp_path: Path) -> None:
    out = _locust(
        "--headless",
        "-u",
        "3",
        "-r",
        "3",
        "--run-time",
        "4s",
        "--host",
        sse_server.url,
        "--csv",
        str(tmp_path / "step"),
        "--pdx-records",
        str(tmp_path),
        "--pdx-input-len",
        "8:32",
        "--pdx-output-len",
        "5",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    stats = _stats(tmp_path / "step")
    assert {"ttft", "tpot", "itl", "e2e"} <= set(stats)
    everything = _records(tmp_path)
    # A request still waiting when the run time ends is recorded as unfinished (one per user at
    # most), with how long it had waited: a hang must not vanish from the records.
    cut = [r for r in everything if r["unfinished"]]
    assert len(cut) <= 3 and all(not r["ok"] and r["elapsed_ms"] > 0 for r in cut)
    recs = [r for r in everything if not r["unfinished"]]
    assert recs and all(r["ok"] for r in recs)
    # Every request the server answered is recorded, except those of users stopped by the
    # run-time limit between the server's last write and the client's record (at most one each).
    assert sse_server.stats.completed - 3 <= len(recs) <= sse_server.stats.completed
    assert int(stats["e2e"]["Request Count"]) <= len(recs)
    for r in recs:
        assert r["output_tokens"] == 5 and r["usage_source"] == "server"
        assert 8 <= r["input_len"] <= 32 and r["prompt_tokens"] == r["input_len"]
        assert r["tpot_ms"] == pytest.approx((r["e2e_ms"] - r["ttft_ms"]) / 4)
        assert len(r["itl_ms"]) == 4
    assert {r["mode"] for r in recs} == {"closed"}


def test_client_aborts_after_the_first_token_and_keeps_sample_prompts(
    sse_server, tmp_path: Path
) -> None:
    sse_server.cfg.token_gap_s = 0.02  # the server is still streaming when the client leaves
    out = _locust(
        "--headless", "-u", "2", "-r", "2", "--run-time", "3s", "--host", sse_server.url,
        "--pdx-records", str(tmp_path), "--pdx-output-len", "6", "--pdx-input-len", "4",
        "--pdx-abort-fraction", "0.5", "--pdx-keep-prompts", "2",
        "--pdx-extra-body", '{"return_token_ids": true}',
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    recs = [r for r in _records(tmp_path) if not r["unfinished"]]
    aborted = [r for r in recs if r["aborted"]]
    assert aborted and len(aborted) < len(recs)
    for r in aborted:  # cut after the first token: a TTFT, neither ok nor failed
        assert not r["ok"] and r["error"] is None and r["ttft_ms"] is not None
        assert r["elapsed_ms"] >= r["ttft_ms"] and r["e2e_ms"] is None
    assert sse_server.stats.aborted >= len(aborted) - 2  # the server saw them leave
    # Prompts are kept for the first requests of each user, then a thinning sample.
    kept = [r for r in recs if r["prompt_ids"]]
    assert 4 <= len(kept) < len(recs) and all(len(r["prompt_ids"]) == 4 for r in kept)
    assert all(r["response_id"] is None or isinstance(r["response_id"], str) for r in recs)


def test_open_loop_poisson_from_intended_time(sse_server, tmp_path: Path) -> None:
    sse_server.cfg.first_token_delay_s = 0.05  # each request holds its slot >= 50 ms
    out = _locust(
        "--headless",
        "-u",
        "2",
        "-r",
        "2",
        "--run-time",
        "4s",
        "--host",
        sse_server.url,
        "--pdx-records",
        str(tmp_path),
        "--pdx-mode",
        "open",
        "--pdx-rate",
        "40",
        "--pdx-max-inflight",
        "1",
        "--pdx-output-len",
        "3",
        "--pdx-input-len",
        "4",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    recs = [r for r in _records(tmp_path) if not r["unfinished"]]
    assert {r["mode"] for r in recs} == {"open"}
    starts = sorted(r["t_intended_s"] for r in recs)
    # Two users with one slot each serve at most ~2/0.06 s ≈ 33 req/s < 40 offered: the client
    # queues, and that wait is inside TTFT (intended send time), not hidden.
    queued = [r for r in recs if r["queue_ms"] > 5]
    assert queued, "an overloaded open loop must show client-side queueing"
    assert all(r["ttft_ms"] >= r["queue_ms"] for r in queued)
    gaps = sorted(b - a for a, b in itertools.pairwise(starts))
    assert len(gaps) > 60
    # Poisson arrivals: exponential gaps, of which 1 - 2**-0.5 = 29.3 % are shorter than half
    # their median (evenly spaced ones: none). Judged on the median, not on the coefficient of
    # variation: one long gap (seen once: 2.09) moves the mean and the spread, not the median.
    # About 140 gaps: 0.15-0.45 is more than 3 standard deviations either side.
    median = gaps[len(gaps) // 2]
    short = sum(g < median / 2 for g in gaps) / len(gaps)
    assert 0.15 < short < 0.45, (short, len(gaps), [round(g * 1e3) for g in gaps[-5:]])


@pytest.mark.slow
def test_master_with_two_workers(sse_server, tmp_path: Path) -> None:
    port = listen_port()
    master = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "locust",
            "-f",
            str(LOCUSTFILE),
            "--master",
            "--headless",
            "--master-bind-host",
            "127.0.0.1",
            "--master-bind-port",
            str(port),
            "--expect-workers",
            "2",
            "-u",
            "4",
            "-r",
            "4",
            "--run-time",
            "4s",
            "--host",
            sse_server.url,
            "--csv",
            str(tmp_path / "dist"),
            "--pdx-records",
            str(tmp_path),
            "--pdx-output-len",
            "4",
            "--only-summary",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    workers: list[subprocess.Popen[str]] = []
    try:
        for _ in range(2):
            workers.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "locust",
                        "-f",
                        str(LOCUSTFILE),
                        "--worker",
                        "--master-host",
                        "127.0.0.1",
                        "--master-port",
                        str(port),
                    ],
                    cwd=ROOT,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        assert master.wait(90) == 0
    finally:
        for p in [*workers, master]:
            if p.poll() is None:
                p.kill()
            p.wait(10)
    recs = _records(tmp_path)
    assert len({r["worker_pid"] for r in recs}) == 2  # both workers sent load
    # A request still waiting when the run time ends is recorded as unfinished, never as a failure.
    stopped = [r for r in recs if r["unfinished"]]
    assert all(not r["ok"] and r["error"].startswith("unfinished") for r in stopped)
    assert all(r["ok"] and r["output_tokens"] == 4 for r in recs if not r["unfinished"])
    assert int(_stats(tmp_path / "dist")["e2e"]["Request Count"]) > 0


@pytest.mark.slow
def test_a_trace_is_replayed_at_its_own_times_with_its_reuse(sse_server, tmp_path: Path) -> None:
    """Arrival fidelity: each request leaves at its scaled trace time (the send lag bounded),
    carries its line, session and ideal cached prefix, and shares the blocks its ids share."""
    from pdx.traces.formats import read_trace
    from pdx.traces.synth import Conversations, make_trace, write_trace

    shape = Conversations(sessions=12, turns=3, system_blocks=1, turn_blocks=1, rate=3.0,
                          think_s=1.0, output_tokens=8)  # fmt: skip
    trace_path = tmp_path / "chat.jsonl"
    write_trace(make_trace(shape), trace_path)
    trace = read_trace(trace_path)
    scale = 0.5
    out = _locust(
        "--headless", "-u", "1", "-r", "1",
        "--run-time", f"{math.ceil(trace.duration_s * scale) + 3}s",
        "--host", sse_server.url, "--pdx-records", str(tmp_path / "rec"),
        "--pdx-mode", "trace", "--pdx-trace", str(trace_path), "--pdx-length-scale", "0.03125",
        "--pdx-time-scale", str(scale), "--pdx-keep-prompts", "100",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    recs = sorted(_records(tmp_path / "rec"), key=lambda r: r["trace_line"])
    assert len(recs) == len(trace.requests) and all(r["ok"] for r in recs)
    by_line = {r.line: r for r in trace.requests}
    t0 = min(r["t_intended_s"] for r in recs)
    first = trace.requests[0].arrival_s
    for r in recs:
        req = by_line[r["trace_line"]]
        # the intended send time is the trace's, scaled, from the replay's start
        assert r["t_intended_s"] - t0 == pytest.approx((req.arrival_s - first) * scale, abs=0.01)
        assert r["input_len"] == req.input_tokens // 32 and r["mode"] == "trace"
        assert r["session"] == f"s{int(r['session'][1:])}"
    lags = sorted(r["queue_ms"] for r in recs)
    assert lags[len(lags) // 2] < 20 and lags[int(0.99 * (len(lags) - 1))] < 100, lags
    ideal = sum(r["ideal_cached_tokens"] for r in recs) / sum(r["input_len"] for r in recs)
    from pdx.traces.synth import known_ideal_hit_ratio

    assert ideal == pytest.approx(known_ideal_hit_ratio(shape))
    # a session's later turn starts with its earlier turn's tokens (kept prompts)
    kept = {r["trace_line"]: r["prompt_ids"] for r in recs if r["prompt_ids"]}
    turns: dict[str, list[dict]] = {}
    for r in recs:
        turns.setdefault(r["session"], []).append(r)
    pairs = [(a, b) for ts in turns.values() for a, b in itertools.pairwise(ts)
             if a["trace_line"] in kept and b["trace_line"] in kept]  # fmt: skip
    assert pairs
    for a, b in pairs:
        assert kept[b["trace_line"]][: a["input_len"]] == kept[a["trace_line"]]
