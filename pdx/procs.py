"""What Linux's /proc says about processes: each one's stat fields, children and groups.

Read by hand (no psutil in the dependencies for these few fields): a stat line is
``pid (command) state ppid pgrp ...``, and the command may itself hold spaces and ``)``, so
the fields are those after its last ``)``.
"""

from __future__ import annotations

import os

# Indexes into stat_fields(): the stat line's fields after the command name.
STATE, PPID, PGRP, UTIME, STIME = 0, 1, 2, 11, 12


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def pids() -> list[int]:
    """Every process id /proc lists now."""
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def children(parent: int) -> list[int]:
    """The processes whose parent is ``parent`` now."""
    out = []
    for pid in pids():
        fields = stat_fields(pid)
        if fields is not None and len(fields) > PPID and fields[PPID] == str(parent):
            out.append(pid)
    return out


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    out = []
    for pid in pids():
        fields = stat_fields(pid)
        if fields is not None and len(fields) > PGRP and fields[PGRP] == str(pgid) \
                and fields[STATE] != "Z":  # fmt: skip
            out.append(pid)
    return out


def is_zombie(pid: int) -> bool:
    """Whether ``pid`` has exited and waits to be reaped."""
    fields = stat_fields(pid)
    return fields is not None and fields[STATE] == "Z"


def cpu_seconds(fields: list[str]) -> float:
    """User + system CPU seconds (every thread) from a process's stat fields."""
    return (int(fields[UTIME]) + int(fields[STIME])) / os.sysconf("SC_CLK_TCK")
