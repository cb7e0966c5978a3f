"""Row M4: a crash loop never ends the deployment. Decode is SIGKILLed five times within a
minute (each new process as soon as it exists, before it is even ready): `pdx deploy` keeps
running, backs off, answers 503 with ``Retry-After`` while no decode is up, and serves again
once one is; a killed prefill only sends requests to local prefill. A real `pdx deploy`
command with its child processes, watched through the gateway's /readyz and /metrics.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from live_deploy import pids_with, read_endpoints

pytestmark = [pytest.mark.slow, pytest.mark.alone]

KILLS = 5
BACKOFF_MAX_S = 2.0
SETS = ["prefill.count=1", "tls.enabled=false", "supervisor.max_restarts=1",
        "supervisor.backoff_initial_s=0.2", f"supervisor.backoff_max_s={BACKOFF_MAX_S}",
        "router.status_poll_ms=100"]  # fmt: skip
ASK = {"prompt": "hi", "max_tokens": 2}


def start_deploy(log: Path) -> subprocess.Popen[str]:
    """``pdx deploy --json`` with :data:`SETS`, its log (stderr) in ``log``."""
    cmd = [sys.executable, "-c", "from pdx.cli.main import main; main()", "deploy", "--port",
           "0", "--json", *[a for s in SETS for a in ("--set", s)]]  # fmt: skip
    with log.open("w") as err:
        return subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True
        )


def child_pids(work_dir: str, role: str) -> list[int]:
    """Pids of this deployment's ``role`` processes (their command lines name both)."""
    return pids_with(work_dir, f"pdx.serving.{role}")


async def replacement(work_dir: str, role: str, old_pid: int, timeout_s: float) -> int:
    """The pid of the process the supervisor started in place of ``old_pid``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        fresh = [p for p in child_pids(work_dir, role) if p != old_pid]
        if fresh:
            return fresh[0]
        await asyncio.sleep(0.02)
    raise AssertionError(f"no new {role} process within {timeout_s} s")


async def refused_while_down(s: aiohttp.ClientSession, url: str, timeout_s: float) -> int:
    """The ``Retry-After`` of the 503 a completion gets while no decode is up."""
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        async with s.post(f"{url}/v1/completions", json=ASK) as r:
            seen.append(r.status)
            if r.status == 503:
                body = await r.json()
                assert body["error"]["code"] == "decode_unavailable", body
                return int(r.headers["Retry-After"])
        await asyncio.sleep(0.05)
    raise AssertionError(f"no 503 while decode was down: {seen}")


async def served(s: aiohttp.ClientSession, url: str, timeout_s: float) -> dict[str, Any]:
    """The first 200 completion (503s with Retry-After meanwhile)."""
    deadline = time.monotonic() + timeout_s
    statuses: set[int] = set()
    while time.monotonic() < deadline:
        async with s.post(f"{url}/v1/completions", json=ASK) as r:
            if r.status == 200:
                data: dict[str, Any] = await r.json()
                return data
            statuses.add(r.status)
            assert r.status == 503 and int(r.headers["Retry-After"]) >= 1
        await asyncio.sleep(0.2)
    raise AssertionError(f"not served again within {timeout_s} s ({sorted(statuses)})")


async def not_ready_naming(s: aiohttp.ClientSession, url: str, role: str) -> dict[str, Any]:
    """/readyz while ``role`` is down (polled until the supervisor's view shows it)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        async with s.get(f"{url}/readyz") as r:
            body: dict[str, Any] = await r.json()
            if any(d["role"] == role for d in body.get("roles_down", [])):
                return {"status": r.status, **body}
        await asyncio.sleep(0.05)
    raise AssertionError(f"/readyz never named {role} down")


async def restarts_total(s: aiohttp.ClientSession, url: str, role: str) -> float:
    async with s.get(f"{url}/metrics") as r:
        text = await r.text()
    line = re.search(rf'^pdx_restarts_total\{{instance="0",role="{role}"\}} (\S+)$', text, re.M)
    assert line, text
    return float(line.group(1))


async def test_m4_a_decode_crash_loop_backs_off_and_never_ends_the_deployment(
    tmp_path: Path,
) -> None:
    log = tmp_path / "deploy.log"
    proc = start_deploy(log)
    try:
        t_start = time.monotonic()
        ep = await asyncio.to_thread(read_endpoints, proc, 180)
        url, work_dir = ep["gateway"], ep["work_dir"]
        startup_s = time.monotonic() - t_start
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            # Prefill down: requests still served, prefilled on decode (labelled).
            os.kill(ep["prefill"][0]["pid"], signal.SIGKILL)
            async with s.post(f"{url}/v1/completions",
                              json={**ASK, "pdx_route": "disaggregated"}) as r:  # fmt: skip
                assert r.status == 200
                pdx = (await r.json())["pdx"]
            assert pdx["route"] == "local" and pdx["degrade_reason"] == "prefill_unavailable"

            # Decode in a crash loop: each replacement killed as soon as it exists.
            pid, retry_after = int(ep["decode"][0]["pid"]), []
            t_loop = time.monotonic()
            for kill in range(1, KILLS + 1):
                os.kill(pid, signal.SIGKILL)
                retry_after.append(await refused_while_down(s, url, 10))
                assert proc.poll() is None, log.read_text()[-2000:]
                if kill < KILLS:
                    pid = await replacement(work_dir, "decode", pid, 30)
            loop_s = time.monotonic() - t_loop
            assert loop_s < 60
            assert all(1 <= r <= math.ceil(BACKOFF_MAX_S) for r in retry_after), retry_after
            ready = await not_ready_naming(s, url, "decode")
            assert ready["status"] == 503 and ready["ready"] is False
            (down,) = [d for d in ready["roles_down"] if d["role"] == "decode"]
            decode = next(c for c in ready["children"] if c["name"] == "decode-0")
            assert decode["restarts"] >= KILLS - 1 and decode["last_exit_code"] == -9

            # Backed off, not given up: decode comes back and the same gateway serves.
            body = await served(s, url, 120)
            recovery_s = time.monotonic() - t_loop - loop_s
            assert body["choices"][0]["text"] is not None and proc.poll() is None
            decode_restarts = await restarts_total(s, url, "decode")
            prefill_restarts = await restarts_total(s, url, "prefill")
            assert decode_restarts >= KILLS and prefill_restarts >= 1
            async with s.get(f"{url}/readyz") as r:
                assert r.status == 200
        print(
            f"M4: started in {startup_s:.1f} s; {KILLS} decode SIGKILLs in {loop_s:.1f} s, "
            f"deploy still up; 503 Retry-After {retry_after} s; /readyz named decode down "
            f"(next_attempt_in_s {down['next_attempt_in_s']}); served again {recovery_s:.1f} s "
            f"after the last kill; pdx_restarts_total decode {decode_restarts:g}, "
            f"prefill {prefill_restarts:g}"
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = await asyncio.to_thread(proc.wait, 30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert rc == 0, log.read_text()[-2000:]
