"""``pdx probe-server`` / ``pdx probe-link`` through the real CLI."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdx.cli.main import app
from pdx.link.server import ProbeServer

FAST = [
    "--duration",
    "0.3",
    "--interval-ms",
    "5",
    "--streams",
    "2",
    "--omit",
    "0.1",
    "--max-duration",
    "0.8",
    "--chunk-sizes",
    "64KiB,256KiB",
    "--chunk-seconds",
    "0.1",
]


def _run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["127.0.0.1:5301", "--streams", "0"], "--streams"),
        (["127.0.0.1:5301", "--interval-ms", "-1"], "--interval-ms"),
        (["127.0.0.1:5301", "--duration", "0"], "--duration"),
        (["127.0.0.1:5301", "--phases", "latency,teleport"], "--phases"),
        (["127.0.0.1:5301", "--chunk-sizes", "1MiB,3XB"], "--chunk-sizes"),
        (["127.0.0.1:5301", "--chunk-sizes", "1GiB"], "--chunk-sizes"),
        (["127.0.0.1:5301", "--kv-direction", "sideways"], "--kv-direction"),
        (["127.0.0.1:5301", "--kv-report", "kv.json"], "--qps"),
        # a rate or row without the report it applies to is refused, never silently dropped
        (["127.0.0.1:5301", "--qps", "2"], "--qps"),
        (["127.0.0.1:5301", "--kv-gbps", "0.3", "--qps", "2"], "--qps"),
        (["127.0.0.1:5301", "--seq", "1024"], "--seq"),
        (["127.0.0.1:5301", "--kv-report", "/nonexistent/kv.json", "--qps", "1"], "--kv-report"),
        (["127.0.0.1:5301", "--chunk-transport", "pigeon"], "--chunk-transport"),
        (["localhost", "--duration", "1"], "target"),
        (["127.0.0.1:99999"], "target"),
    ],
)
def test_bad_input_is_one_line_naming_the_field(args: list[str], field: str) -> None:
    code, out, err = _run("probe-link", *args)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith(f"error: {field}: got "), err


def test_qps_without_a_kv_report_says_why() -> None:
    code, _, err = _run("probe-link", "127.0.0.1:5301", "--qps", "2")
    assert code == 2
    assert err == (
        "error: --qps: got 2.0, expected --kv-report with it: --qps turns a measure-kv report's "
        "kv_bytes per request into a demand (without a report, give the demand as --kv-gbps)\n"
    )


def test_help_says_what_kv_direction_means() -> None:
    wide = {"COLUMNS": "200", "TERMINAL_WIDTH": "200"}
    result = CliRunner().invoke(app, ["probe-link", "--help"], env=wide)
    text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())
    assert "up (this host sends it to the probe server's host), down (the server's host" in text
    assert "the direction whose 1- vs N-stream goodput sets kv.streams" in text


def test_unreachable_peer_is_a_clear_error_and_exit_2() -> None:
    code, out, err = _run("probe-link", "127.0.0.1:1", "--connect-timeout", "2")
    assert code == 2 and out == ""
    assert err.startswith("error: cannot reach probe server at 127.0.0.1:1")
    assert err.count("\n") == 1


def test_go_exits_0_with_the_documented_json(probe_server: ProbeServer) -> None:
    code, out, _ = _run(
        "probe-link",
        f"127.0.0.1:{probe_server.tcp_port}",
        *FAST,
        "--kv-gbps",
        "0.01",
        "--ttft-budget-ms",
        "1000",
        "--interval-ms",
        "0.1",  # 3,000 UDP probes: none lost bounds loss to 0.1 % (the loss rule can pass)
        "--json",
    )
    assert code == 0
    report = json.loads(out)
    for key in ("up_gbps", "down_gbps", "ci95_pct"):
        assert report["throughput"][key] is not None
    assert set(report["rtt_ms"]) >= {"p50", "p90", "p99", "max", "mean"}
    assert set(report["rtt_under_load_ms"]) >= {"p50", "p99"}
    assert report["jitter_ms"]["rfc3550"] is not None
    assert set(report["ipdv_ms"]) >= {"p50", "p99"}
    assert set(report["loss"]) >= {"up", "down", "probes", "bursts", "max_burst"}
    assert isinstance(report["mtu"], int)
    assert set(report["chunks"][0]) >= {"chunk_bytes", "gbps", "p50_ms", "p99_ms"}
    assert report["verdict"]["go"] is True and report["verdict"]["result"] == "GO"
    assert [r["status"] for r in report["verdict"]["rules"]] == ["pass"] * 6
    rules = {r["name"]: r for r in report["verdict"]["rules"]}
    assert rules["mtu"]["measured"] == report["mtu"] and rules["mtu"]["threshold"] == 1280
    assert rules["jitter"]["threshold"] >= 1.0  # loopback: the 1 ms floor, not half its RTT
    assert report["verdict"]["judged"] == [
        "kv_bandwidth",
        "rtt",
        "loss",
        "chunk_p99",
        "jitter",
        "mtu",
    ]
    # what to set for vLLM's NIXL on this link: the interface toward the peer (loopback
    # here), no buffer caps (a loopback BDP is under the kernel's defaults), and slow start
    # after idle off on a short clean path (BBR instead where the probe saw any loss)
    vllm = report["recommendations"]["vllm"]
    assert "net.ipv4.tcp_wmem" not in vllm["sysctl"]
    assert vllm["env"]["UCX_NET_DEVICES"] == "lo"
    lossy = max(report["loss"]["up"], report["loss"]["down"]) > 0
    key, want = ("net.ipv4.tcp_congestion_control", "bbr") if lossy else (
        "net.ipv4.tcp_slow_start_after_idle", "0")  # fmt: skip
    assert vllm["sysctl"][key] == want


def test_no_go_exits_1_and_names_the_failing_rule(probe_server: ProbeServer) -> None:
    code, out, _ = _run(
        "probe-link",
        f"127.0.0.1:{probe_server.tcp_port}",
        *FAST,
        "--phases",
        "throughput",
        "--kv-gbps",
        "100000",
    )
    assert code == 1
    assert "verdict: NO-GO" in out
    assert "kv_bandwidth" in out and "FAIL" in out


def test_kv_report_and_qps_set_the_demand(probe_server: ProbeServer, tmp_path: Path) -> None:
    kv = tmp_path / "kv.json"
    kv.write_text(json.dumps({"requests": [{"seq": 8192, "kv_bytes": 125_000_000}]}))
    code, out, _ = _run(
        "probe-link",
        f"127.0.0.1:{probe_server.tcp_port}",
        *FAST,
        "--phases",
        "latency",
        "--kv-report",
        str(kv),
        "--qps",
        "4",
        "--json",
    )
    report = json.loads(out)
    assert report["kv_demand"]["gbps"] == pytest.approx(4.0)
    assert report["verdict"]["rules"][0]["status"] == "skip"  # no throughput measured
    # the bandwidth rule could not be judged: not a GO, exit 3
    assert code == 3 and report["verdict"]["result"] == "INCONCLUSIVE"


def test_server_and_client_as_real_processes() -> None:
    pdx = str(Path(sys.executable).parent / "pdx")
    server = subprocess.Popen(
        [pdx, "probe-server", "--bind", "127.0.0.1", "--port", "0", "--secret", "k"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()  # printed once both sockets are bound
        assert "listening on 127.0.0.1 tcp" in line, line
        port = line.split(" tcp ")[1].split()[0]
        client = subprocess.run(
            [
                pdx,
                "probe-link",
                f"127.0.0.1:{port}",
                *FAST,
                "--phases",
                "latency,mtu",
                "--json",
                "--secret",
                "k",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        # No rule given (no --kv-gbps, no --ttft-budget-ms): INCONCLUSIVE, exit 3, never GO
        assert client.returncode == 3, client.stderr
        verdict = json.loads(client.stdout)["verdict"]
        assert verdict["result"] == "INCONCLUSIVE" and not verdict["go"]
        assert "not judged: kv_bandwidth, rtt" in verdict["why"]
        assert json.loads(client.stdout)["loss"]["up"] == 0
        wrong = subprocess.run(
            [pdx, "probe-link", f"127.0.0.1:{port}", "--secret", "nope"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert wrong.returncode == 2 and "wrong secret" in wrong.stderr
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_server_port_in_use_is_an_input_error(probe_server: ProbeServer) -> None:
    code, _, err = _run("probe-server", "--port", str(probe_server.tcp_port))
    assert code == 2 and err.startswith("error: --port: got ")
