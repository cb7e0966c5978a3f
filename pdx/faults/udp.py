"""UDP forwarding with per-datagram toxics: loss (random, Gilbert-Elliott), delay, jitter,
duplicate, reorder, corrupt, rate.

One upstream socket per client address (a session), like a NAT. Toxic state (loss chain,
token bucket) is per direction for the whole proxy, so a seeded loss sequence is exact and
reproducible across sessions. Delayed datagrams are released by loop timers and may
overtake each other under jitter, as on a real network.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from pdx.faults import toxics as tx
from pdx.faults.tcp import ProxyHooks, ToxicState, flip_bytes, jitter_sample, os_reason

Addr = tuple[Any, ...]


class GilbertElliott:
    """Two-state loss chain: good/bad states with their own loss rates (netem ``gemodel``)."""

    def __init__(
        self,
        p_good_to_bad: float,
        p_bad_to_good: float,
        loss_good: float,
        loss_bad: float,
        rng: random.Random,
    ) -> None:
        self.p_good_to_bad = p_good_to_bad
        self.p_bad_to_good = p_bad_to_good
        self.loss_good = loss_good
        self.loss_bad = loss_bad
        self.rng = rng
        self.bad = False

    def drop(self) -> bool:
        """Decide one datagram's fate in the current state, then step the chain."""
        lost = self.rng.random() < (self.loss_bad if self.bad else self.loss_good)
        flip = self.p_bad_to_good if self.bad else self.p_good_to_bad
        if self.rng.random() < flip:
            self.bad = not self.bad
        return lost

    def stationary_loss(self) -> float:
        """Long-run loss rate: π_bad · loss_bad + π_good · loss_good."""
        total = self.p_good_to_bad + self.p_bad_to_good
        pi_bad = self.p_good_to_bad / total if total > 0 else 0.0
        return pi_bad * self.loss_bad + (1 - pi_bad) * self.loss_good


class UdpToxicState(ToxicState):
    """A toxic acting on one UDP direction; adds the Gilbert-Elliott chain for ``loss``."""

    def __init__(self, toxic: tx.Toxic, rng: random.Random) -> None:
        super().__init__(toxic, rng)
        self.chain: GilbertElliott | None = None
        if isinstance(toxic, tx.Loss) and toxic.model == "gilbert_elliott":
            self.chain = GilbertElliott(
                toxic.p_good_to_bad, toxic.p_bad_to_good, toxic.loss_good, toxic.loss_bad, self.rng
            )

    def retune(self, toxic: tx.Toxic) -> None:
        """Take new parameters, keeping the chain's current state."""
        self.toxic = toxic
        if isinstance(toxic, tx.Loss) and toxic.model == "gilbert_elliott":
            bad = self.chain.bad if self.chain is not None else False
            self.chain = GilbertElliott(
                toxic.p_good_to_bad, toxic.p_bad_to_good, toxic.loss_good, toxic.loss_bad, self.rng
            )
            self.chain.bad = bad
        else:
            self.chain = None


class UdpDirection:
    """The toxic chain for one direction of UDP traffic."""

    def __init__(self, proxy: ProxyHooks, direction: str) -> None:
        self.proxy = proxy
        self.direction = direction
        self.loop = asyncio.get_running_loop()
        self.states: list[UdpToxicState] = []

    def forward(self, data: bytes, send: Any) -> None:
        """Apply toxics to one datagram and send it (now, later, twice, or never)."""
        metrics = self.proxy.metrics
        metrics.traffic(self.direction, len(data))
        if self.proxy.link_blocked:
            metrics.affected("link_down", "link", self.direction, len(data))
            return
        now = self.loop.time()
        delay_s = 0.0
        copies = 1
        for state in self.states:
            toxic = state.toxic
            if toxic.toxicity < 1 and state.rng.random() >= toxic.toxicity:
                continue
            result = self._apply(state, data, now + delay_s)
            if result is None:
                return
            data, extra_s, extra_copies = result
            delay_s += extra_s
            copies += extra_copies
        for _ in range(copies):
            if delay_s <= 0:
                send(data)
            else:
                self.loop.call_at(now + delay_s, send, data)

    def _apply(
        self, state: UdpToxicState, data: bytes, at: float
    ) -> tuple[bytes, float, int] | None:
        """One toxic on one datagram: None = dropped, else (data, extra delay, extra copies)."""
        toxic = state.toxic
        n = len(data)
        if isinstance(toxic, tx.Loss):
            lost = state.chain.drop() if state.chain else state.rng.random() < toxic.probability
            if lost:
                self._count(toxic, n)
                return None
            return data, 0.0, 0
        if isinstance(toxic, tx.Latency):
            self._count(toxic, n)
            return data, jitter_sample(state.rng, toxic), 0
        if isinstance(toxic, tx.Duplicate):
            if state.rng.random() < toxic.probability:
                self._count(toxic, n)
                return data, 0.0, 1
            return data, 0.0, 0
        if isinstance(toxic, tx.Reorder):
            if state.rng.random() < toxic.probability:
                self._count(toxic, n)
                return data, toxic.delay_ms / 1e3, 0
            return data, 0.0, 0
        if isinstance(toxic, tx.Corrupt):
            return self._corrupt(state, toxic, data), 0.0, 0
        if isinstance(toxic, tx.Bandwidth):
            return data, self._pace(state, toxic, n, at), 0
        return data, 0.0, 0

    def _corrupt(self, state: UdpToxicState, toxic: tx.Corrupt, data: bytes) -> bytes:
        if not data or state.rng.random() >= toxic.probability:
            return data
        positions = state.rng.sample(range(len(data)), min(toxic.nbytes, len(data)))
        self._count(toxic, len(positions))
        return flip_bytes(data, positions, state.rng)

    def _pace(self, state: UdpToxicState, toxic: tx.Bandwidth, nbytes: int, at: float) -> float:
        rate = toxic.rate_mbps * 1e6 / 8
        burst_s = toxic.burst_bytes / rate
        state.next_free_s = max(state.next_free_s, at - burst_s) + nbytes / rate
        self._count(toxic, nbytes)
        return max(0.0, state.next_free_s - burst_s - at)

    def _count(self, toxic: tx.Toxic, nbytes: int) -> None:
        self.proxy.metrics.affected(toxic.name, toxic.type, self.direction, nbytes)


