"""Probe server and client over real loopback sockets: phases, concurrency, abuse, auth."""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pdx.errors import MeasurementError
from pdx.link import phases
from pdx.link import protocol as proto
from pdx.link.client import FrameConnection, ProbePlan, ProbeSession
from pdx.link.probe import ProbeOptions, probe_link
from pdx.link.server import ProbeServer
from pdx.units import KIB

FAST = {
    "duration_s": 0.4,
    "interval_ms": 5.0,
    "streams": 2,
    "omit_s": 0.1,
    "max_duration_s": 1.0,
    "chunk_sizes": (64 * KIB, 256 * KIB),
    "chunk_seconds": 0.1,
}


def _target(server: ProbeServer) -> str:
    return f"127.0.0.1:{server.tcp_port}"


def test_all_phases_run_against_a_loopback_server(probe_server: ProbeServer) -> None:
    seen: list[str] = []
    report = probe_link(
        ProbeOptions(target=_target(probe_server), **FAST), lambda p, m: seen.append(p)
    )
    assert set(seen) == {"latency", "mtu", "throughput", "loaded", "chunks"}
    rtt = report["rtt_ms"]
    assert 0 < rtt["min"] <= rtt["p50"] <= rtt["p99"] <= rtt["max"] < 1000
    assert report["loss"]["probes"] == 80 and report["loss"]["up"] == 0
    assert report["jitter_ms"]["rfc3550"] >= 0 and report["ipdv_ms"]["p99"] >= 0
    tp = report["throughput"]
    assert tp["up_gbps"] > 0.05 and tp["down_gbps"] > 0.05
    assert {(r["direction"], r["streams"]) for r in tp["runs"]} == {
        ("up", 1),
        ("up", 2),
        ("down", 1),
        ("down", 2),
    }
    assert all(r["intervals_gbps"] for r in tp["runs"])
    assert report["rtt_under_load_ms"]["samples"] > 0
    assert report["mtu"] >= 1500  # loopback: 65535, the largest IPv4 packet
    assert [c["chunk_bytes"] for c in report["chunks"]] == [64 * KIB, 256 * KIB]
    assert all(c["gbps"] > 0 and c["p50_ms"] <= c["p99_ms"] for c in report["chunks"])
    assert report["chunk_recommended_bytes"] in (64 * KIB, 256 * KIB)
    # No KV demand and no TTFT budget given, and 80 probes bound loss only to ~3.7 %:
    # nothing proves the link fit for KV, so the verdict says so instead of GO.
    verdict = report["verdict"]
    assert verdict["go"] is False and verdict["result"] == "INCONCLUSIVE"
    assert "kv_bandwidth" in verdict["why"] and "rtt" in verdict["why"]


def test_two_clients_at_once_both_succeed(probe_server: ProbeServer) -> None:
    results: dict[int, Any] = {}
    opts = ProbeOptions(
        target=_target(probe_server),
        **{**FAST, "duration_s": 0.6},
        phases=("latency", "throughput"),
    )

    def client(i: int) -> None:
        try:
            results[i] = probe_link(opts)
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=client, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    most = 0
    while any(t.is_alive() for t in threads):
        most = max(most, len(probe_server.sessions))
        time.sleep(0.01)
    assert most == 2, "the two clients never had sessions open at the same time"
    for i in range(2):
        assert isinstance(results[i], dict), results[i]
        assert results[i]["loss"]["up"] == 0
        assert results[i]["throughput"]["up_gbps"] > 0


def _raw(server: ProbeServer) -> tuple[socket.socket, bytes]:
    sock = socket.create_connection(("127.0.0.1", server.tcp_port), timeout=5)
    length, _ = proto.parse_header(_recv(sock, proto.FRAME_HEADER.size))
    welcome = proto.decode_body(_recv(sock, length), b"", None, b"")
    return sock, bytes.fromhex(welcome["nonce"])


