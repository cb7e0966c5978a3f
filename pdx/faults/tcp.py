"""TCP forwarding with toxics: one connection = two pipes (upstream, downstream).

Each pipe forwards chunks from a source socket to a destination socket. With no toxic, no
queued data and the link up, bytes go straight through (spliced in the kernel when possible,
see :mod:`pdx.faults.sockio`: the fast path). Otherwise chunks pass through the arrival toxics
(latency, stall, corrupt, timeout, limit_data), wait in a queue until their release time, and
a writer task sends them through the sending toxics (bandwidth, slicer). Written by hand
because no library provides per-chunk, order-preserving, runtime-changeable TCP faults on
asyncio.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
from collections import deque
from typing import Protocol

from pdx.faults import toxics as tx
from pdx.faults.metrics import ProxyMetrics
from pdx.faults.sockio import SockIO

QUEUE_HIGH_BYTES = 8 * 1024 * 1024
QUEUE_LOW_BYTES = 6 * 1024 * 1024
_COARSE_SLEEP_S = 0.0015  # epoll rounds timeouts up to 1 ms; poll the loop for the rest


async def sleep_until(loop: asyncio.AbstractEventLoop, when: float) -> None:
    """Sleep until monotonic ``when``, never before it and ~20 µs after it on an idle host.

    A loop timer alone wakes up to 1 ms late (epoll rounds to whole ms). Waking 1.5 ms early
    and polling the loop for the rest fixes that; a busy host can still add the time the
    process waits for a CPU, which the proxy measures and reports (``timer_lateness_ms``).
    """
    early = when - _COARSE_SLEEP_S
    if early > loop.time():
        await asyncio.sleep(early - loop.time())
    while loop.time() < when:
        await asyncio.sleep(0)


def jitter_sample(rng: random.Random, toxic: tx.Latency) -> float:
    """One latency sample in seconds: ``latency ± jitter`` (uniform or normal σ=jitter), ≥ 0."""
    if toxic.jitter_ms == 0:
        return toxic.latency_ms / 1e3
    if toxic.jitter_dist == "normal":
        offset_ms = rng.gauss(0.0, toxic.jitter_ms)
    else:
        offset_ms = rng.uniform(-toxic.jitter_ms, toxic.jitter_ms)
    return max(0.0, toxic.latency_ms + offset_ms) / 1e3


def flip_bytes(data: bytes, positions: list[int], rng: random.Random) -> bytes:
    """``data`` with each byte at ``positions`` XOR-ed with a random non-zero mask."""
    buf = bytearray(data)
    for pos in positions:
        buf[pos] ^= rng.randrange(1, 256)
    return bytes(buf)


def os_reason(exc: OSError) -> str:
    """``Connection refused`` rather than asyncio's ``Connect call failed (...)``."""
    if exc.errno:
        return os.strerror(exc.errno)
    return exc.strerror or str(exc)


class ProxyHooks(Protocol):
    """What the TCP and UDP forwarding code uses of its proxy (a ``FaultProxy`` provides it)."""

    @property
    def metrics(self) -> ProxyMetrics:
        """The proxy's counters."""

    @property
    def upstream(self) -> tuple[str, int]:
        """Where traffic is forwarded."""

    @property
    def upstream_errors(self) -> list[str]:
        """Failed upstream connects, appended to as they happen."""

    @property
    def link_blocked(self) -> bool:
        """The link is down: nothing is forwarded."""

    @property
    def link_refusing(self) -> bool:
        """The link is down in ``reset`` mode: new connections are reset at once."""

    @property
    def link_clear(self) -> asyncio.Event:
        """Set while the link is up."""

    @property
    def connections(self) -> set[TcpConnection]:
        """Open TCP connections; each adds itself on start and removes itself when closed."""

    def attach_toxics(self, conn: TcpConnection) -> None:
        """Give a new connection every current toxic."""


