"""A real deployment (prefill and decode child processes) serving from a thread of its own,
and the ready document of a ``pdx deploy --json`` command.

For tests whose clients block (the openai SDK, subprocesses such as schemathesis): the
deployment's event loop keeps running in a worker thread while the test calls it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pdx.serving.deploy_config import load_deploy_config
from pdx.serving.supervisor import Deployment


@contextlib.contextmanager
def live_deployment(overrides: list[str]) -> Iterator[Deployment]:
    """Start ``pdx deploy``'s Deployment with ``--set`` overrides; stop it on exit."""
    loop = asyncio.new_event_loop()
    dep = Deployment(load_deploy_config(dotted=overrides))
    runner = ThreadPoolExecutor(1)
    try:
        loop.run_until_complete(dep.start())
        stop = asyncio.Event()
        serving = runner.submit(loop.run_until_complete, stop.wait())
        try:
            yield dep
        finally:
            loop.call_soon_threadsafe(stop.set)
            serving.result(10)
    finally:
        loop.run_until_complete(dep.stop())
        loop.close()
        runner.shutdown()


def read_endpoints(proc: subprocess.Popen[str], timeout_s: float = 120) -> dict[str, Any]:
    """The JSON document ``pdx deploy --json`` prints once ready."""
    assert proc.stdout is not None
    deadline, text = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"pdx deploy exited early with {proc.wait()}")
        text += line
        try:
            data: dict[str, Any] = json.loads(text)
            return data
        except json.JSONDecodeError:
            continue
    raise AssertionError("pdx deploy not ready in time")


def pids_with(*needles: str) -> list[int]:
    """Pids whose command line contains every one of ``needles``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if all(n.encode() in cmd for n in needles):
                pids.append(int(entry.name))
    return pids
