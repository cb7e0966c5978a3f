"""Faults on the engines themselves: a prefill instance killed in the middle of a step.

``kill_prefill_at_s`` sends SIGKILL to prefill instance ``kill_prefill_index`` (its whole
process group: with ``engine: vllm`` the API server, engine core and worker die together, as
in a crash) at that time into the step. The deploy's supervisor restarts it on the same
ports; the gateway meanwhile sends requests to decode alone (degraded, counted). The
instance is found among the deploy's own children by its HTTP port (from the endpoints
``pdx deploy --json`` printed), so a restarted instance is found again in a later step.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from pdx.procs import children


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def find_instance(deploy_pid: int, port: int, index: int = 0) -> int | None:
    """The deploy's child serving on ``port`` (its ``--port``), or pdx's own prefill ``index``."""
    kids = children(deploy_pid)  # one scan of /proc for both looks
    for pid in kids:
        argv = _cmdline(pid)
        for i, arg in enumerate(argv[:-1]):
            if arg == "--port" and argv[i + 1] == str(port):
                return pid
    for pid in kids:  # pdx's pair: `python -m pdx.serving.prefill CFG INDEX`
        argv = _cmdline(pid)
        if "pdx.serving.prefill" in argv:
            at = argv.index("pdx.serving.prefill")
            if len(argv) > at + 2 and argv[at + 2] == str(index):
                return pid
    return None


def prefill_port(endpoints_path: Path, index: int) -> tuple[str, int]:
    """(name, HTTP or gRPC port) of prefill ``index`` from the deploy's endpoints JSON."""
    data: dict[str, Any] = json.loads(endpoints_path.read_text())
    prefills = data.get("prefill") or []
    if index >= len(prefills):
        raise IndexError(f"kill_prefill_index {index}: the deploy has {len(prefills)} prefill")
    inst = prefills[index]
    return str(inst.get("name", f"prefill-{index}")), int(inst["port"])


async def kill_prefill(
    deploy_pid: int, endpoints_path: Path, index: int, at_s: float, t0: float
) -> dict[str, Any]:
    """Wait until ``t0 + at_s``, SIGKILL the prefill instance's process group; the event."""
    await asyncio.sleep(max(0.0, t0 + at_s - time.time()))
    t_s = round(time.time() - t0, 3)
    try:
        name, port = prefill_port(endpoints_path, index)
    except (OSError, ValueError, KeyError, IndexError) as exc:
        return {"t_s": t_s, "event": f"kill prefill {index}: not done ({exc})"}
    pid = find_instance(deploy_pid, port, index)
    if pid is None:
        return {"t_s": t_s, "event": f"kill {name}: no process on port {port} (not running)"}
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)  # not a group leader (pdx's own pair): the process
    return {"t_s": t_s, "event": f"{name} killed (SIGKILL, pid {pid}); the deploy restarts it",
            "instance": name, "pid": pid}  # fmt: skip
