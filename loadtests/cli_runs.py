"""Run the locustfile through Locust's own CLI and read back what it reported.

Used by ``tests/loadtests/test_locust_gateway.py`` (short runs in the suite) and
``benchmarks/bench_locust_gateway.py`` (five consecutive 30 s runs). No locust or gevent
imports here: Locust runs as a subprocess, as users run it.
"""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOADTESTS = Path(__file__).resolve().parent
LOCUSTFILE = LOADTESTS / "locustfile.py"
_ROW = re.compile(r"^(?P<type>\S+)?\s+(?P<name>\S+)\s+(?P<reqs>\d+)\s+(?P<fails>\d+)\(")


@dataclass
class LocustResult:
    """One ``locust --headless`` run: exit code, the console's final table and the CSV's."""

    returncode: int
    console: dict[str, tuple[int, int]] = field(default_factory=dict)  # name → (reqs, fails)
    csv: dict[str, tuple[int, int]] = field(default_factory=dict)
    wall_s: float = 0.0
    tail: str = ""


def console_summary(output: str) -> dict[str, tuple[int, int]]:
    """The last stats table Locust printed (the final summary): name → (requests, failures)."""
    chunks = output.split("Type     Name")[1:]
    tables = [c for c in chunks if "# fails" in c.splitlines()[0]]  # not the percentiles table
    if not tables:
        return {}
    rows: dict[str, tuple[int, int]] = {}
    for line in tables[-1].splitlines()[1:]:
        if line.startswith("Response time percentiles"):
            break
        m = _ROW.match(line)
        if m:
            rows[m["name"]] = (int(m["reqs"]), int(m["fails"]))
    return rows


def csv_summary(prefix: Path) -> dict[str, tuple[int, int]]:
    """``<prefix>_stats.csv``: name → (requests, failures)."""
    with open(f"{prefix}_stats.csv") as fh:
        return {
            row["Name"]: (int(row["Request Count"]), int(row["Failure Count"]))
            for row in csv.DictReader(fh)
        }


def run_locust(
    host: str,
    out_prefix: Path,
    *,
    users: int = 8,
    spawn_rate: int = 4,
    run_time_s: int = 30,
    extra: list[str] | None = None,
    extra_body: dict[str, Any] | None = None,
) -> LocustResult:
    """``locust -f loadtests/locustfile.py --headless -u U -r R -t Ns --csv PREFIX``."""
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
           "-u", str(users), "-r", str(spawn_rate), "-t", f"{run_time_s}s", "--host", host,
           "--csv", str(out_prefix), "--only-summary", *(extra or [])]  # fmt: skip
    if extra_body:
        cmd += ["--pdx-extra-body", json.dumps(extra_body)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=run_time_s + 120,
                          cwd=LOADTESTS.parent)  # fmt: skip
    output = proc.stdout + proc.stderr
    return LocustResult(
        returncode=proc.returncode,
        console=console_summary(output),
        csv=csv_summary(out_prefix),
        wall_s=time.monotonic() - t0,
        tail=output[-3000:],
    )
