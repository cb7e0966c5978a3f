"""Keeps the userspace emulator running: restarts it when it dies, within a budget.

``python -m pdx.faults.wan.supervisor --state-dir DIR`` runs in the router namespace, started
(detached) by ``pdx faults netns up``. It starts ``pdx.faults.wan.emulator`` as its child and
restarts it with backoff when it exits without being asked to, at most ``RESTART_BUDGET``
times per ``RESTART_WINDOW_S``; past that it gives up and says so in ``supervisor.json``. While
no emulator runs, the router's policy routes end in a blackhole, so traffic is dropped rather
than silently forwarded undelayed. SIGTERM stops the child and then the supervisor.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESTART_BUDGET = 5
RESTART_WINDOW_S = 600.0


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def supervise(state_dir: Path) -> int:
    """Run the emulator until told to stop; the exit code says whether it gave up (1)."""
    stopping = False
    child: subprocess.Popen[bytes] | None = None

    def on_term(*_: Any) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.terminate()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    state: dict[str, Any] = {"pid": os.getpid(), "state": "starting", "restarts": 0,
                             "exits": []}  # fmt: skip
    crashes: list[float] = []
    log = open(state_dir / "emulator.log", "ab")  # noqa: SIM115 - the child writes to it for life
    while not stopping:
        child = subprocess.Popen(
            [sys.executable, "-m", "pdx.faults.wan.emulator", "--state-dir", str(state_dir)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
        )  # fmt: skip
        state.update(state="running", emulator_pid=child.pid, started_at=time.time())
        _write(state_dir / "supervisor.json", state)
        code = child.wait()
        if stopping:
            break
        now = time.time()
        crashes = [t for t in crashes if now - t < RESTART_WINDOW_S] + [now]
        state["exits"] = [*state["exits"][-9:], {"at": now, "code": code}]
        if len(crashes) > RESTART_BUDGET:
            state.update(state="gave_up", emulator_pid=None)
            _write(state_dir / "supervisor.json", state)
            return 1
        state["restarts"] += 1
        state.update(state="restarting", emulator_pid=None)
        _write(state_dir / "supervisor.json", state)
        time.sleep(min(2.0, 0.2 * 2 ** (len(crashes) - 1)))
    state.update(state="stopped", emulator_pid=None)
    _write(state_dir / "supervisor.json", state)
    return 0


def main(argv: list[str] | None = None) -> None:
    """Entry point (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m pdx.faults.wan.supervisor")
    p.add_argument("--state-dir", type=Path, required=True)
    args = p.parse_args(argv)
    sys.exit(supervise(args.state_dir))


if __name__ == "__main__":
    main()
