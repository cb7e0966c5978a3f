"""Attacks on `pdx probe-server` with its defaults (rows M2, M3): a real server process.

Bounds asserted: a session without the secret gets the data connections its hello planned,
at most ``--anonymous-data-connections`` (4) at once, and the bytes its plan's seconds are
worth at ``--anonymous-gbps``, at most ``--anonymous-session-gb`` (16 GB); the rest of its
connections are refused and closed, and its streams stop when the budget is spent, while
another client measures; a session that proved the secret gets ``--max-data-connections``
and ``--max-session-gb``; a connection gets no receive buffer until it is a data connection
of a session (4 KiB before: 1,000 idle connections cost the server < 40 MiB, they cost 1 GB);
one address holds at most ``--max-connections-per-peer`` (128) connections, so a flood from
it leaves other clients served; UDP replies go only to the address that opened the session.
"""

from __future__ import annotations

import dataclasses
import select
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from attack import ATTACKER, Flood, dial, probe_server

from pdx.errors import MeasurementError
from pdx.link import protocol as proto
from pdx.link.client import FrameConnection, ProbeSession
from pdx.link.probe import ProbeOptions, probe_link

pytestmark = [pytest.mark.slow, pytest.mark.alone]

GBPS = 40e9 / 8  # --anonymous-gbps's default, in bytes per planned second
BLOCK = 256 * 1024  # the server's read size: a budget is overshot by less than one read


def fast(target: str) -> ProbeOptions:
    """A well-behaved client without the secret. Its plan (4 s of tests) is worth 16 GB at
    --anonymous-gbps; loopback can move more than that in 4 s (over 32 Gbit/s), so each round
    is capped at 1 GB (at most 2 rounds in each of 4 tests: 8 GB), inside the budget."""
    return ProbeOptions(target=target, duration_s=0.4, interval_ms=5.0, streams=2, omit_s=0.1,
                        max_duration_s=1.0, phases=("latency", "throughput"),
                        max_test_bytes=10**9)  # fmt: skip


def attacker(port: int) -> FrameConnection:
    """A connection from the attacker's own address, speaking the protocol by hand."""
    return FrameConnection(dial(port, ATTACKER), None, "attacker")


def hello(port: int, **plan: Any) -> tuple[FrameConnection, dict[str, Any]]:
    control = attacker(port)
    return control, control.request({"op": "hello", **plan})


def data(port: int, session: str, mode: str) -> FrameConnection:
    """A data connection asking for everything: 60 s and a TB."""
    conn = attacker(port)
    try:
        conn.request({"op": "data", "session": session, "mode": mode, "duration_s": 60,
                      "max_bytes": 10**12})  # fmt: skip
    except BaseException:
        conn.close()
        raise
    return conn


def push(conn: FrameConnection, until: float, out: list[dict[str, Any]]) -> None:
    """Send as fast as the server takes it until it says something (its report) or ``until``."""
    block = memoryview(bytes(BLOCK))
    sock = conn.sock
    while time.monotonic() < until:
        readable, writable, _ = select.select([sock], [sock], [], 0.2)
        if readable:
            break
        if writable:
            try:
                sock.send(block)
            except OSError:
                break
    sock.settimeout(10)
    out.append({**conn.receive(), "at": time.monotonic()})


def test_m2_worst_plans_get_the_anonymous_caps_and_a_secret_gets_the_maximum(
    tmp_path: Path,
) -> None:
    with probe_server(tmp_path) as server:
        greedy, reply = hello(server.port, streams=1024, seconds=86_400)
        assert reply["budget"] == {"data_connections": 4, "bytes": 16 * 10**9,
                                   "authenticated": False, "capped": True}  # fmt: skip
        silent, reply = hello(server.port)  # no plan, as an older client: one stream, 1 s
        assert reply["budget"] == {"data_connections": 1, "bytes": int(GBPS),
                                   "authenticated": False, "capped": False}  # fmt: skip
        greedy.close()
        silent.close()
    with (
        probe_server(tmp_path, "--secret", "k") as server,
        ProbeSession("127.0.0.1", server.port, b"k") as session,
    ):
        assert session.budget == {"data_connections": 16, "bytes": 64 * 10**9,
                                  "authenticated": True, "capped": False}  # fmt: skip


