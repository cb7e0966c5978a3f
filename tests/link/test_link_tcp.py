"""What probe-link says about TCP: both ends' congestion control, the BDP, buffer-capped streams."""

from __future__ import annotations

import socket
from typing import Any, ClassVar

from pdx.link.client import ProbeSession
from pdx.link.probe import ProbeOptions, probe_link, tcp_summary
from pdx.link.verdict import VerdictRules
from pdx.tcp import (
    buffer_limits,
    congestion_control,
    default_congestion_control,
    tcp_info,
    window_for,
)

MIB = 1 << 20


def test_tcp_info_and_congestion_control_of_a_real_socket(probe_server: Any) -> None:
    with socket.create_connection(("127.0.0.1", probe_server.tcp_port), timeout=5) as s:
        info = tcp_info(s)
        assert info is not None and info.snd_mss > 0 and info.rtt_ms >= 0
        assert congestion_control(s) == default_congestion_control()
    limits = buffer_limits()
    assert limits.tcp_wmem_max and limits.tcp_rmem_max


def test_probe_link_reports_both_ends_tcp_and_each_single_stream(
    loopback_probe_server: Any,
) -> None:
    opts = ProbeOptions(
        target=f"127.0.0.1:{loopback_probe_server.tcp_port}", duration_s=0.5, omit_s=0.2, streams=2,
        phases=("throughput",), max_duration_s=1.5, rules=VerdictRules(),
    )  # fmt: skip
    report = probe_link(opts)
    tcp = report["tcp"]
    assert tcp["client"]["congestion_control"] == default_congestion_control()
    assert tcp["server"]["congestion_control"] == default_congestion_control()
    assert tcp["server"]["buffers"]["tcp_wmem_max"] == buffer_limits().tcp_wmem_max
    assert tcp["rtt_ms"] > 0 and tcp["bdp_bytes"] > 0
    for direction in ("up", "down"):
        s = tcp["single_stream"][direction]
        assert s["window_bytes"] > 0 and s["congestion_control"] == default_congestion_control()
    runs = report["throughput"]["runs"]
    assert all(r["sender_tcp"] for r in runs)  # up: the client's sockets, down: the server's
    assert all(t["bytes_acked"] > 0 for r in runs for t in r["sender_tcp"])


class _Session:
    server_tcp: ClassVar[dict[str, Any]] = {
        "congestion_control": "cubic",
        "buffers": {"tcp_wmem_max": 4 * MIB, "tcp_rmem_max": 6 * MIB},
    }


def _sender(sndbuf_ms: float = 0.0, rwnd_ms: float = 0.0) -> dict[str, Any]:
    return {"rtt_ms": 50.0, "rttvar_ms": 1.0, "min_rtt_ms": 50.0, "snd_cwnd": 2000,
            "snd_mss": 1448, "total_retrans": 3, "bytes_acked": 10**8, "delivery_rate_bps": 0,
            "busy_ms": 1000.0, "rwnd_limited_ms": rwnd_ms, "sndbuf_limited_ms": sndbuf_ms,
            "congestion_control": "cubic"}  # fmt: skip


def _report(one: float, many: float, senders: dict[str, dict[str, Any]]) -> dict[str, Any]:
    runs = []
    for d in ("up", "down"):
        runs.append({"direction": d, "streams": 1, "gbps": one, "sender_tcp": [senders[d]]})
        runs.append({"direction": d, "streams": 4, "gbps": many, "sender_tcp": [_sender()] * 4})
    return {"rtt_ms": {"p50": 50.0},
            "throughput": {"up_gbps": many, "down_gbps": many, "runs": runs}}  # fmt: skip


def test_a_window_limited_stream_names_the_sysctl_and_a_value_that_would_not_cap_it() -> None:
    # down: the server's TCP_INFO says its send buffer limited it most of the time
    # up: TCP_INFO says nothing, but the window (0.44 Gbit/s x 50 ms = 2.75 MB) is close to
    # the client's own tcp_wmem max while four streams go twice as fast
    report = _report(0.44, 0.86, {"up": _sender(), "down": _sender(sndbuf_ms=800)})
    tcp = tcp_summary(_Session(), report)  # type: ignore[arg-type]
    bdp = int(0.86e9 / 8 * 0.050)
    assert tcp["bdp_bytes"] == bdp
    down, up = tcp["single_stream"]["down"], tcp["single_stream"]["up"]
    assert down["limited_by"] == "send buffer" and down["evidence"].startswith("TCP_INFO")
    want = {"end": "server", "sysctl": "net.ipv4.tcp_wmem", "max_bytes": 4 * MIB,
            "would_not_cap_bytes": window_for(bdp)}  # fmt: skip
    assert down["cap"] == want
    assert up["limited_by"] == "send buffer" and up["cap"]["end"] == "client"
    assert up["cap"]["max_bytes"] == buffer_limits().tcp_wmem_max
    assert window_for(bdp) == 11 * MIB  # 2 x 5.375 MB rounded up to a MiB
    # receive window: the client's TCP_INFO (up) blames the server's receive buffer
    report = _report(0.44, 0.86, {"up": _sender(rwnd_ms=700), "down": _sender()})
    up = tcp_summary(_Session(), report)["single_stream"]["up"]  # type: ignore[arg-type]
    assert up["cap"]["end"] == "server" and up["cap"]["sysctl"] == "net.ipv4.tcp_rmem"
    # one stream as fast as four: not capped, whatever the window
    report = _report(0.85, 0.86, {"up": _sender(), "down": _sender()})
    single = tcp_summary(_Session(), report)["single_stream"]  # type: ignore[arg-type]
    assert not single["up"]["capped_by_buffers"] and single["up"]["cap"] is None


def test_an_older_server_without_tcp_facts_still_probes() -> None:
    session = ProbeSession("127.0.0.1", 1, None)
    assert session.server_tcp is None and session.tcp_report("x") == []
