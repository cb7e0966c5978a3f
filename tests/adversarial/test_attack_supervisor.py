"""Row M4: a deployment whose decode is SIGKILLed again and again, each time after it
recovered, keeps serving; the restart budget (``max_restarts`` within ``restart_window_s``)
still stops a crash loop. A real `pdx deploy` Deployment with its child processes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest

from pdx.serving.deploy_config import load_deploy_config
from pdx.serving.supervisor import Deployment

pytestmark = pytest.mark.slow

SETS = ["gateway.port=0", "prefill.count=0", "tls.enabled=false", "supervisor.max_restarts=2",
        "supervisor.restart_window_s=5", "supervisor.backoff_initial_s=0.2",
        "router.status_poll_ms=100"]  # fmt: skip


async def recovered(dep: Deployment, old_pid: int, timeout_s: float) -> int:
    """The new decode pid once the gateway answers a completion through it again."""
    url = dep.endpoints().gateway
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            pid = dep.endpoints().decode[0].get("pid")
            if pid and pid != old_pid:
                body = {"prompt": "hi", "max_tokens": 2}
                try:
                    async with s.post(f"{url}/v1/completions", json=body) as r:
                        if r.status == 200:
                            return int(pid)
                except aiohttp.ClientError:
                    pass
            await asyncio.sleep(0.2)
    raise AssertionError("decode did not recover")


async def restarted(dep: Deployment, old_pid: int, timeout_s: float) -> int:
    """The new decode pid as soon as the supervisor started it (or the old one if it gave up)."""
    deadline = time.monotonic() + timeout_s
    decode = next(c for c in dep.children if c.name == "decode-0")
    while time.monotonic() < deadline and not dep.failed:
        proc = decode.proc
        if proc is not None and proc.pid != old_pid and proc.returncode is None:
            return int(proc.pid)
        await asyncio.sleep(0.02)
    return old_pid


async def test_m4_crashes_spaced_in_time_never_stop_the_deployment() -> None:
    dep = Deployment(load_deploy_config(dotted=SETS))
    await dep.start()
    try:
        pid = int(dep.endpoints().decode[0]["pid"])
        recoveries = []
        for _ in range(4):  # twice the budget, each crash after a recovery, 6 s apart
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            pid = await recovered(dep, pid, 60)
            recoveries.append(time.monotonic() - t0)
            assert dep.failed is None
            await asyncio.sleep(max(0.0, 6 - (time.monotonic() - t0)))
        print(
            f"M4: 4 crashes 6 s apart (budget 2 in 5 s): still serving; recovery "
            f"{', '.join(f'{r:.1f}' for r in recoveries)} s"
        )
        # A crash loop (each new process killed as soon as it exists) still spends the
        # budget and stops the deployment loudly.
        for _ in range(3):
            os.kill(pid, signal.SIGKILL)
            pid = await restarted(dep, pid, 30)
            if dep.failed:
                break
        why = await asyncio.wait_for(dep.wait(), 30)
        assert "restart budget spent (2 in 5 s)" in why
    finally:
        await dep.stop()
