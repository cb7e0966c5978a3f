"""KV chunk sweep: how fast KV-sized messages cross the link, over a pluggable transport.

A :class:`ChunkTransport` sends length-delimited chunks and reports each receiver
acknowledgement with its arrival time. The sweep keeps ``window`` chunks in flight
(back-to-back sending), times each chunk from the start of its send to its acknowledgement,
and recommends the smallest chunk size that reaches 90 % of the best goodput (``probe-link``
with a TTFT budget chooses only among the sizes that pass its ``chunk_p99`` rule). Plain TCP
framing through the probe server is the built-in transport; other transports (for example
the KV gRPC path) register a factory under a name.
"""

from __future__ import annotations

import abc
import contextlib
import math
import os
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pdx.errors import InputError, MeasurementError
from pdx.link import protocol as proto
from pdx.link import stats
from pdx.link.client import FrameConnection, ProbeSession
from pdx.units import MIB, bytes_per_s_to_gbps


@dataclass(frozen=True)
class ChunkAck:
    """The receiver confirmed a whole chunk of ``chunk_bytes`` at ``at_s`` (perf_counter)."""

    chunk_bytes: int
    at_s: float


class ChunkTransport(abc.ABC):
    """A way to move KV chunks to a receiver that acknowledges each one, in order."""

    name = "abstract"

    @abc.abstractmethod
    def open(self, *, duration_s: float, max_bytes: int) -> None:
        """Connect; the receiver may stop after ``duration_s`` or ``max_bytes``."""

    @abc.abstractmethod
    def send_chunk(self, payload: memoryview) -> None:
        """Send one chunk; may return before it is delivered."""

    @abc.abstractmethod
    def next_ack(self, timeout_s: float) -> ChunkAck:
        """Block until the oldest unacknowledged chunk is confirmed."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the connection."""

    def details(self) -> dict[str, Any]:
        """What this transport did besides timing (e.g. TLS, objects released); optional."""
        return {}


ChunkTransportFactory = Callable[[ProbeSession], ChunkTransport]
_TRANSPORTS: dict[str, ChunkTransportFactory] = {}


def register_chunk_transport(name: str, factory: ChunkTransportFactory) -> None:
    """Make a transport available to ``probe-link --chunk-transport NAME``."""
    _TRANSPORTS[name] = factory


@contextlib.contextmanager
def chunk_transport_registered(name: str, factory: ChunkTransportFactory) -> Iterator[None]:
    """Register ``factory`` under ``name`` inside a ``with`` block; restore the old one after."""
    _register_builtins()
    previous = _TRANSPORTS.get(name)
    _TRANSPORTS[name] = factory
    try:
        yield
    finally:
        if previous is None:
            _TRANSPORTS.pop(name, None)
        else:
            _TRANSPORTS[name] = previous


def chunk_transport_names() -> list[str]:
    """Names of the registered chunk transports."""
    _register_builtins()
    return sorted(_TRANSPORTS)


def get_chunk_transport(name: str) -> ChunkTransportFactory:
    """Factory of a registered transport, or an :class:`InputError` naming the choices."""
    _register_builtins()
    try:
        return _TRANSPORTS[name]
    except KeyError:
        raise InputError("--chunk-transport", name, f"one of {chunk_transport_names()}") from None


class TcpChunkTransport(ChunkTransport):
    """Chunks as ``u64 length | payload`` on a probe-server data connection; acks are ``u64``."""

    name = "tcp"

    def __init__(self, session: ProbeSession) -> None:
        self.session = session
        self.conn: FrameConnection | None = None
        self.acks: queue.Queue[ChunkAck | BaseException] = queue.Queue()
        self.reader: threading.Thread | None = None

    def open(self, *, duration_s: float, max_bytes: int) -> None:
        self.conn = self.session.open_data("chunks", duration_s=duration_s, max_bytes=max_bytes)
        self.conn.sock.settimeout(None)
        self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Acks are read and stamped on their own thread so a blocked send never delays them.
        self.reader = threading.Thread(target=self._read_acks, daemon=True)
        self.reader.start()

    def _read_acks(self) -> None:
        assert self.conn is not None
        sock = self.conn.sock
        size = proto.CHUNK_HEADER.size
        try:
            while True:
                data = b""
                while len(data) < size:
                    piece = sock.recv(size - len(data))
                    if not piece:
                        raise MeasurementError("chunk receiver closed the connection")
                    data += piece
                (n,) = proto.CHUNK_HEADER.unpack(data)
                self.acks.put(ChunkAck(n, time.perf_counter()))
        except (OSError, MeasurementError) as exc:
            self.acks.put(exc)

    def send_chunk(self, payload: memoryview) -> None:
        assert self.conn is not None
        try:
            self.conn.sock.sendall(proto.CHUNK_HEADER.pack(len(payload)))
            self.conn.sock.sendall(payload)
        except OSError as exc:
            raise MeasurementError(f"chunk send failed: {exc}") from None

    def next_ack(self, timeout_s: float) -> ChunkAck:
        try:
            item = self.acks.get(timeout=timeout_s)
        except queue.Empty:
            raise MeasurementError(f"no chunk acknowledgement within {timeout_s:.1f} s") from None
        if isinstance(item, BaseException):
            raise MeasurementError(f"chunk transfer failed: {item}")
        return item

    def close(self) -> None:
        if self.conn is not None:
            # shutdown, not just close: it wakes the ack reader blocked in recv() and sends
            # FIN now (a plain close waits for that recv, so the server would keep the
            # connection, one of its session's data connections, until its deadline)
            with contextlib.suppress(OSError):
                self.conn.sock.shutdown(socket.SHUT_RDWR)
            self.conn.close()
            self.conn = None
        if self.reader is not None:
            self.reader.join(5.0)
            self.reader = None


