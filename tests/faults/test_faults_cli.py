"""``pdx faults`` CLI: bad input → one clear line and exit 2; a real proxy process end to end."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdx.cli.main import app

runner = CliRunner()


def _fails(args: list[str], expected: str) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    err = result.stderr.strip()
    assert err.startswith("error: ") and expected in err, err
    assert "Traceback" not in result.output
    return err


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--latency-ms", "-5"], "--latency-ms: got -5.0, expected a finite number >= 0"),
        (["--jitter-ms", "nan"], "--jitter-ms: got nan"),
        (["--loss", "1.5"], "--loss: got 1.5, expected a finite number >= 0 and <= 1"),
        (["--bandwidth-mbps", "0"], "--bandwidth-mbps: got 0.0"),
        (["--direction", "sideways"], "--direction: got 'sideways'"),
        (["--jitter-dist", "pareto"], "--jitter-dist: got 'pareto'"),
    ],
)
def test_proxy_bad_numbers(extra: list[str], expected: str) -> None:
    base = ["faults", "proxy", "--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:1"]
    err = _fails(base + extra, expected)
    assert len(err.splitlines()) == 1


def test_proxy_bad_address_and_unreachable_upstream() -> None:
    _fails(["faults", "proxy", "--listen", "nowhere", "--upstream", "127.0.0.1:1"], "--listen")
    err = _fails(
        [
            "faults",
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "127.0.0.1:1",
            "--duration-s",
            "1",
        ],
        "upstream 127.0.0.1:1 is not reachable (Connection refused)",
    )
    assert len(err.splitlines()) == 1


def test_unknown_toxic_is_one_line() -> None:
    err = _fails(
        ["faults", "toxic", "add", "wormhole", "--api", "127.0.0.1:1"],
        "toxic.type: got 'wormhole', expected one of",
    )
    assert len(err.splitlines()) == 1


def test_malformed_timeline_lists_each_problem(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "events:\n  - at_s: -1\n    add: {type: latency, latency_ms: -2}\n  - at_s: 1\n"
    )
    result = runner.invoke(app, ["faults", "timeline", str(path)])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert lines[0] == f"error: {path}: 3 problem(s)"
    assert any("events[0].at_s" in line for line in lines)
    assert any("events[0].add.latency_ms" in line for line in lines)
    assert any("events[1]: Value error, exactly one action" in line for line in lines)
    path.write_text("events: [at_s: 1\n")
    _fails(["faults", "timeline", str(path)], "YAML syntax error")


def test_valid_timeline_is_described(tmp_path: Path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text(
        "events:\n- at_s: 30\n  add: {type: latency, latency_ms: 50}\n"
        "- at_s: 60\n  link_down: {duration_s: 10}\n"
    )
    result = runner.invoke(app, ["faults", "timeline", str(path), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["duration_s"] == 70 and data["events"][1]["what"] == "link down (reset) for 10.0 s"


def test_netns_needs_root_or_valid_options() -> None:
    if os.geteuid() == 0:
        _fails(["faults", "netns", "up", "--loss", "2"], "loss")
        _fails(["faults", "netns", "up", "--prefix", "Bad Name!"], "prefix")
    else:
        _fails(["faults", "netns", "status"], "needs root")


def _echo_server_script() -> str:
    return (
        "import socket,sys\n"
        "s=socket.create_server(('127.0.0.1',0));print(s.getsockname()[1],flush=True)\n"
        "s.settimeout(30)\n"
        "while True:\n"
        "    c,_=s.accept()\n"
        "    while d:=c.recv(65536): c.sendall(d)\n"
        "    c.close()\n"
    )


@pytest.mark.slow
def test_proxy_process_end_to_end(tmp_path: Path) -> None:
    """A real ``pdx faults proxy`` process, driven by the CLI client over its control API."""
    import socket
    import time

    echo = subprocess.Popen(
        [sys.executable, "-c", _echo_server_script()], stdout=subprocess.PIPE, text=True
    )
    proxy = None
    try:
        echo_port = int(echo.stdout.readline())  # type: ignore[union-attr]
        api = socket.create_server(("127.0.0.1", 0))
        api_port = api.getsockname()[1]
        api.close()
        proxy = subprocess.Popen(
            [
                *(sys.executable, "-c", "from pdx.cli.main import main; main()", "faults", "proxy"),
                *("--listen", "127.0.0.1:0", "--upstream", f"127.0.0.1:{echo_port}"),
                *("--api", f"127.0.0.1:{api_port}", "--latency-ms", "10", "--json"),
                *("--duration-s", "60"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = proxy.stderr.readline()  # type: ignore[union-attr]
        port = int(re.search(r"listening on 127\.0\.0\.1:(\d+)", line).group(1))  # type: ignore[union-attr]
        result = runner.invoke(
            app,
            [
                *("faults", "toxic", "add", "stall", "probability=0"),
                *("--direction", "upstream", "--api", f"127.0.0.1:{api_port}"),
            ],
        )
        assert result.exit_code == 0, result.output
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            start = time.perf_counter()
            conn.sendall(b"ping")
            assert conn.recv(10) == b"ping"
            assert time.perf_counter() - start >= 0.02
        listed = runner.invoke(
            app, ["faults", "toxic", "list", "--json", "--api", f"127.0.0.1:{api_port}"]
        )
        assert [t["name"] for t in json.loads(listed.stdout)] == ["latency_both", "stall_upstream"]
        proxy.send_signal(signal.SIGTERM)
        out, _ = proxy.communicate(timeout=10)
        stats = json.loads(out)
        assert stats["connections_total"] == 1 and stats["bytes_in"]["upstream"] == 4
    finally:
        for proc in (proxy, echo):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
