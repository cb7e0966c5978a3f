"""The fault proxy: listens, forwards to one upstream, applies toxics changeable at run time."""

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, Literal

from pdx import netaddr
from pdx.errors import InputError, MeasurementError
from pdx.faults import toxics as tx
from pdx.faults.metrics import ProxyMetrics
from pdx.faults.sockio import listen
from pdx.faults.tcp import TcpConnection, ToxicState, os_reason
from pdx.faults.udp import UdpRelay, UdpToxicState

LinkMode = Literal["reset", "blackhole"]


class FaultProxy:
    """A TCP or UDP proxy from ``listen`` to ``upstream`` with toxics added/removed at run time.

    ``async with FaultProxy(("127.0.0.1", 0), ("127.0.0.1", port)) as proxy:`` binds an
    ephemeral port (``proxy.port``). ``seed`` makes every random choice reproducible.
    """

    def __init__(
        self,
        listen: tuple[str, int] = ("127.0.0.1", 0),
        upstream: tuple[str, int] = ("127.0.0.1", 0),
        *,
        udp: bool = False,
        toxics: Iterable[tx.Toxic | dict[str, Any]] = (),
        seed: int | None = None,
        check_upstream: bool = False,
    ) -> None:
        self.listen = (listen[0], int(listen[1]))
        self.upstream = (upstream[0], int(upstream[1]))
        self.udp = udp
        self.check_upstream = check_upstream
        self.rng = random.Random(seed)
        self.metrics = ProxyMetrics()
        self.connections: set[TcpConnection] = set()
        self.upstream_errors: list[str] = []
        self.link_blocked = False
        self.link_refusing = False
        self.link_mode: LinkMode | None = None
        self._toxics: dict[str, tx.Toxic] = {}
        self._initial = list(toxics)
        self._stop_listening: Callable[[], None] | None = None
        self._udp: UdpRelay | None = None
        self._link_clear: asyncio.Event | None = None
        self._link_timer: asyncio.TimerHandle | None = None
        self._bound: tuple[str, int] | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Bind the listening socket (port 0 = ephemeral) and start forwarding."""
        self._link_clear = asyncio.Event()
        self._link_clear.set()
        if self.check_upstream and not self.udp:
            await self._probe_upstream()
        if self.udp:
            self._udp = UdpRelay(self)
            self._bound = await self._udp.start(*self.listen)
        else:
            lsock, self._stop_listening = listen(*self.listen, self._accepted)
            sockname = lsock.getsockname()
            self._bound = (sockname[0], sockname[1])
        for toxic in self._initial:
            self.add_toxic(toxic)

    def _accepted(self, sock: socket.socket) -> None:
        TcpConnection(self).start(sock)

    async def _probe_upstream(self) -> None:
        host, port = self.upstream
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 3.0)
        except (OSError, TimeoutError) as exc:
            reason = os_reason(exc) if isinstance(exc, OSError) else "timed out"
            raise MeasurementError(f"upstream {host}:{port} is not reachable ({reason})") from None
        writer.close()

    async def stop(self) -> None:
        """Stop listening and close every connection."""
        if self._link_timer is not None:
            self._link_timer.cancel()
        if self._stop_listening is not None:
            self._stop_listening()
            self._stop_listening = None
        for conn in list(self.connections):
            conn.close()
        if self._udp is not None:
            self._udp.close()
        await asyncio.sleep(0)
        for conn in list(self.connections):  # sockets whose peer never took the last bytes
            conn.abort()

    async def __aenter__(self) -> FaultProxy:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port)."""
        if self._bound is None:
            raise RuntimeError("proxy not started")
        return self._bound

    @property
    def port(self) -> int:
        """The bound port."""
        return self.address[1]

    @property
    def link_clear(self) -> asyncio.Event:
        """Set while the link is up."""
        if self._link_clear is None:
            raise RuntimeError("proxy not started")
        return self._link_clear

    # -- toxics ---------------------------------------------------------------------------------
    def add_toxic(self, toxic: tx.Toxic | dict[str, Any]) -> tx.Toxic:
        """Validate and add a toxic; it also acts on connections already open."""
        spec = tx.parse_toxic(toxic)
        allowed = tx.UDP_TYPES if self.udp else tx.TCP_TYPES
        if spec.type not in allowed:
            mode = "UDP" if self.udp else "TCP"
            raise InputError(
                "toxic.type", spec.type, f"a {mode} toxic ({', '.join(sorted(allowed))})"
            )
        if not spec.name:
            spec = spec.model_copy(update={"name": f"{spec.type}_{spec.direction}"})
        if spec.name in self._toxics:
            raise InputError("toxic.name", spec.name, "a name not in use (update or remove it)")
        self._toxics[spec.name] = spec
        self._attach_everywhere(spec)
        return spec

    def update_toxic(self, name: str, changes: dict[str, Any] | None = None, **kw: Any) -> tx.Toxic:
        """Change a toxic's attributes in place (per-connection state such as buckets is kept)."""
        old = self.get_toxic(name)
        new = tx.updated_toxic(old, (changes or {}) | kw)
        if new.direction != old.direction:
            self.remove_toxic(name)
            return self.add_toxic(new)
        self._toxics[name] = new
        for state in self._states():
            if state.toxic.name == name:
                if isinstance(state, UdpToxicState):
                    state.retune(new)
                else:
                    state.toxic = new
        return new

    def remove_toxic(self, name: str) -> tx.Toxic:
        """Remove a toxic everywhere; queued data keeps the delay it already has."""
        toxic = self.get_toxic(name)
        del self._toxics[name]
        for holder in self._holders():
            kept = []
            for state in holder.states:
                if state.toxic.name == name:
                    state.cancel()
                else:
                    kept.append(state)
            holder.states[:] = kept
            kick = getattr(holder, "kick", None)
            if kick is not None and getattr(holder, "writer", None) is not None:
                kick()
        return toxic

    def get_toxic(self, name: str) -> tx.Toxic:
        """The toxic called ``name``."""
        try:
            return self._toxics[name]
        except KeyError:
            known = ", ".join(self._toxics) or "none"
            raise InputError("toxic", name, f"an existing toxic name (have: {known})") from None

    def list_toxics(self) -> list[tx.Toxic]:
        """Toxics in the order they apply."""
        return list(self._toxics.values())

    def clear_toxics(self) -> None:
        """Remove every toxic."""
        for name in list(self._toxics):
            self.remove_toxic(name)

    def _holders(self) -> list[Any]:
        if self._udp is not None:
            return list(self._udp.directions())
        return [pipe for conn in self.connections for pipe in conn.pipes()]

    def _states(self) -> list[ToxicState]:
        return [s for holder in self._holders() for s in holder.states]

    def _attach_everywhere(self, toxic: tx.Toxic) -> None:
        if self._udp is not None:
            for direction in self._udp.directions():
                if toxic.applies_to(direction.direction):
                    direction.states.append(UdpToxicState(toxic, self.rng))
            return
        for conn in list(self.connections):
            if not conn.closed:
                self._attach(conn, toxic)

    def attach_toxics(self, conn: TcpConnection) -> None:
        """Give a new connection every current toxic (each rolled against its toxicity)."""
        for toxic in self._toxics.values():
            self._attach(conn, toxic)

    def _attach(self, conn: TcpConnection, toxic: tx.Toxic) -> None:
        if toxic.toxicity < 1 and self.rng.random() >= toxic.toxicity:
            return
        loop = asyncio.get_running_loop()
        if isinstance(toxic, tx.ResetPeer):
            state = ToxicState(toxic, self.rng)
            state.timer = loop.call_later(toxic.timeout_ms / 1e3, conn.reset_by_toxic, toxic)
            conn.up.states.append(state)
            return
        for pipe in conn.pipes():
            if not toxic.applies_to(pipe.direction):
                continue
            state = ToxicState(toxic, self.rng)
            if isinstance(toxic, tx.Timeout) and toxic.timeout_ms > 0:
                state.timer = loop.call_later(toxic.timeout_ms / 1e3, conn.close)
            pipe.states.append(state)

    # -- link -----------------------------------------------------------------------------------
    async def link_down(self, duration_s: float | None = None, mode: LinkMode = "reset") -> None:
        """Take the link down now; back up after ``duration_s`` (None = until :meth:`link_up`).

        ``reset``: open connections get a RST and new ones are reset at once (fail fast).
        ``blackhole``: nothing is forwarded and nothing is closed; data flows again on link up.
        """
        if duration_s is not None and not (duration_s >= 0 and duration_s < float("inf")):
            raise InputError("duration_s", duration_s, "a finite number of seconds >= 0")
        if mode not in ("reset", "blackhole"):
            raise InputError("mode", mode, "'reset' or 'blackhole'")
        if self._link_timer is not None:
            self._link_timer.cancel()
            self._link_timer = None
        if not self.link_blocked:
            self.metrics.link_state(True)
        self.link_blocked = True
        self.link_mode = mode
        self.link_refusing = mode == "reset"
        self.link_clear.clear()
        if mode == "reset":
            for conn in list(self.connections):
                conn.close(reset=True)
        if duration_s is not None:
            loop = asyncio.get_running_loop()
            self._link_timer = loop.call_later(duration_s, self.link_up)
        await asyncio.sleep(0)

    def link_up(self) -> None:
        """Bring the link back: new connections succeed, held data flows."""
        if self._link_timer is not None:
            self._link_timer.cancel()
            self._link_timer = None
        if self.link_blocked:
            self.metrics.link_state(False)
        self.link_blocked = False
        self.link_refusing = False
        self.link_mode = None
        self.link_clear.set()

    # -- reporting ------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters, toxics and link state as plain data."""
        data = self.metrics.snapshot()
        data.update(
            {
                "mode": "udp" if self.udp else "tcp",
                "listen": list(self._bound) if self._bound else list(self.listen),
                "upstream": list(self.upstream),
                "link": "down" if self.link_blocked else "up",
                "link_mode": self.link_mode,
                "toxic_specs": [t.model_dump() for t in self._toxics.values()],
                "upstream_errors": self.upstream_errors[-10:],
            }
        )
        return data

    def metrics_text(self) -> bytes:
        """Prometheus exposition of this proxy's own registry."""
        return self.metrics.exposition()


def parse_hostport(text: str, field: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6, port 0 = any free port) → (host, port)."""
    return netaddr.parse_hostport(text, field, allow_port_zero=True, numeric_host=True)
