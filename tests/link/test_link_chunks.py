"""KV chunk sweep: the TCP transport, and the sweep over another registered transport."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from pdx.errors import InputError
from pdx.link import protocol as proto
from pdx.link.chunks import (
    ChunkAck,
    ChunkResult,
    ChunkTransport,
    TcpChunkTransport,
    chunk_transport_names,
    measure_chunk_size,
    recommend_chunk,
    register_chunk_transport,
    run_chunk_sweep,
)
from pdx.link.client import ProbeSession
from pdx.link.server import ProbeServer
from pdx.units import KIB


def test_tcp_transport_times_every_chunk(probe_server: ProbeServer) -> None:
    with ProbeSession("127.0.0.1", probe_server.tcp_port, None) as session:
        payload = memoryview(bytes(128 * KIB))
        result = measure_chunk_size(
            TcpChunkTransport(session), payload, seconds=5.0, window=1, max_chunks=20
        )
    assert result.count == 20
    assert result.chunk_bytes == 128 * KIB
    assert 0 < result.p50_ms <= result.p99_ms <= result.max_ms
    assert result.gbps > 0


class _AckingListener:
    """A separate real TCP receiver with its own framing: ``u32 length | payload`` -> ``b'k'``."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(10)
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(10)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while header := conn.recv(4, socket.MSG_WAITALL):
                    left = int.from_bytes(header, "big")
                    while left:
                        left -= len(conn.recv(min(left, 1 << 20)))
                    conn.sendall(b"k")


class _OtherTransport(ChunkTransport):
    name = "other"

    def __init__(self, port: int, sizes: list[int]) -> None:
        self.port = port
        self.sizes = sizes

    def open(self, *, duration_s: float, max_bytes: int) -> None:
        self.conn = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send_chunk(self, payload: memoryview) -> None:
        self.conn.sendall(len(payload).to_bytes(4, "big"))
        self.conn.sendall(payload)
        self.sizes.append(len(payload))

    def next_ack(self, timeout_s: float) -> ChunkAck:
        assert self.conn.recv(1) == b"k"
        return ChunkAck(self.sizes.pop(0), time.perf_counter())

    def close(self) -> None:
        self.conn.close()


def test_the_sweep_runs_over_any_registered_transport(probe_server: ProbeServer) -> None:
    listener = _AckingListener()
    sizes: list[int] = []
    try:
        register_chunk_transport("other", lambda session: _OtherTransport(listener.port, sizes))
        assert {"tcp", "other"} <= set(chunk_transport_names())
        with ProbeSession("127.0.0.1", probe_server.tcp_port, None) as session:
            sweep = run_chunk_sweep(
                session, [16 * KIB, 64 * KIB], transport="other", seconds=0.1, window=1
            )
    finally:
        listener.sock.close()
    assert sweep.transport == "other"
    assert [c.chunk_bytes for c in sweep.chunks] == [16 * KIB, 64 * KIB]
    assert all(c.count > 0 for c in sweep.chunks)


def test_unknown_transport_names_the_choices() -> None:
    with pytest.raises(InputError, match="tcp"):
        run_chunk_sweep(ProbeSession("127.0.0.1", 1, None), [1024], transport="carrier-pigeon")


def test_recommendation_is_the_smallest_size_near_the_best_goodput() -> None:
    def row(size: int, gbps: float) -> ChunkResult:
        return ChunkResult(size, gbps, 1.0, 2.0, 3.0, 10)

    assert recommend_chunk([row(1, 5.0), row(2, 9.2), row(4, 10.0), row(8, 9.9)]) == 2
    assert recommend_chunk([row(1, 5.0), row(2, 8.0), row(4, 10.0)]) == 4
    assert recommend_chunk([]) is None


def test_chunk_header_is_eight_bytes() -> None:
    assert proto.CHUNK_HEADER.size == 8
