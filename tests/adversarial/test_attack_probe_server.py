"""Attacks on `pdx probe-server` with its defaults (rows M2, M3): a real server process.

Bounds asserted: a session opens at most ``--max-data-connections`` (16) data connections
and moves at most ``--max-session-gb`` over all of them; a connection gets no receive buffer
until it is a data connection of a session (4 KiB before: 1,000 idle connections cost the
server < 40 MiB, they cost 1 GB); one address holds at most ``--max-connections-per-peer``
(128) connections, so a flood from it leaves other clients served; UDP replies go only to
the address that opened the session.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from attack import ATTACKER, Flood, probe_server

from pdx.link import protocol as proto
from pdx.link.client import ProbeSession
from pdx.link.probe import ProbeOptions, probe_link

pytestmark = pytest.mark.slow


def fast(target: str) -> ProbeOptions:
    return ProbeOptions(target=target, duration_s=0.4, interval_ms=5.0, streams=2, omit_s=0.1,
                        max_duration_s=1.0, phases=("latency", "throughput"))  # fmt: skip


def test_m2_one_session_gets_16_data_connections_and_its_byte_budget(tmp_path: Path) -> None:
    with probe_server(tmp_path, "--max-session-gb", "0.05") as server:
        with ProbeSession("127.0.0.1", server.port, None) as session:
            opened, refused = [], []
            for _ in range(40):
                try:
                    opened.append(session.open_data("sink", duration_s=5, max_bytes=10**12))
                except Exception as exc:
                    refused.append(str(exc))
            for conn in opened:
                conn.close()
            assert len(opened) == 16 and len(refused) == 24, refused[:1]
            assert "at most 16" in refused[0]
            time.sleep(0.3)
            # Four source streams asking a TB each: the session's 50 MB is all they get.
            got = 0
            for _ in range(4):
                try:
                    conn = session.open_data("source", duration_s=5, max_bytes=10**12)
                except Exception as exc:
                    assert "moved its" in str(exc)
                    continue
                with conn:
                    conn.sock.settimeout(10)
                    while piece := conn.sock.recv(1 << 20):
                        got += len(piece)
        print(f"M2: 16 of 40 data connections accepted; 4 source streams received "
              f"{got / 1e6:.1f} MB of the session's 50 MB (was: 17.6 GB in 5 s)")  # fmt: skip
        assert 0.5 * 50e6 < got <= 50e6 + 4 * (1 << 20)


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
