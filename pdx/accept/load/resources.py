"""CPU and memory of the processes under test, read from /proc (Linux).

Written by hand because the need is two numbers per process tree and psutil is not a dependency.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from pdx.procs import cpu_seconds, stat_fields

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def process_tree(root_pid: int) -> list[int]:
    """``root_pid`` and all its descendants (via /proc/<pid>/task/*/children)."""
    seen: list[int] = []
    todo = [root_pid]
    while todo and len(seen) < 512:
        pid = todo.pop()
        if pid in seen or not Path(f"/proc/{pid}").exists():
            continue
        seen.append(pid)
        for task in Path(f"/proc/{pid}/task").glob("*/children"):
            try:
                todo += [int(x) for x in task.read_text().split()]
            except OSError:
                continue
    return seen


def _cpu_s_and_rss(pid: int) -> tuple[float, int]:
    fields = stat_fields(pid)
    try:
        statm = Path(f"/proc/{pid}/statm").read_text().split()
    except OSError:
        return 0.0, 0
    return (cpu_seconds(fields) if fields else 0.0), int(statm[1]) * _PAGE


class TreeSampler:
    """Successive samples of a process tree: CPU % (of one core) since the last sample, RSS."""

    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid
        self._last: tuple[float, float] | None = None

    def sample(self) -> dict[str, float]:
        """One sample: ``cpu_percent`` and ``rss_bytes`` summed over the tree."""
        pids = process_tree(self.root_pid)
        cpu_s, rss = 0.0, 0
        for pid in pids:
            c, r = _cpu_s_and_rss(pid)
            cpu_s += c
            rss += r
        now = time.monotonic()
        pct = None
        if self._last is not None and now > self._last[0]:
            pct = max(0.0, (cpu_s - self._last[1]) / (now - self._last[0]) * 100)
        self._last = (now, cpu_s)
        return {"cpu_percent": pct or 0.0, "rss_bytes": float(rss), "processes": float(len(pids))}