def test_m2_a_session_without_the_secret_gets_what_it_planned_and_no_more(
    tmp_path: Path,
) -> None:
    with probe_server(tmp_path) as server:
        # An attacker that plans 40 streams for 0.2 s: 4 of its 40 connections, 1 GB.
        control, reply = hello(server.port, streams=40, seconds=0.2)
        sid, budget = reply["session"], reply["budget"]
        assert budget["data_connections"] == 4 and budget["bytes"] == 0.2 * GBPS
        opened, refused = [], []
        for _ in range(40):
            try:
                opened.append(data(server.port, sid, "sink"))
            except MeasurementError as exc:
                refused.append(str(exc))
        assert len(opened) == 4 and len(refused) == 36, refused[:1]
        assert "at most 4" in refused[0] and "--anonymous-data-connections" in refused[0]
        # Refused connections are closed at once, not left to the idle timeout.
        late = attacker(server.port)
        with pytest.raises(MeasurementError):
            late.request({"op": "data", "session": sid, "mode": "sink", "duration_s": 1,
                          "max_bytes": 1})  # fmt: skip
        late.sock.settimeout(5)
        assert late.sock.recv(1) == b""
        late.close()
        # The 4 push as fast as they can (bounded: 20 s) while another client measures.
        reports: list[dict[str, Any]] = []
        until = time.monotonic() + 20
        pushers = [threading.Thread(target=push, args=(c, until, reports)) for c in opened]
        for t in pushers:
            t.start()
        t0 = time.monotonic()
        during = probe_link(dataclasses.replace(fast(server.target), phases=("throughput",)))
        took = time.monotonic() - t0
        for t in pushers:
            t.join(30)
        pushed_s = max(r["at"] for r in reports) - t0
        accepted = sum(int(r["bytes"]) for r in reports)
        assert len(reports) == 4 and all("moved its budget" in r["stopped"] for r in reports)
        assert budget["bytes"] <= accepted <= budget["bytes"] + BLOCK
        with pytest.raises(MeasurementError, match="moved its budget"):
            data(server.port, sid, "source")
        # A well-behaved client measured meanwhile, and measures after.
        assert during["throughput"]["up_gbps"] > 0 and during["throughput"]["down_gbps"] > 0
        after = probe_link(fast(server.target))
        assert after["throughput"]["up_gbps"] > 0 and after["loss"]["probes"] > 0
        for conn in opened:
            conn.close()
        # A plan of 4 downloads for 0.02 s asking a TB each: the 100 MB it planned is all.
        source_control, reply = hello(server.port, streams=4, seconds=0.02)
        got = 0
        for _ in range(4):
            try:
                conn = data(server.port, reply["session"], "source")
            except MeasurementError as exc:  # the first took it all
                assert "moved its budget of 0.1 GB" in str(exc)
                continue
            with conn:
                conn.sock.settimeout(10)
                while piece := conn.sock.recv(1 << 20):
                    got += len(piece)
        assert got == reply["budget"]["bytes"] == 0.02 * GBPS
        control.close()
        source_control.close()
        log = server.stderr()
    print(f"M2: 4 of 40 data connections accepted; the 4 pushing pushed {accepted / 1e9:.3f} GB "
          f"in {pushed_s:.1f} s for a 1 GB budget, then were stopped; a probe-link from another "
          f"address took {took:.1f} s meanwhile; 4 downloads asking a TB each got "
          f"{got / 1e6:.0f} MB (was: 16 of 40 connections, 15.7 GB in 5 s)")  # fmt: skip
    assert "(no secret): data connection refused: 4 data connections open" in log
    assert "moved its budget of 1 GB" in log


