"""Servers under attack: helpers that start a real server process on loopback, and floods.

The attacker dials from 127.0.0.2 (its own source address, as a second host would), the
legitimate client from 127.0.0.1, so per-peer limits see two peers. Memory is the server
process's own RSS, read from /proc while the attack holds its connections.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PDX = [sys.executable, "-c", "from pdx.cli.main import main; main()"]
ATTACKER = "127.0.0.2"


@dataclass
class Server:
    """A server child process: what it printed when ready, its stderr, its memory."""

    proc: subprocess.Popen[str]
    info: dict[str, Any]
    stderr_path: Path
    audit_path: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def rss_mb(self) -> float:
        """Resident memory of the server process now, MiB."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    @property
    def port(self) -> int:
        return int(self.info["port"])

    @property
    def data_port(self) -> int:
        return int(self.info["data_port"])

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


def _read_ready(proc: subprocess.Popen[str], until: str, timeout_s: float) -> str:
    """Lines from the child's stdout up to one that ends with ``until``."""
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put("")

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            continue
        if not line:
            break
        text += line
        if line.rstrip().endswith(until):
            return text
    raise AssertionError(f"server did not start: {text!r}")


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@contextlib.contextmanager
def kv_store(tmp: Path, *sets: str, tls_dir: Path | None = None) -> Iterator[Server]:
    """``pdx kv-serve`` on ephemeral ports with ``--set`` overrides, audited to a file."""
    audit = tmp / "store-audit.jsonl"
    err = tmp / "store-stderr.txt"
    cmd = [*PDX, "kv-serve", "--json", "--port", "0", "--data-port", "0", "--audit", str(audit)]
    if tls_dir is not None:
        cmd += ["--tls-dir", str(tls_dir)]
    for item in sets:
        cmd += ["--set", item]
    with err.open("w") as err_file:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err_file, text=True,
                                start_new_session=True)  # fmt: skip
    try:
        info = json.loads(_read_ready(proc, "}", 60))
        yield Server(proc, info, err, audit)
    finally:
        _stop(proc)


@contextlib.contextmanager
def probe_server(tmp: Path, *args: str) -> Iterator[Server]:
    """``pdx probe-server`` on an ephemeral port."""
    err = tmp / "probe-stderr.txt"
    cmd = [*PDX, "probe-server", "--port", "0", *args]
    with err.open("w") as err_file:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err_file, text=True,
                                start_new_session=True)  # fmt: skip
    try:
        line = _read_ready(proc, ")", 60).strip().splitlines()[-1]
        words = line.split()
        info = {
            "port": int(words[words.index("tcp") + 1]),
            "udp_port": int(words[words.index("udp") + 1]),
        }
        yield Server(proc, info, err)
    finally:
        _stop(proc)


def dial(port: int, source: str = ATTACKER, timeout_s: float = 5.0) -> socket.socket:
    """A TCP connection to 127.0.0.1:``port`` from ``source``."""
    return socket.create_connection(("127.0.0.1", port), timeout_s, source_address=(source, 0))


def closed(sock: socket.socket) -> bool:
    """Whether the peer closed ``sock`` (EOF or reset); reads and drops what it sent first."""
    sock.setblocking(False)
    try:
        while sock.recv(65536):
            pass
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


class Flood(threading.Thread):
    """An attacker holding up to ``size`` connections, dialling at most ``rate_per_s`` a second
    from ``sources`` (round robin), each sending ``first``, then the bytes of ``trickle`` one
    per ``tick_s``.

    Bounded: it stops after ``duration_s`` and closes everything. ``lifetimes`` holds how long
    each connection lived that the server closed (to within ``tick_s``)."""

    def __init__(
        self, port: int, *, size: int, duration_s: float, rate_per_s: float = 1e9,
        sources: tuple[str, ...] = (ATTACKER,), first: bytes = b"", trickle: bytes = b"",
        tick_s: float = 0.25,
    ) -> None:  # fmt: skip
        super().__init__(daemon=True)
        self.port, self.size, self.duration_s = port, size, duration_s
        self.rate_per_s, self.sources, self.first = rate_per_s, sources, first
        self.trickle, self.tick_s = trickle, tick_s
        self.dialled = 0
        self.failed_dials = 0
        self.lifetimes: list[float] = []
        self.peak_open = 0
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(30)

    def __enter__(self) -> Flood:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def run(self) -> None:
        open_: dict[socket.socket, list[float]] = {}  # socket -> [born, bytes of trickle sent]
        t0 = time.monotonic()
        try:
            while not self._stop_event.is_set() and time.monotonic() - t0 < self.duration_s:
                tick = time.monotonic()
                budget = int(self.rate_per_s * self.tick_s) if self.rate_per_s < 1e9 else self.size
                while len(open_) < self.size and budget > 0:
                    budget -= 1
                    source = self.sources[self.dialled % len(self.sources)]
                    self.dialled += 1
                    try:
                        sock = dial(self.port, source, timeout_s=1.0)
                        if self.first:
                            sock.sendall(self.first)
                    except OSError:
                        self.failed_dials += 1
                        continue
                    open_[sock] = [time.monotonic(), 0]
                self.peak_open = max(self.peak_open, len(open_))
                for sock, state in list(open_.items()):
                    gone = closed(sock)
                    at = int(state[1])
                    if not gone and at < len(self.trickle):
                        try:
                            sock.send(self.trickle[at : at + 1])
                            state[1] += 1
                        except OSError:
                            gone = True
                    if gone:
                        self.lifetimes.append(time.monotonic() - state[0])
                        del open_[sock]
                        sock.close()
                self._stop_event.wait(max(0.0, self.tick_s - (time.monotonic() - tick)))
        finally:
            for sock in open_:
                sock.close()


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]