class ToxicState:
    """A toxic acting on one pipe: its spec plus per-pipe state (bucket, offsets, timers)."""

    def __init__(self, toxic: tx.Toxic, rng: random.Random) -> None:
        self.toxic = toxic
        seed = getattr(toxic, "seed", None)
        self.rng = random.Random(seed) if seed is not None else rng
        self.seen_bytes = 0  # bytes passed since attach (corrupt offset, limit_data)
        self.fired = False
        self.next_free_s = 0.0  # bandwidth: virtual finish time of the last byte sent
        self.timer: asyncio.TimerHandle | None = None

    def cancel(self) -> None:
        """Stop pending timers (reset_peer, timeout close)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class Pipe:
    """One direction of a TCP connection: reads from ``src``, writes to ``dst``."""

    def __init__(self, conn: TcpConnection, direction: str) -> None:
        self.conn = conn
        self.proxy = conn.proxy
        self.direction = direction
        self.loop = conn.loop
        self.src: SockIO | None = None
        self.dst: SockIO | None = None
        self.states: list[ToxicState] = []
        self.queue: deque[tuple[float, bytes]] = deque()
        self.queued_bytes = 0
        self.last_release = 0.0
        self.busy = False
        self.eof_pending = False
        self.eof_done = False
        self.close_after_queue = False
        self.dead = False
        self.dst_writable = asyncio.Event()
        self.dst_writable.set()
        self.wake = asyncio.Event()
        self.writer: asyncio.Task[None] | None = None
        self.pause_reasons: set[str] = set()

    # -- flow control ---------------------------------------------------------------------------
    def pause_src(self, reason: str) -> None:
        """Stop reading the source for ``reason`` (dst full, queue full, link down)."""
        if not self.pause_reasons and self.src is not None and not self.src.is_closing():
            self.src.pause_reading()
        self.pause_reasons.add(reason)

    def resume_src(self, reason: str) -> None:
        """Drop one pause reason; read again when none is left."""
        if reason not in self.pause_reasons:
            return
        self.pause_reasons.discard(reason)
        if not self.pause_reasons and self.src is not None and not self.src.is_closing():
            self.src.resume_reading()

    def dst_pause(self) -> None:
        """The destination's write buffer is full."""
        self.dst_writable.clear()
        self.pause_src("dst")

    def dst_resume(self) -> None:
        """The destination drained its write buffer."""
        self.dst_writable.set()
        self.resume_src("dst")

    # -- arrival --------------------------------------------------------------------------------
    def fast_path(self) -> bool:
        """True when a chunk can be written at once: no toxic, nothing queued, link up."""
        return (
            not self.states
            and not self.queue
            and not self.busy
            and not self.proxy.link_blocked
            and not self.eof_pending
            and self.dst is not None
        )

    def feed(self, data: bytes) -> None:
        """A chunk arrived from the source."""
        if self.dead:
            return
        self.proxy.metrics.traffic(self.direction, len(data))
        if self.fast_path():
            self.dst.write(data)  # type: ignore[union-attr]
            return
        now = self.loop.time()
        delay_s = 0.0
        chunk = data
        for state in list(self.states):
            out, extra_s = self._arrive(state, chunk, now)
            delay_s += extra_s
            if out is None:
                return
            chunk = out
        release = max(now + delay_s, self.last_release)
        self.last_release = release
        self._enqueue(release, chunk)

    def _enqueue(self, release: float, chunk: bytes) -> None:
        self.queue.append((release, chunk))
        self.queued_bytes += len(chunk)
        if self.queued_bytes > QUEUE_HIGH_BYTES:
            self.pause_src("queue")
        self.kick()

    def _arrive(self, state: ToxicState, chunk: bytes, now: float) -> tuple[bytes | None, float]:
        """Apply one arrival toxic; returns the chunk (None = dropped) and extra delay."""
        toxic = state.toxic
        n = len(chunk)
        if isinstance(toxic, tx.Latency):
            self._count(toxic, n)
            return chunk, jitter_sample(state.rng, toxic)
        if isinstance(toxic, tx.Stall):
            if state.rng.random() < toxic.probability:
                self._count(toxic, n)
                return chunk, toxic.duration_ms / 1e3
            return chunk, 0.0
        if isinstance(toxic, tx.Timeout):
            self._count(toxic, n)
            return None, 0.0
        if isinstance(toxic, tx.Corrupt):
            return self._corrupt(state, toxic, chunk), 0.0
        if isinstance(toxic, tx.LimitData):
            return self._limit(state, toxic, chunk), 0.0
        return chunk, 0.0

    def _corrupt(self, state: ToxicState, toxic: tx.Corrupt, chunk: bytes) -> bytes:
        start = state.seen_bytes
        state.seen_bytes += len(chunk)
        positions: list[int] = []
        if toxic.offset is not None and not state.fired:
            first = max(toxic.offset, start)
            last = min(toxic.offset + toxic.nbytes, start + len(chunk))
            positions = [p - start for p in range(first, last)]
            if toxic.offset + toxic.nbytes <= start + len(chunk):
                state.fired = True
        elif toxic.offset is None and state.rng.random() < toxic.probability:
            count = min(toxic.nbytes, len(chunk))
            positions = state.rng.sample(range(len(chunk)), count)
        if not positions:
            return chunk
        self._count(toxic, len(positions))
        return flip_bytes(chunk, positions, state.rng)

    def _limit(self, state: ToxicState, toxic: tx.LimitData, chunk: bytes) -> bytes:
        room = toxic.bytes - state.seen_bytes
        state.seen_bytes += len(chunk)
        if room > len(chunk):
            return chunk
        self._count(toxic, len(chunk) - max(room, 0))
        self.close_after_queue = True
        self.pause_src("limit")
        return chunk[: max(room, 0)]

    def _count(self, toxic: tx.Toxic, nbytes: int) -> None:
        self.proxy.metrics.affected(toxic.name, toxic.type, self.direction, nbytes)

    def feed_eof(self) -> None:
        """The source half-closed (FIN)."""
        if self.dead or self.eof_pending:
            return
        self.eof_pending = True
        self.kick()

    # -- sending --------------------------------------------------------------------------------
    def kick(self) -> None:
        """Wake the writer, starting it on first use."""
        if self.dead:
            return
        if self.writer is None:
            self.writer = self.loop.create_task(self._run_writer())
        self.wake.set()

    async def _run_writer(self) -> None:
        try:
            while not self.dead:
                if not self.queue:
                    if self._eof_ready():
                        await self._deliver_eof()
                        return
                    self.wake.clear()
                    await self.wake.wait()
                    continue
                await self._send_head()
        except (ConnectionError, OSError):
            self.conn.close(reset=True)

    def _eof_ready(self) -> bool:
        blackholed = any(isinstance(s.toxic, tx.Timeout) for s in self.states)
        return (self.eof_pending or self.close_after_queue) and not blackholed

    async def _send_head(self) -> None:
        release, chunk = self.queue[0]
        if release > self.loop.time():
            if len(self.queue) > 1:  # a backlog: per-chunk precision buys nothing, save the CPU
                await asyncio.sleep(release - self.loop.time())
            else:
                await sleep_until(self.loop, release)
        if len(self.queue) == 1:
            self.proxy.metrics.lateness(max(0.0, self.loop.time() - release))
        await self.proxy.link_clear.wait()
        self.busy = True
        self.queue.popleft()
        self.queued_bytes -= len(chunk)
        if self.queued_bytes < QUEUE_LOW_BYTES:
            self.resume_src("queue")
        try:
            await self._write(chunk, release)
        finally:
            self.busy = False

    async def _write(self, chunk: bytes, arrived: float) -> None:
        """Write through the sending toxics: bandwidth pacing, then slicing."""
        bucket = self._first(tx.Bandwidth)
        slicer = self._first(tx.Slicer)
        pieces = [chunk] if bucket is None else self._rate_pieces(bucket, chunk)
        for piece in pieces:
            if bucket is not None:
                await self._pace(bucket, len(piece), arrived)
            if slicer is not None:
                await self._sliced(slicer, piece)
            else:
                await self._raw_write(piece)

    def _first(self, kind: type) -> ToxicState | None:
        for state in self.states:
            if isinstance(state.toxic, kind):
                return state
        return None

    @staticmethod
    def _rate_pieces(state: ToxicState, chunk: bytes) -> list[bytes]:
        rate = state.toxic.rate_mbps * 1e6 / 8  # type: ignore[union-attr]
        size = max(1024, int(rate * 0.002))
        if len(chunk) <= size:
            return [chunk]
        view = memoryview(chunk)
        return [bytes(view[i : i + size]) for i in range(0, len(chunk), size)]

    async def _pace(self, state: ToxicState, nbytes: int, arrived: float) -> None:
        """Token bucket kept as a virtual finish time, driven by arrival times.

        Data that arrived while earlier data was still being paced is sent back to back at
        ``rate``; after an idle gap the bucket allows ``burst_bytes``. Basing the schedule on
        arrival (not on when this task woke up) keeps the average rate exact when the
        process is descheduled for a while.
        """
        toxic: tx.Bandwidth = state.toxic  # type: ignore[assignment]
        rate = toxic.rate_mbps * 1e6 / 8
        burst_s = toxic.burst_bytes / rate
        state.next_free_s = max(state.next_free_s, arrived - burst_s) + nbytes / rate
        send_at = state.next_free_s - burst_s
        self._count(toxic, nbytes)
        now = self.loop.time()
        if send_at > now:
            await asyncio.sleep(send_at - now)

    async def _sliced(self, state: ToxicState, piece: bytes) -> None:
        toxic: tx.Slicer = state.toxic  # type: ignore[assignment]
        pos = 0
        while pos < len(piece):
            size = toxic.average_size + state.rng.randint(
                -toxic.size_variation, toxic.size_variation
            )
            await self._raw_write(piece[pos : pos + size])
            self._count(toxic, min(size, len(piece) - pos))
            pos += size
            if toxic.delay_us > 0 and pos < len(piece):
                await asyncio.sleep(toxic.delay_us / 1e6)

    async def _raw_write(self, data: bytes) -> None:
        await self.dst_writable.wait()
        if self.dst is None or self.dst.is_closing():
            raise ConnectionResetError("destination closed")
        self.dst.write(data)

    async def _deliver_eof(self) -> None:
        slow = self._first(tx.SlowClose)
        if slow is not None:
            self._count(slow.toxic, 0)
            await asyncio.sleep(slow.toxic.delay_ms / 1e3)  # type: ignore[union-attr]
        if self.close_after_queue:
            self.conn.close()
            return
        self.eof_done = True
        if self.dst is not None and not self.dst.is_closing() and self.dst.can_write_eof():
            self.dst.write_eof()
        self.conn.check_done()

    def stop(self) -> None:
        """Discard queued data and stop the writer."""
        self.dead = True
        self.queue.clear()
        for state in self.states:
            state.cancel()
        if self.writer is not None and self.writer is not asyncio.current_task():
            self.writer.cancel()


