"""A hung pdx process can be asked for its stacks: ``kill -USR1 <pid>``."""

from __future__ import annotations

import signal
import subprocess
import sys
import time


def test_sigusr1_dumps_every_thread_and_keeps_running() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdx", "probe-server", "--bind", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed once the server is listening
        assert "listening" in line, line
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        assert proc.poll() is None, "the dump must not stop the process"
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    assert "most recent call first" in err