class _ListenProtocol(asyncio.DatagramProtocol):
    """The proxy's public UDP socket: datagrams from clients."""

    def __init__(self, relay: UdpRelay) -> None:
        self.relay = relay

    def datagram_received(self, data: bytes, addr: Addr) -> None:
        self.relay.from_client(data, addr)


class _SessionProtocol(asyncio.DatagramProtocol):
    """One client's socket towards the upstream: datagrams back from the server."""

    def __init__(self, relay: UdpRelay, client: Addr) -> None:
        self.relay = relay
        self.client = client
        self.transport: asyncio.DatagramTransport | None = None
        self.backlog: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        for data in self.backlog:
            self.transport.sendto(data)  # type: ignore[union-attr]
        self.backlog.clear()

    def datagram_received(self, data: bytes, addr: Addr) -> None:
        self.relay.from_upstream(data, self.client)

    def error_received(self, exc: Exception) -> None:
        """ICMP port unreachable and the like: nothing to do for a datagram relay."""

    def send(self, data: bytes) -> None:
        """Send towards the upstream (buffered until the socket exists)."""
        if self.transport is None:
            self.backlog.append(data)
        elif not self.transport.is_closing():
            self.transport.sendto(data)


class UdpRelay:
    """The UDP side of a :class:`~pdx.faults.proxy.FaultProxy`."""

    def __init__(self, proxy: ProxyHooks) -> None:
        self.proxy = proxy
        self.loop = asyncio.get_running_loop()
        self.up = UdpDirection(proxy, "upstream")
        self.down = UdpDirection(proxy, "downstream")
        self.listen: asyncio.DatagramTransport | None = None
        self.sessions: dict[Addr, _SessionProtocol] = {}

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Bind the public socket; returns the bound address."""
        transport, _ = await self.loop.create_datagram_endpoint(
            lambda: _ListenProtocol(self), local_addr=(host, port)
        )
        self.listen = transport
        sockname = transport.get_extra_info("sockname")
        return sockname[0], sockname[1]

    def from_client(self, data: bytes, addr: Addr) -> None:
        """A datagram from a client: find or open its session, then forward upstream."""
        session = self.sessions.get(addr)
        if session is None:
            session = self._open_session(addr)
        self.up.forward(data, session.send)

    def from_upstream(self, data: bytes, client: Addr) -> None:
        """A datagram from the upstream for ``client``."""
        self.down.forward(data, lambda d: self._to_client(d, client))

    def _to_client(self, data: bytes, client: Addr) -> None:
        if self.listen is not None and not self.listen.is_closing():
            self.listen.sendto(data, client)

    def _open_session(self, addr: Addr) -> _SessionProtocol:
        session = _SessionProtocol(self, addr)
        self.sessions[addr] = session
        self.proxy.metrics.connection_opened()
        self.loop.create_task(self._connect(session))
        return session

    async def _connect(self, session: _SessionProtocol) -> None:
        try:
            await self.loop.create_datagram_endpoint(
                lambda: session, remote_addr=self.proxy.upstream
            )
        except OSError as exc:
            self.proxy.upstream_errors.append(f"{self.proxy.upstream}: {os_reason(exc)}")

    def directions(self) -> list[UdpDirection]:
        """Both directions."""
        return [self.up, self.down]

    def close(self) -> None:
        """Close every socket."""
        for session in self.sessions.values():
            if session.transport is not None:
                session.transport.close()
            self.proxy.metrics.connection_closed()
        self.sessions.clear()
        if self.listen is not None:
            self.listen.close()
