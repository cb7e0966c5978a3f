"""pdx.procs against real processes: children, groups, zombies and CPU seconds from /proc."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from pdx.procs import children, cpu_seconds, group_members, is_zombie, stat_fields


def test_a_child_is_listed_then_a_zombie_then_gone() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                            start_new_session=True)  # fmt: skip
    try:
        assert proc.pid in children(os.getpid())
        assert group_members(proc.pid) == [proc.pid]  # its own group, which it leads
        assert not is_zombie(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not is_zombie(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert is_zombie(proc.pid)  # dead, not reaped: listed, but no live member of its group
        assert group_members(proc.pid) == []
    finally:
        proc.kill()
        proc.wait()
    assert stat_fields(proc.pid) is None and proc.pid not in children(os.getpid())


def test_cpu_seconds_follow_the_process_own_clock() -> None:
    """A command name with spaces and parentheses does not shift the fields."""
    code = ("import time\nopen('/proc/self/comm', 'w').write('a ) b (c')\n"
            "t = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
            "time.sleep(30)")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 20
        fields = stat_fields(proc.pid)
        while fields is not None and cpu_seconds(fields) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
            fields = stat_fields(proc.pid)
        assert fields is not None and fields[0] in "RSD" and fields[1] == str(os.getpid())
        with open(f"/proc/{proc.pid}/stat") as f:
            assert "(a ) b (c)" in f.read()
        assert 0.3 <= cpu_seconds(fields) < 5
    finally:
        proc.kill()
        proc.wait()
