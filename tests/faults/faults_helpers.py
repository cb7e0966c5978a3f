"""Helpers shared by the fault proxy tests (imported by module name from this folder)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdx.faults import FaultProxy


@dataclass
class Sink:
    """A TCP server that records what it receives, per connection, with arrival times."""

    chunks: list[list[tuple[float, bytes]]] = field(default_factory=list)
    closed_at: list[float] = field(default_factory=list)
    port: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        rows: list[tuple[float, bytes]] = []
        self.chunks.append(rows)
        try:
            while data := await reader.read(1 << 20):
                rows.append((time.perf_counter(), data))
        except (ConnectionError, OSError):
            pass
        self.closed_at.append(time.perf_counter())
        writer.close()

    def data(self, index: int = 0) -> bytes:
        """All bytes of connection ``index``."""
        return b"".join(d for _, d in self.chunks[index])


async def wait_for(
    predicate: Callable[[], bool], timeout_s: float = 5.0, interval_s: float = 0.005
) -> None:
    """Poll ``predicate`` until true; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(interval_s)


async def round_trips(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, count: int, size: int = 64
) -> list[float]:
    """Ping-pong ``count`` messages through an echo path; RTTs in ms."""
    payload = b"p" * size
    out = []
    for _ in range(count):
        start = time.perf_counter()
        writer.write(payload)
        await reader.readexactly(size)
        out.append((time.perf_counter() - start) * 1e3)
    return out


def host_lateness_ms(proxy: FaultProxy, per_sample: int) -> list[float]:
    """Per round trip, how late the proxy's timed releases went out (summed over the
    ``per_sample`` delayed chunks of each round trip): the busy host's share, not the proxy's."""
    late = [x * 1e3 for x in proxy.metrics.timer_late_s]
    return [sum(late[i : i + per_sample]) for i in range(0, len(late), per_sample)]
