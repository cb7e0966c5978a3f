"""Locust as a subprocess: the command line for one step, running it, reading its CSV.

Locust monkey-patches the interpreter (gevent), so pdx never imports it: each step runs
``python -m locust -f pdx/accept/load/traffic/locustfile.py --headless ...`` and reads its files.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import json
import math
import sys
import zlib
from pathlib import Path
from typing import Any

from pdx.accept.playbook import Load, Playbook
from pdx.accept.steps import Step
from pdx.errors import InputError
from pdx.netaddr import listen_port


def default_locustfile() -> Path:
    """The locustfile shipped in the package (``pdx/accept/load/traffic/locustfile.py``)."""
    from pdx.accept.load.traffic import LOCUSTFILE

    return LOCUSTFILE


def resolve_locustfile(load: Load, playbook_dir: Path) -> Path:
    """The locustfile a playbook asks for (relative to the playbook), or the default one."""
    path = Path(load.locustfile) if load.locustfile else default_locustfile()
    if load.locustfile and not path.is_absolute():
        path = playbook_dir / path
    if not path.is_file():
        raise InputError("load.locustfile", str(path), "an existing locustfile")
    return path


def step_args(pb: Playbook, step: Step, url: str, records_dir: Path) -> list[str]:
    """The ``--pdx-*`` and load options one step needs (shared by master and workers)."""
    users = step.concurrency if step.concurrency is not None else pb.load.open_loop_users
    if step.workload is not None:
        users = 1  # one user sends the whole window, each request on its own greenlet
    args = [
        "--headless",
        "-u",
        str(users),
        "-r",
        str(users),
        "--host",
        url,
        "--pdx-input-len",
        str(step.input_tokens),
        "--pdx-output-len",
        str(step.output_tokens),
        "--pdx-prompt-kind",
        pb.load.prompt_kind,
        "--pdx-token-id-max",
        str(pb.load.token_id_max),
        "--pdx-timeout-s",
        f"{pb.load.timeout_s:g}",
        "--pdx-seed",
        str(pb.seed + step.index),
        "--pdx-records",
        str(records_dir),
        "--pdx-extra-body",
        json.dumps(pb.target.extra_body),
        "--only-summary",
        "--loglevel",
        "WARNING",
    ]
    if pb.target.model:
        args += ["--pdx-model", pb.target.model]
    if pb.load.abort_fraction:
        args += ["--pdx-abort-fraction", f"{pb.load.abort_fraction:g}"]
    if pb.judgement.replay_requests:
        # Prompts are kept for a sample of each user's requests, enough to replay from.
        keep = math.ceil(2 * pb.judgement.replay_requests / users) + 1
        args += ["--pdx-keep-prompts", str(keep)]
    if step.workload is not None:
        return [*args, *trace_args(pb, step)]
    if step.rate_rps is not None:
        args += ["--pdx-mode", "open", "--pdx-rate", f"{step.rate_rps:g}"]
        args += ["--pdx-max-inflight", str(pb.load.max_inflight)]
    return args


def trace_salt(salt: int, step: Step) -> int:
    """The salt of a trace step's prompt tokens: the workload's, mixed with the step's id, so
    two steps (two conditions, two offload policies, a colocated twin) replay the same reuse
    with tokens of their own — no step finds the prefix caches warmed by an earlier one."""
    return salt * 2**32 + zlib.crc32(step.id.encode())


def trace_args(pb: Playbook, step: Step) -> list[str]:
    """A trace step: one user replays the window at the step's time scale, open loop."""
    assert step.workload is not None
    w = pb.load.workloads[step.workload]
    args = ["--pdx-mode", "trace", "--pdx-trace", w.trace, "--pdx-trace-format", w.format,
            "--pdx-length-scale", f"{w.length_scale!r}",
            "--pdx-time-scale", f"{step.time_scale or w.time_scale!r}",
            "--pdx-trace-start-s", f"{w.start_s!r}",
            "--pdx-trace-salt", str(trace_salt(w.salt, step)),
            "--pdx-max-inflight", str(pb.load.max_inflight)]  # fmt: skip
    if w.block_size:
        args += ["--pdx-trace-block-size", str(w.block_size)]
    if w.duration_s:
        args += ["--pdx-trace-duration-s", f"{w.duration_s!r}"]
    if w.max_requests:
        args += ["--pdx-trace-max-requests", str(w.max_requests)]
    return args


class LocustRun:
    """One step's Locust processes (one local process, or a master and N workers)."""

    def __init__(self, locustfile: Path, log_path: Path) -> None:
        self.locustfile = locustfile
        self.log_path = log_path
        self.procs: list[asyncio.subprocess.Process] = []

    async def _spawn(self, args: list[str], log: Any) -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "locust",
            "-f",
            str(self.locustfile),
            *args,
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL,
        )
        self.procs.append(proc)
        return proc

    async def run(
        self,
        args: list[str],
        duration_s: float,
        csv_prefix: Path,
        workers: int,
        drain_s: float = 0.0,
    ) -> int:
        """Run to completion (bounded: duration + drain + 60 s); return Locust's exit code.

        ``drain_s``: after the run time, requests in flight get this long to end (Locust's
        ``--stop-timeout``); those still open then are recorded unfinished.
        """
        run_args = [*args, "--run-time", f"{max(1, round(duration_s))}s", "--csv", str(csv_prefix)]
        if drain_s > 0:
            run_args += ["--stop-timeout", f"{math.ceil(drain_s)}"]
        with self.log_path.open("ab") as log:
            if workers <= 0:
                main = await self._spawn(run_args, log)
            else:
                port = listen_port()  # outside the ephemeral range
                main = await self._spawn(
                    [
                        *run_args,
                        "--master",
                        "--expect-workers",
                        str(workers),
                        "--master-bind-host",
                        "127.0.0.1",
                        "--master-bind-port",
                        str(port),
                    ],
                    log,
                )
                for _ in range(workers):
                    await self._spawn(
                        [
                            "--worker",
                            "--master-host",
                            "127.0.0.1",
                            "--master-port",
                            str(port),
                            "--loglevel",
                            "WARNING",
                        ],
                        log,
                    )
            try:
                return await asyncio.wait_for(main.wait(), duration_s + drain_s + 60)
            finally:
                await self.stop()

    async def stop(self) -> None:
        """Terminate whatever is still running (then kill after 5 s)."""
        for proc in self.procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
        for proc in self.procs:
            try:
                await asyncio.wait_for(proc.wait(), 5)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()


def read_locust_stats(csv_prefix: Path) -> dict[str, dict[str, str]]:
    """Locust's ``<prefix>_stats.csv`` by entry name (``ttft``, ``tpot``, ``itl``, ``e2e``...)."""
    path = Path(f"{csv_prefix}_stats.csv")
    if not path.is_file():
        return {}
    with path.open() as fh:
        return {row["Name"]: row for row in csv.DictReader(fh)}
