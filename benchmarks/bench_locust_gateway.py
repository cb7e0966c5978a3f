"""Locust's CLI against ``pdx deploy``: N consecutive runs must all exit 0 (default 5 × 30 s).

    python benchmarks/bench_locust_gateway.py [--runs 5] [--run-time-s 30] [--json]

Starts the embedded default deployment, runs
``locust -f loadtests/locustfile.py --headless -u 8 -r 4 -t 30s --csv ...`` back to back,
and prints each run's exit code, requests, failures and whether the CSV's final rows equal
the console's final summary. Exit code 0 only when every run passed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "loadtests"))

from cli_runs import run_locust  # noqa: E402


def start_deploy() -> tuple[subprocess.Popen[str], str]:
    """``pdx deploy --port 0 --json``; the process and its gateway URL."""
    cmd = [sys.executable, "-c", "from pdx.cli.main import main; main()", "deploy",
           "--port", "0", "--json"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)  # fmt: skip
    assert proc.stdout is not None
    text, deadline = "", time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"pdx deploy exited early with {proc.poll()}")
        text += line
        try:
            return proc, str(json.loads(text)["gateway"])
        except json.JSONDecodeError:
            continue
    raise SystemExit("pdx deploy not ready in 120 s")


def main() -> int:
    """Run the consecutive Locust runs and report them."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--run-time-s", type=int, default=30)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    proc, url = start_deploy()
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.runs):
                run = run_locust(url, Path(tmp) / f"run{i}", run_time_s=args.run_time_s)
                reqs, fails = run.csv.get("e2e", (0, 0))
                row = {"run": i + 1, "exit_code": run.returncode, "requests": reqs,
                       "failures": run.csv.get("failed", (0, 0))[0] + fails,
                       "csv_matches_console": run.csv == run.console,
                       "wall_s": round(run.wall_s, 1)}  # fmt: skip
                rows.append(row)
                if not args.json:
                    print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    ok = all(r["exit_code"] == 0 and r["csv_matches_console"] for r in rows)
    if args.json:
        print(json.dumps({"runs": rows, "all_passed": ok}))
    else:
        print(
            f"{sum(r['exit_code'] == 0 for r in rows)}/{len(rows)} runs exited 0; "
            f"CSV = console in {sum(r['csv_matches_console'] for r in rows)}/{len(rows)}"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