def _grpc_needs_a_store(session: ProbeSession) -> ChunkTransport:
    # Placeholder until pdx.link.kv_transport.kv_chunk_transport() names a KV store.
    raise InputError("--kv-target", None, "HOST:PORT of a KV store for --chunk-transport grpc")


def _register_builtins() -> None:
    _TRANSPORTS.setdefault("tcp", TcpChunkTransport)
    _TRANSPORTS.setdefault("grpc", _grpc_needs_a_store)


@dataclass
class ChunkResult:
    """Goodput and per-chunk time (send start to receiver acknowledgement) for one size."""

    chunk_bytes: int
    gbps: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    count: int
    transport: str = "tcp"
    transport_detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class ChunkSweep:
    """All sizes of a sweep and the recommended size."""

    transport: str
    window: int
    chunks: list[ChunkResult]
    recommended_bytes: int | None


def measure_chunk_size(
    transport: ChunkTransport,
    payload: memoryview,
    *,
    seconds: float,
    window: int,
    max_chunks: int,
    warmup_bytes: int = 2 * MIB,
) -> ChunkResult:
    """Send chunks back-to-back for ``seconds`` (at most ``max_chunks``) and time each one."""
    size = len(payload)
    warmup = max(1, math.ceil(warmup_bytes / size))
    budget = warmup + max_chunks
    transport.open(duration_s=seconds + 30.0, max_bytes=size * budget + 1)
    try:
        starts: deque[float] = deque()
        times_s: list[float] = []
        first_start = last_ack = 0.0
        sent = done = 0
        deadline = math.inf
        while done < sent or sent == 0 or (sent < budget and time.perf_counter() < deadline):
            can_send = sent < budget and time.perf_counter() < deadline
            if can_send and len(starts) < window:
                now = time.perf_counter()
                if sent == warmup:
                    first_start, deadline = now, now + seconds
                starts.append(now)
                transport.send_chunk(payload)
                sent += 1
                continue
            ack = transport.next_ack(timeout_s=30.0)
            started = starts.popleft()
            if done >= warmup:
                times_s.append(ack.at_s - started)
                last_ack = ack.at_s
            done += 1
    finally:
        transport.close()
    if not times_s:
        raise MeasurementError(f"no {size}-byte chunk completed after warm-up")
    elapsed = max(last_ack - first_start, 1e-9)
    summary = stats.summarize([t * 1e3 for t in times_s])
    return ChunkResult(
        chunk_bytes=size,
        gbps=bytes_per_s_to_gbps(size * len(times_s) / elapsed),
        p50_ms=summary.p50,
        p99_ms=summary.p99,
        max_ms=summary.max,
        count=len(times_s),
        transport=transport.name,
        transport_detail=transport.details(),
    )


CHUNK_GOODPUT_SHARE = 0.9
"""A chunk size is recommended when its goodput is within this share of the best size's."""


def recommend_chunk(
    chunks: Sequence[ChunkResult], share: float = CHUNK_GOODPUT_SHARE
) -> int | None:
    """Smallest chunk size whose goodput is at least ``share`` of the best size's."""
    return choose_chunk([asdict(c) for c in chunks], share=share)


def choose_chunk(
    rows: Sequence[Mapping[str, Any]],
    *,
    max_p99_ms: float | None = None,
    share: float = CHUNK_GOODPUT_SHARE,
) -> int | None:
    """The chunk size to use, from ``chunks[]`` rows of a report: among the sizes whose p99 is
    within ``max_p99_ms`` (every size when None), the smallest whose goodput is at least
    ``share`` of the best of them. None when no size qualifies."""
    fit = [r for r in rows if max_p99_ms is None or r["p99_ms"] <= max_p99_ms]
    if not fit:
        return None
    best = max(float(r.get("gbps") or 0.0) for r in fit)
    return min(int(r["chunk_bytes"]) for r in fit if float(r.get("gbps") or 0.0) >= share * best)


def run_chunk_sweep(
    session: ProbeSession,
    sizes: Sequence[int],
    *,
    transport: str = "tcp",
    seconds: float = 1.0,
    window: int = 2,
    max_chunks: int = 400,
    on_size: Callable[[ChunkResult], None] | None = None,
) -> ChunkSweep:
    """Measure every size in ``sizes`` over the named transport."""
    factory = get_chunk_transport(transport)
    payload = memoryview(os.urandom(max(sizes)))
    results = []
    for size in sizes:
        result = measure_chunk_size(
            factory(session),
            payload[:size],
            seconds=seconds,
            window=window,
            max_chunks=max_chunks,
        )
        results.append(result)
        if on_size is not None:
            on_size(result)
    return ChunkSweep(transport, window, results, recommend_chunk(results))
