"""The system under test: an external URL, or a ``pdx deploy`` pair started as a subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

from pdx.errors import MeasurementError


async def wait_ready(url: str, timeout_s: float, proc: asyncio.subprocess.Process | None) -> float:
    """Poll ``url`` until HTTP 200; return seconds waited. Fails fast if ``proc`` exits."""
    import aiohttp

    t0 = time.monotonic()
    last = "no answer"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while time.monotonic() - t0 < timeout_s:
            if proc is not None and proc.returncode is not None:
                raise MeasurementError(
                    f"pdx deploy exited with code {proc.returncode} before ready"
                )
            try:
                async with session.get(url) as resp:
                    if resp.status == 200:
                        return time.monotonic() - t0
                    last = f"HTTP {resp.status}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                last = type(exc).__name__
            await asyncio.sleep(0.2)
    raise MeasurementError(f"{url} not ready after {timeout_s:g} s (last: {last})")


async def check_reachable(url: str, timeout_s: float) -> None:
    """Any HTTP answer from ``url`` in ``timeout_s`` (servers differ in their health paths)."""
    import aiohttp

    t0 = time.monotonic()
    last = "no answer"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while time.monotonic() - t0 < timeout_s:
            try:
                async with session.get(url):
                    return
            except (aiohttp.ClientError, TimeoutError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(0.2)
    raise MeasurementError(f"target {url} not reachable after {timeout_s:g} s ({last})")


class DeployProcess:
    """``pdx deploy`` as a child process in its own process group, stopped by handle."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        stdout_path: Path | None = None,
        prefix: list[str] | None = None,
    ) -> None:
        self.args = args
        self.prefix = prefix or []
        self.log_path = log_path
        self.stdout_path = stdout_path
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> asyncio.subprocess.Process:
        """Spawn ``[PREFIX] python -m pdx.cli.main deploy ARGS`` with output to the log file.

        ``PREFIX`` is ``ip netns exec NS`` for a namespace deploy (``ip`` execs in place, so
        the process is still the deploy itself).
        """
        log = self.log_path.open("ab")
        out = self.stdout_path.open("wb") if self.stdout_path else log
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self.prefix,
                sys.executable,
                "-c",
                "from pdx.cli.main import main; main()",
                "deploy",
                *self.args,
                stdout=out,
                stderr=log,
                stdin=asyncio.subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            log.close()
            out.close()
        return self.proc

    @property
    def pid(self) -> int | None:
        """The deploy process id (its children are found through /proc)."""
        return self.proc.pid if self.proc else None

    async def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM (graceful shutdown of the whole pair), then SIGKILL to its group after grace."""
        proc = self.proc
        if proc is None:
            return None
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), grace_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        return proc.returncode