def test_m3_idle_connections_cost_no_receive_buffers(tmp_path: Path) -> None:
    with probe_server(tmp_path) as server:
        base = server.rss_mb()
        sources = tuple(f"127.0.0.{i}" for i in range(2, 10))  # 125 each, under the per-peer cap
        with Flood(server.port, size=1000, duration_s=30, sources=sources) as flood:
            deadline = time.monotonic() + 20
            while flood.peak_open < 1000 and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(0.5)
            held = server.rss_mb()
        grown = held - base
        print(
            f"M3: {flood.peak_open} idle connections: RSS {base:.0f} -> {held:.0f} MiB "
            f"(+{grown * 1024 / max(flood.peak_open, 1):.1f} KiB each; was 256 KiB)"
        )
        assert flood.peak_open == 1000
        assert grown < 40


def test_m3_a_flood_from_one_address_leaves_other_clients_served(tmp_path: Path) -> None:
    with probe_server(tmp_path) as server:
        with Flood(server.port, size=600, duration_s=20) as flood:
            deadline = time.monotonic() + 10
            while flood.dialled < 600 and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(0.5)
            t0 = time.monotonic()
            report = probe_link(fast(f"127.0.0.1:{server.port}"))
            took = time.monotonic() - t0
        print(
            f"M3: attacker dialled {flood.dialled} (the server closed {len(flood.lifetimes)} past"
            f" its 128 per address); a probe-link from 127.0.0.1 finished in {took:.1f} s"
        )
        assert report["loss"]["probes"] > 0 and report["throughput"]["up_gbps"] > 0
        assert flood.lifetimes  # past 128 of its connections, the server closed the rest


def test_udp_replies_go_only_to_the_session_address(tmp_path: Path) -> None:
    with probe_server(tmp_path) as server, ProbeSession("127.0.0.1", server.port, None) as s:
        probe = proto.pack_probe(proto.Probe(0, 1, s.session_id, 0, 1), None)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as own:
            own.bind(("127.0.0.1", 0))
            own.settimeout(2)
            own.sendto(probe, ("127.0.0.1", s.udp_port))
            assert proto.unpack_probe(own.recv(2048), None).kind == proto.KIND_REPLY
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as spoofer:
            spoofer.bind((ATTACKER, 0))  # a reflector for another address would amplify
            spoofer.settimeout(0.5)
            spoofer.sendto(probe, ("127.0.0.1", s.udp_port))
            with pytest.raises(TimeoutError):
                spoofer.recv(2048)


def test_udp_probes_of_a_session_are_bounded_in_streams_and_sequence_numbers(
    tmp_path: Path,
) -> None:
    # Each stream keeps one bit per sequence number below 10^6 (125 KB), 16 streams a session:
    # a stranger's probes cost the server at most 2 MB per session, whatever they send.
    with probe_server(tmp_path) as server, ProbeSession("127.0.0.1", server.port, None) as s:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind(("127.0.0.1", 0))
            udp.settimeout(0.5)

            def answered(stream: int, seq: int) -> bool:
                probe = proto.pack_probe(proto.Probe(0, stream, s.session_id, seq, 1), None)
                udp.sendto(probe, ("127.0.0.1", s.udp_port))
                try:
                    return proto.unpack_probe(udp.recv(2048), None).seq == seq
                except TimeoutError:
                    return False

            assert all(answered(stream, 999_999) for stream in range(16))
            assert not answered(16, 0)  # a 17th stream
            assert not answered(0, 1_000_000)  # past the 10^6 a stream keeps
            assert answered(0, 999_999)  # a duplicate is still reflected, and counted
        stats = s.udp_stats(0, 10**6)
        assert stats["received"] == 1 and stats["duplicates"] == 1
