"""UDP proxy: exact per-datagram loss (random and Gilbert-Elliott), delay, duplicate, reorder."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import statistics
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from faults_helpers import wait_for

from pdx.faults import Corrupt, Duplicate, FaultProxy, Latency, Loss, Reorder
from pdx.faults.udp import GilbertElliott

LOCAL = ("127.0.0.1", 0)


class Recorder(asyncio.DatagramProtocol):
    """Records datagrams (with arrival time); echoes them back when ``echo``."""

    def __init__(self, echo: bool = False) -> None:
        self.echo = echo
        self.got: list[tuple[float, bytes]] = []
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.got.append((time.perf_counter(), data))
        if self.echo and self.transport is not None:
            self.transport.sendto(data, addr)

    def seqs(self) -> list[int]:
        return [struct.unpack("!I", d[:4])[0] for _, d in self.got]


@pytest.fixture
async def udp_echo() -> AsyncIterator[tuple[Recorder, int]]:
    loop = asyncio.get_running_loop()
    transport, server = await loop.create_datagram_endpoint(
        lambda: Recorder(echo=True), local_addr=LOCAL
    )
    yield server, transport.get_extra_info("sockname")[1]
    transport.close()


async def _client(port: int) -> tuple[asyncio.DatagramTransport, Recorder]:
    loop = asyncio.get_running_loop()
    transport, rec = await loop.create_datagram_endpoint(Recorder, remote_addr=("127.0.0.1", port))
    return transport, rec


async def _send_paced(proxy: FaultProxy, transport: Any, count: int, batch: int = 100) -> None:
    """Send ``count`` numbered datagrams, never more than ``batch`` ahead of the proxy (no
    kernel buffer overflow can then pose as loss)."""
    for start in range(0, count, batch):
        for seq in range(start, min(count, start + batch)):
            transport.sendto(struct.pack("!I", seq) + b"x" * 28)
        sent = min(count, start + batch)
        await wait_for(lambda sent=sent: proxy.stats()["packets_in"].get("upstream", 0) >= sent)


def binomial_interval(p: float, n: int) -> tuple[float, float]:
    """95 % interval of the observed rate for n Bernoulli(p) trials (normal approximation)."""
    half = 1.96 * math.sqrt(p * (1 - p) / n)
    return p - half, p + half


async def test_loss_5pct_upstream_within_binomial_interval(udp_echo: tuple[Recorder, int]) -> None:
    server, port = udp_echo
    count = 20_000
    async with FaultProxy(LOCAL, ("127.0.0.1", port), udp=True) as proxy:
        proxy.add_toxic(Loss(probability=0.05, direction="upstream", seed=11))
        transport, client = await _client(proxy.port)
        await _send_paced(proxy, transport, count)
        await wait_for(lambda: len(client.got) == len(server.got))
        transport.close()
        dropped = proxy.stats()["toxics"][0]["packets"]
    measured = 1 - len(server.got) / count
    low, high = binomial_interval(0.05, count)
    assert low <= measured <= high, measured
    assert dropped == count - len(server.got)  # the counter agrees with what really vanished
    assert len(client.got) == len(server.got)  # downstream untouched


def test_gilbert_elliott_matches_stationary_loss_and_burst_length() -> None:
    chain = GilbertElliott(0.01, 0.25, 0.0, 1.0, random.Random(4))
    lost = [chain.drop() for _ in range(200_000)]
    rate = sum(lost) / len(lost)
    assert rate == pytest.approx(chain.stationary_loss(), rel=0.1)  # 0.01 / 0.26 = 3.8 %
    bursts, run = [], 0
    for flag in lost:
        if flag:
            run += 1
        elif run:
            bursts.append(run)
            run = 0
    assert statistics.mean(bursts) == pytest.approx(1 / 0.25, rel=0.1)  # bursts, not spread


async def test_gilbert_elliott_through_proxy_is_bursty(udp_echo: tuple[Recorder, int]) -> None:
    server, port = udp_echo
    toxic = Loss(
        model="gilbert_elliott", p_good_to_bad=0.02, p_bad_to_good=0.3, direction="upstream", seed=9
    )
    async with FaultProxy(LOCAL, ("127.0.0.1", port), udp=True) as proxy:
        proxy.add_toxic(toxic)
        transport, client = await _client(proxy.port)
        await _send_paced(proxy, transport, 3000)
        await wait_for(lambda: len(client.got) == len(server.got))
        transport.close()
    received = set(server.seqs())
    gaps = [s for s in range(3000) if s not in received]
    adjacent = sum(1 for a, b in itertools.pairwise(gaps) if b == a + 1)
    assert 0.02 < len(gaps) / 3000 < 0.12
    assert adjacent > len(gaps) * 0.4  # most losses sit next to another loss


async def test_udp_delay_duplicate_reorder_corrupt(udp_echo: tuple[Recorder, int]) -> None:
    server, port = udp_echo
    async with FaultProxy(LOCAL, ("127.0.0.1", port), udp=True, seed=5) as proxy:
        transport, client = await _client(proxy.port)
        proxy.add_toxic(Latency(latency_ms=15, direction="upstream"))
        start = time.perf_counter()
        transport.sendto(struct.pack("!I", 0))
        await wait_for(lambda: len(client.got) == 1)
        assert client.got[0][0] - start >= 0.015
        proxy.clear_toxics()

        proxy.add_toxic(Duplicate(probability=1.0, direction="upstream"))
        transport.sendto(struct.pack("!I", 1))
        await wait_for(lambda: server.seqs().count(1) == 2)
        proxy.clear_toxics()

        proxy.add_toxic(Reorder(probability=0.3, delay_ms=20, direction="upstream"))
        for seq in range(100, 160):
            transport.sendto(struct.pack("!I", seq))
        await wait_for(lambda: len([s for s in server.seqs() if s >= 100]) == 60)
        late = [s for s in server.seqs() if s >= 100]
        assert sorted(late) == list(range(100, 160)) and late != sorted(late)
        proxy.clear_toxics()

        proxy.add_toxic(Corrupt(probability=1.0, direction="downstream"))
        payload = b"\0" * 32
        transport.sendto(payload)
        await wait_for(
            lambda: client.got[-1][1] != struct.pack("!I", 159) and len(client.got[-1][1]) == 32
        )
        assert sum(b != 0 for b in client.got[-1][1]) == 1
        transport.close()


async def test_udp_link_down_drops_then_recovers(udp_echo: tuple[Recorder, int]) -> None:
    server, port = udp_echo
    async with FaultProxy(LOCAL, ("127.0.0.1", port), udp=True) as proxy:
        transport, client = await _client(proxy.port)
        await proxy.link_down(duration_s=0.3)
        transport.sendto(b"lost")
        await wait_for(lambda: proxy.stats()["packets_in"].get("upstream", 0) == 1)
        await wait_for(lambda: proxy.stats()["link"] == "up")
        transport.sendto(b"kept")
        await wait_for(lambda: len(client.got) == 1)
        transport.close()
    assert [d for _, d in server.got] == [b"kept"]
