"""Locust's own CLI against ``pdx deploy`` (the embedded default), as the README runs it.

The suite runs two consecutive 10 s runs of ``-u 8 -r 4`` (the full acceptance, five
consecutive 30 s runs, is ``benchmarks/bench_locust_gateway.py``) and one run where every
request's first token is EOS. Each must exit 0, and the CSV's final rows must equal the
console's final summary.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_runs import run_locust

pytestmark = [pytest.mark.slow, pytest.mark.alone]


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    """``pdx deploy --port 0 --json`` (embedded default) as a child process; its URL."""
    cmd = [sys.executable, "-c", "from pdx.cli.main import main; main()", "deploy",
           "--port", "0", "--json"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        deadline, text = time.monotonic() + 120, ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, f"pdx deploy exited early with {proc.poll()}"
            text += line
            try:
                yield json.loads(text)["gateway"]
                break
            except json.JSONDecodeError:
                continue
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def test_consecutive_runs_exit_0_and_csv_matches_console(gateway: str, tmp_path: Path) -> None:
    for i in range(2):
        run = run_locust(gateway, tmp_path / f"run{i}", run_time_s=10)
        assert run.returncode == 0, run.tail
        assert run.console == run.csv, (run.console, run.csv)
        reqs, fails = run.csv["e2e"]
        assert reqs > 10 and fails == 0 and "failed" not in run.csv


def test_a_first_token_that_is_eos_is_a_success(gateway: str, tmp_path: Path) -> None:
    body = {"logit_bias": {"1": 100}, "ignore_eos": False}  # id 1 is the tiny model's EOS
    run = run_locust(gateway, tmp_path / "eos", run_time_s=4, extra_body=body,
                     extra=["--pdx-records", str(tmp_path)])  # fmt: skip
    assert run.returncode == 0, run.tail
    assert run.console == run.csv and "failed" not in run.csv
    recs = [json.loads(x) for f in tmp_path.glob("requests-*.jsonl")
            for x in f.read_text().splitlines()]  # fmt: skip
    done = [r for r in recs if not r.get("unfinished")]  # not the ones the run's end cut off
    assert done and all(r["ok"] and r["content_events"] == 0 and r["ttft_ms"] for r in done)
    assert {r["output_tokens"] for r in done} == {1}


def test_the_default_routes_a_200_token_prompt_through_the_kv_transfer(gateway: str) -> None:
    """The local-prefill threshold is measure-kv's break-even, not the context size."""

    def route(prompt: list[int]) -> str:
        body = json.dumps({"prompt": prompt, "max_tokens": 2}).encode()
        req = urllib.request.Request(gateway + "/v1/completions", data=body)
        with urllib.request.urlopen(req, timeout=60) as resp:  # loopback only
            return str(json.loads(resp.read())["pdx"]["route"])

    assert route([40] * 200) == "disaggregated"
    assert route([40] * 5) == "local"