def _recv(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        piece = sock.recv(n - len(out))
        if not piece:
            raise EOFError
        out += piece
    return out


def _read_reply(sock: socket.socket, secret: bytes | None, nonce: bytes) -> dict[str, Any]:
    length, mac = proto.parse_header(_recv(sock, proto.FRAME_HEADER.size))
    return proto.decode_body(_recv(sock, length), mac, secret, nonce)


def _body_frame(body: bytes) -> bytes:
    return proto.FRAME_HEADER.pack(len(body), proto.ZERO_MAC) + body


MALFORMED = {
    "http_garbage": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "oversized_frame": proto.FRAME_HEADER.pack(10**9, proto.ZERO_MAC),
    "not_json": _body_frame(b"\x00\x01{{{"),
    "json_without_op": _body_frame(b'{"hello": 1}'),
    "unknown_op": _body_frame(b'{"op": "format_disk"}'),
    "bad_mode": _body_frame(b'{"op": "data", "session": "00", "mode": "x"}'),
    "unknown_session": _body_frame(
        b'{"op": "data", "session": "0011223344556677", "mode": "sink", '
        b'"duration_s": 1, "max_bytes": 10}'
    ),
    "stats_before_hello": _body_frame(b'{"op": "udp_stats", "stream": 1, "sent": 3}'),
    "plan_without_seconds": _body_frame(b'{"op": "hello", "streams": 4}'),
    "plan_of_negative_streams": _body_frame(b'{"op": "hello", "streams": -1, "seconds": 1}'),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_control_messages_are_rejected_and_the_server_keeps_serving(
    probe_server: ProbeServer, name: str
) -> None:
    sock, nonce = _raw(probe_server)
    with sock:
        sock.sendall(MALFORMED[name])
        reply = _read_reply(sock, None, nonce)
    assert reply["op"] == "error" and reply["message"]
    with ProbeSession("127.0.0.1", probe_server.tcp_port, None) as session:
        assert session.udp_stats(1, 0)["received"] == 0


def test_a_bad_frame_does_not_end_a_control_session(probe_server: ProbeServer) -> None:
    with ProbeSession("127.0.0.1", probe_server.tcp_port, None) as session:
        assert session.control is not None
        session.control.sock.sendall(MALFORMED["unknown_op"])
        with pytest.raises(MeasurementError, match="unknown op"):
            session.control.receive()
        assert session.udp_stats(1, 0)["op"] == "udp_stats"


def test_wrong_secret_is_refused(secret_server: ProbeServer) -> None:
    port = secret_server.tcp_port
    with pytest.raises(MeasurementError, match="wrong secret"):
        ProbeSession("127.0.0.1", port, b"guess").open()
    with pytest.raises(MeasurementError, match="requires a shared secret"):
        ProbeSession("127.0.0.1", port, None).open()
    # The server itself refuses a frame signed with the wrong key, then hangs up.
    sock, nonce = _raw(secret_server)
    with sock:
        sock.sendall(proto.encode_frame({"op": "hello"}, b"guess", nonce))
        reply = _read_reply(sock, b"s3cret", nonce)
        assert reply["op"] == "error" and "authentication" in reply["message"]
        assert sock.recv(1) == b""
    assert not secret_server.sessions


def test_right_secret_signs_control_and_probes(secret_server: ProbeServer) -> None:
    opts = ProbeOptions(
        target=_target(secret_server), secret=b"s3cret", **FAST, phases=("latency", "chunks")
    )
    report = probe_link(opts)
    assert report["loss"]["up"] == 0 and report["rtt_ms"]["samples"] == 80


def test_a_run_needing_more_streams_than_granted_fails_before_measuring(
    probe_server: ProbeServer,
) -> None:
    seen: list[str] = []
    opts = ProbeOptions(target=_target(probe_server), **{**FAST, "streams": 8},
                        phases=("latency", "throughput"))  # fmt: skip
    needs = r"4 data connections at once, the probe needs 8 \(--streams\); a server without"
    with pytest.raises(MeasurementError, match=needs):
        probe_link(opts, lambda phase, message: seen.append(phase))
    assert seen == []  # refused on the hello's reply: no phase ran


def test_a_session_planning_little_gets_little(probe_server: ProbeServer) -> None:
    plan = ProbePlan(streams=1, seconds=0.001)  # 5 MB at 40 Gbit/s
    with ProbeSession("127.0.0.1", probe_server.tcp_port, None, plan=plan) as session:
        assert session.budget == {"data_connections": 1, "bytes": 5_000_000,
                                  "authenticated": False, "capped": False}  # fmt: skip
        with session.open_data("source", duration_s=5, max_bytes=10**9) as conn:
            conn.sock.settimeout(10)
            got = sum(iter(lambda: len(conn.sock.recv(1 << 20)), 0))
        assert got == 5_000_000
        with pytest.raises(MeasurementError, match=r"moved its budget of 0\.005 GB"):
            session.open_data("sink", duration_s=1, max_bytes=1)


def test_secret_server_ignores_unsigned_probes(secret_server: ProbeServer) -> None:
    with ProbeSession("127.0.0.1", secret_server.tcp_port, b"s3cret") as session:
        forged = proto.pack_probe(proto.Probe(0, 1, session.session_id, 0, 1), None)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.settimeout(0.3)
            udp.sendto(forged, ("127.0.0.1", session.udp_port))
            with pytest.raises(TimeoutError):
                udp.recv(2048)
        assert session.udp_stats(1, 1)["received"] == 0


def test_reflector_answers_only_live_sessions(probe_server: ProbeServer) -> None:
    session = ProbeSession("127.0.0.1", probe_server.tcp_port, None).open()
    sid, port = session.session_id, session.udp_port
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.settimeout(0.5)
        udp.sendto(proto.pack_probe(proto.Probe(0, 1, sid, 0, 1), None), ("127.0.0.1", port))
        assert proto.unpack_probe(udp.recv(2048), None).kind == proto.KIND_REPLY
        session.close()
        deadline = time.monotonic() + 5
        while sid in probe_server.sessions and time.monotonic() < deadline:
            time.sleep(0.01)
        udp.settimeout(0.3)
        udp.sendto(proto.pack_probe(proto.Probe(0, 1, sid, 1, 1), None), ("127.0.0.1", port))
        with pytest.raises(TimeoutError):
            udp.recv(2048)


class LossyRelay:
    """A real UDP relay that drops probes by sequence number, per direction."""

    def __init__(self, server_port: int, drop_up: set[int], drop_down: set[int]) -> None:
        self.front = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.front.bind(("127.0.0.1", 0))
        self.back = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.back.connect(("127.0.0.1", server_port))
        self.drop_up, self.drop_down = drop_up, drop_down
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.port = self.front.getsockname()[1]

    @staticmethod
    def _seq(data: bytes) -> int:
        return int(struct.unpack_from("!Q", data, 16)[0])

    def _run(self) -> None:
        client: Any = None
        deadline = time.monotonic() + 30  # bounded even if a test forgets to stop it
        while not self.stop.is_set() and time.monotonic() < deadline:
            ready, _, _ = select.select([self.front, self.back], [], [], 0.05)
            if self.front in ready:
                data, client = self.front.recvfrom(65535)
                if self._seq(data) % 10 not in self.drop_up:
                    self.back.send(data)
            if self.back in ready:
                data = self.back.recv(65535)
                if client is not None and self._seq(data) % 10 not in self.drop_down:
                    self.front.sendto(data, client)

    def __enter__(self) -> LossyRelay:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.front.close()
        self.back.close()


@pytest.fixture
def lossy(probe_server: ProbeServer) -> Iterator[LossyRelay]:
    with LossyRelay(probe_server.udp_port, drop_up={3, 4}, drop_down={5}) as relay:
        yield relay


def test_loss_is_split_into_upstream_and_downstream(
    probe_server: ProbeServer, lossy: LossyRelay
) -> None:
    with ProbeSession("127.0.0.1", probe_server.tcp_port, None) as session:
        session.udp_port = lossy.port  # route the probes through the lossy relay
        run = phases.run_probes(session, stream=1, duration_s=0.4, interval_ms=2, drain_s=1.0)
    result = phases.summarize_probes(run)
    loss = result.loss
    assert loss["probes"] == 200
    assert loss["up_count"] == 40 and loss["up"] == pytest.approx(20.0)
    assert loss["down_count"] == 20 and loss["down"] == pytest.approx(12.5)
    assert loss["bursts"] == 20 and loss["max_burst"] == 3  # seqs x3, x4 up + x5 down
    assert loss["up_ci95"][0] < 20.0 < loss["up_ci95"][1]
    assert result.rtt_ms["samples"] == 140


def test_server_caps_test_duration_and_bytes(probe_server: ProbeServer) -> None:
    with ProbeSession("127.0.0.1", probe_server.tcp_port, None) as session:
        conn = session.open_data("source", duration_s=3600, max_bytes=3 * 1024 * 1024)
        with conn:
            got = 0
            conn.sock.settimeout(15)
            while piece := conn.sock.recv(1 << 20):
                got += len(piece)
        assert got == 3 * 1024 * 1024
        raw = FrameConnection.connect("127.0.0.1", probe_server.tcp_port, None, 5)
        reply = raw.request(
            {
                "op": "data",
                "session": session.session_id.hex(),
                "mode": "sink",
                "duration_s": 3600,
                "max_bytes": 10,
            }
        )
        raw.close()
        assert reply["duration_s"] == probe_server.limits.max_test_s


def test_oversized_chunk_is_refused(probe_server: ProbeServer) -> None:
    with ProbeSession("127.0.0.1", probe_server.tcp_port, None) as session:
        conn = session.open_data("chunks", duration_s=5, max_bytes=1 << 40)
        with conn:
            conn.sock.sendall(proto.CHUNK_HEADER.pack(probe_server.limits.max_chunk_bytes + 1))
            with pytest.raises(MeasurementError, match="exceeds the limit"):
                conn.receive()


def test_unreachable_server_is_a_measurement_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: connection refused
        with pytest.raises(MeasurementError, match="cannot reach"):
            probe_link(ProbeOptions(target=f"127.0.0.1:{port}", **FAST))