class TcpConnection:
    """A client connection and its upstream connection, joined by two pipes."""

    def __init__(self, proxy: ProxyHooks) -> None:
        self.proxy = proxy
        self.loop = asyncio.get_running_loop()
        self.up = Pipe(self, "upstream")
        self.down = Pipe(self, "downstream")
        self.client: SockIO | None = None
        self.upstream: SockIO | None = None
        self.closed = False
        self.lost: set[str] = set()
        self.connect_task: asyncio.Task[None] | None = None

    def out_of(self, side: str) -> Pipe:
        """The pipe that reads from ``side``."""
        return self.up if side == "client" else self.down

    def into(self, side: str) -> Pipe:
        """The pipe that writes to ``side``."""
        return self.down if side == "client" else self.up

    # -- SockIO callbacks -------------------------------------------------------------------------
    def on_data(self, side: str, data: bytes) -> None:
        """Bytes read from ``side``."""
        self.out_of(side).feed(data)

    def on_spliced(self, side: str, nbytes: int) -> None:
        """Bytes moved from ``side`` to the other socket without a copy."""
        self.proxy.metrics.traffic(self.out_of(side).direction, nbytes)

    def on_eof(self, side: str) -> None:
        """``side`` half-closed."""
        self.out_of(side).feed_eof()

    def on_error(self, side: str, exc: OSError) -> None:
        """A socket error (reset, broken pipe): reset the other side too."""
        self.close(reset=True)

    def on_closed(self, side: str) -> None:
        """A socket is closed for good."""
        self.lost.add(side)
        if not self.closed:
            self.close()
        self._maybe_forget()

    def on_write_paused(self, side: str) -> None:
        """``side`` has too much queued for sending."""
        self.into(side).dst_pause()

    def on_write_resumed(self, side: str) -> None:
        """``side`` drained its send queue."""
        self.into(side).dst_resume()

    def splice_target(self, side: str) -> SockIO | None:
        """Where bytes read from ``side`` may be spliced (None = they must pass the toxics)."""
        pipe = self.out_of(side)
        return pipe.dst if pipe.fast_path() else None

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self, sock: socket.socket) -> None:
        """Take an accepted client socket; connect upstream unless the link refuses."""
        self.client = SockIO(self, "client", sock)
        self.up.src = self.down.dst = self.client
        self.proxy.metrics.connection_opened()
        self.proxy.connections.add(self)
        if self.proxy.link_refusing:
            self.proxy.metrics.connections_refused += 1
            self.close(reset=True)
            return
        self.up.pause_reasons.add("connect")
        self.proxy.attach_toxics(self)
        self.connect_task = self.loop.create_task(self._connect())

    async def _connect(self) -> None:
        await self.proxy.link_clear.wait()
        host, port = self.proxy.upstream
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await self.loop.sock_connect(sock, (host, port))
        except OSError as exc:
            sock.close()
            self.proxy.upstream_errors.append(f"{host}:{port}: {os_reason(exc)}")
            self.close(reset=True)
            return
        except asyncio.CancelledError:
            sock.close()
            raise
        self.upstream = SockIO(self, "upstream", sock)
        self.down.src = self.up.dst = self.upstream
        if not self.down.pause_reasons:
            self.upstream.resume_reading()
        self.up.resume_src("connect")

    def check_done(self) -> None:
        """Both directions delivered their EOF: close the connection."""
        if self.up.eof_done and self.down.eof_done:
            self.close()

    def close(
        self, *, reset: bool = False, reset_client: bool = False, reset_upstream: bool = False
    ) -> None:
        """Close both sockets (RST where asked), stop pipes and timers; idempotent."""
        if self.closed:
            return
        self.closed = True
        self.up.stop()
        self.down.stop()
        if self.connect_task is not None and not self.connect_task.done():
            self.connect_task.cancel()
        sides = ((self.client, reset or reset_client), (self.upstream, reset or reset_upstream))
        for sockio, rst in sides:
            if sockio is None:
                continue
            if rst:
                sockio.reset()
            else:
                sockio.close()
        self._maybe_forget()

    def abort(self) -> None:
        """Drop both sockets now, whatever is still queued (used when the proxy stops)."""
        self.close()
        for sockio in (self.client, self.upstream):
            if sockio is not None:
                sockio.abort()

    def _maybe_forget(self) -> None:
        wanted = {"client"} | ({"upstream"} if self.upstream is not None else set())
        if self.closed and wanted <= self.lost and self in self.proxy.connections:
            self.proxy.connections.discard(self)
            self.proxy.metrics.connection_closed()

    def reset_by_toxic(self, toxic: tx.Toxic) -> None:
        """A reset_peer toxic fired: RST to the client, the upstream, or both."""
        self.proxy.metrics.affected(toxic.name, toxic.type, toxic.direction, 0)
        self.close(
            reset_client=toxic.direction in ("both", "downstream"),
            reset_upstream=toxic.direction in ("both", "upstream"),
        )

    def pipes(self) -> list[Pipe]:
        """Both pipes."""
        return [self.up, self.down]
