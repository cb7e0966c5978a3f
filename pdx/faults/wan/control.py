"""Starting, asking and stopping the userspace emulator of one topology, from outside it.

Everything about a running emulator lives in its state directory
(``/run/pdx/netns/<prefix>/``): ``conditions.json`` (what it applies, re-read on restart),
``supervisor.json`` (state, restarts, exits), ``emulator.sock`` (the control socket),
``emulator.log``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pdx.errors import PdxError
from pdx.faults.wan.conditions import WanConditions
from pdx.procs import is_zombie

STATE_ROOT = Path("/run/pdx/netns")
READY_TIMEOUT_S = 10.0
TABLES = {"down": 101, "up": 102}  # the router's policy-routing table per direction
DEVICES = {"down": "wan-down", "up": "wan-up"}  # the emulator's TUN device per direction


class EmulatorError(PdxError):
    """The userspace emulator could not be started, reached or stopped."""


def state_dir(prefix: str) -> Path:
    """Where one topology's emulator keeps its state."""
    return STATE_ROOT / prefix


def request(sdir: Path, op: str, timeout_s: float = 5.0, **fields: Any) -> dict[str, Any]:
    """One JSON request on the control socket; raises EmulatorError when nobody answers."""
    path = sdir / "emulator.sock"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(str(path))
            s.sendall((json.dumps({"op": op, **fields}) + "\n").encode())
            line = s.makefile("r").readline()
    except OSError as exc:
        raise EmulatorError(f"emulator at {path} does not answer: {exc}") from None
    try:
        reply: dict[str, Any] = json.loads(line)
    except json.JSONDecodeError:
        raise EmulatorError(f"emulator at {path} answered {line[:80]!r}") from None
    if not reply.get("ok"):
        raise EmulatorError(f"emulator refused {op}: {reply.get('error')}")
    return reply


def supervisor_state(sdir: Path) -> dict[str, Any] | None:
    """The supervisor's own record, with ``alive`` from its process; None if never started."""
    path = sdir / "supervisor.json"
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    data["alive"] = _alive(int(data.get("pid") or 0))
    return data


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not is_zombie(pid)  # exited, not yet reaped by this process: not alive


def log_tail(sdir: Path, lines: int = 5) -> str:
    """The last lines of the emulator's log (for error messages)."""
    try:
        text = (sdir / "emulator.log").read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])


def write_conditions(sdir: Path, cond: WanConditions) -> None:
    """What the emulator applies (and re-reads when restarted)."""
    sdir.mkdir(parents=True, exist_ok=True)
    tmp = sdir / "conditions.tmp"
    tmp.write_text(json.dumps(cond.model_dump(mode="json")))
    tmp.replace(sdir / "conditions.json")


def running(sdir: Path) -> bool:
    """Whether an emulator answers on the control socket."""
    try:
        request(sdir, "status", timeout_s=2.0)
    except EmulatorError:
        return False
    return True


def start(router_ns: str, sdir: Path, cond: WanConditions) -> dict[str, Any]:
    """Start the supervisor (and so the emulator) in ``router_ns``; wait until it answers."""
    write_conditions(sdir, cond)
    for name in ("supervisor.json", "emulator.sock"):
        with contextlib.suppress(FileNotFoundError):
            (sdir / name).unlink()
    out = open(sdir / "supervisor.log", "ab")  # noqa: SIM115 - handed to the detached process
    try:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", router_ns, sys.executable, "-m", "pdx.faults.wan.supervisor",
             "--state-dir", str(sdir)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
        )  # fmt: skip
    finally:
        out.close()
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            return request(sdir, "status", timeout_s=1.0)
        except EmulatorError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    raise EmulatorError(
        f"the userspace emulator did not start in {router_ns}: {log_tail(sdir) or 'no log'}"
    )


def configure(sdir: Path, cond: WanConditions) -> dict[str, Any]:
    """New conditions for a running emulator (live: connections carry on)."""
    write_conditions(sdir, cond)
    return request(sdir, "set", conditions=cond.model_dump(mode="json"))


def stop(sdir: Path, timeout_s: float = 5.0) -> bool:
    """Stop the supervisor and its emulator; True if one was running."""
    st = supervisor_state(sdir)
    if st is None or not st["alive"]:
        return False
    pid = int(st["pid"])
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    return True
