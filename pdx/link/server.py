"""The probe server: one TCP port for control and data connections, one UDP reflector.

A client opens a control connection (``hello`` creates a session that lives as long as the
connection), reflects UDP probes carrying the session id, and opens data connections on the
same TCP port that name the session and a mode: ``sink`` (count what the client sends),
``source`` (send to the client) or ``chunks`` (acknowledge each length-prefixed chunk).
Every data connection is bounded by the server's time and byte limits, and every session by
a budget (:class:`SessionBudget`): data connections open at once and bytes over all of them.
A session that proved the shared secret gets the configured maximum; one that proved nothing
(a server without a secret) gets what its ``hello`` planned, within smaller caps. Sessions
are independent, so several clients can measure at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import threading
import time
from typing import Any

from pdx.errors import MeasurementError
from pdx.link import protocol as proto
from pdx.link.budget import ServerLimits, SessionBudget
from pdx.link.connection import Connection
from pdx.link.session import ProbeStream, Session
from pdx.link.sockets import ANCILLARY_BYTES, enable_rx_timestamps, rx_timestamp_ns

__all__ = ["ProbeServer", "ServerLimits", "ServerThread", "SessionBudget", "serve"]

_MAX_UDP_BYTES = 65535


class ProbeServer:
    """Asyncio probe server. ``await start()``, then ``await close()``."""

    def __init__(
        self,
        bind: str = "127.0.0.1",
        port: int = 0,
        *,
        udp_port: int | None = None,
        secret: bytes | None = None,
        limits: ServerLimits | None = None,
    ) -> None:
        self.bind = bind
        self.requested_port = port
        self.requested_udp_port = udp_port
        self.secret = secret or None
        self.limits = limits or ServerLimits()
        self.sessions: dict[bytes, Session] = {}
        self.tcp_port = 0
        self.udp_port = 0
        self._server: asyncio.Server | None = None
        self._udp: socket.socket | None = None
        self.connections: set[Connection] = set()  # open TCP connections, admitted
        self._per_peer: dict[str, int] = {}

    async def start(self) -> None:
        """Bind both sockets; UDP takes the TCP port number unless told otherwise."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: Connection(self), self.bind, self.requested_port, reuse_address=True
        )
        self.tcp_port = self._server.sockets[0].getsockname()[1]
        self._udp = self._bind_udp()
        self.udp_port = self._udp.getsockname()[1]
        loop.add_reader(self._udp.fileno(), self._on_udp)

    def _bind_udp(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.bind else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_DGRAM)
        sock.setblocking(False)
        enable_rx_timestamps(sock)
        wanted = self.requested_udp_port
        try:
            sock.bind((self.bind, self.tcp_port if wanted is None else wanted))
        except OSError:
            if wanted is not None or self.requested_port != 0:
                sock.close()
                raise
            sock.bind((self.bind, 0))  # ephemeral TCP port's number is taken for UDP
        return sock

    async def close(self) -> None:
        """Stop accepting, drop every connection and the reflector."""
        if self._udp is not None:
            asyncio.get_running_loop().remove_reader(self._udp.fileno())
            self._udp.close()
            self._udp = None
        for conn in list(self.connections):
            conn.abort()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    # -- sessions -----------------------------------------------------------------------
    def open_session(self, peer_ip: str, plan: tuple[int, float] | None = None) -> Session:
        """Create a session with the budget ``plan`` earns it, or refuse when the server is full.

        Every frame of a server with a secret is authenticated, so its sessions have proved
        the secret; a server without one has only anonymous sessions.
        """
        if len(self.sessions) >= self.limits.max_sessions:
            raise proto.ProtocolError(f"server busy: {len(self.sessions)} sessions open")
        sid = secrets.token_bytes(8)
        budget = self.limits.budget(plan, authenticated=bool(self.secret))
        session = Session(sid, proto.session_key(self.secret, sid), budget, peer_ip=peer_ip)
        self.sessions[sid] = session
        return session

    def admit(self, ip: str) -> str | None:
        """Count a new TCP connection; why it is refused (too many open), or None."""
        lim = self.limits
        mine = self._per_peer.get(ip, 0)
        if len(self.connections) >= lim.max_connections:
            return f"{len(self.connections)} connections open"
        if mine >= lim.max_connections_per_peer:
            return f"{mine} connections from {ip}"
        self._per_peer[ip] = mine + 1
        return None

    def leave(self, ip: str) -> None:
        """A counted connection ended."""
        left = self._per_peer.get(ip, 1) - 1
        if left > 0:
            self._per_peer[ip] = left
        else:
            self._per_peer.pop(ip, None)

    def session_for(self, sid_hex: Any) -> Session:
        """Look a session up by its hex id (data connections name the session they serve)."""
        try:
            return self.sessions[bytes.fromhex(str(sid_hex))]
        except (ValueError, KeyError):
            raise proto.ProtocolError("unknown session") from None

    # -- UDP reflector ------------------------------------------------------------------
    def _on_udp(self) -> None:
        sock = self._udp
        if sock is None:
            return
        for _ in range(256):  # drain, but let TCP connections run between bursts
            try:
                data, anc, _flags, addr = sock.recvmsg(_MAX_UDP_BYTES, ANCILLARY_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                continue  # e.g. ICMP errors reported on the socket
            self._reflect(sock, data, rx_timestamp_ns(anc), addr)

    def _reflect(self, sock: socket.socket, data: bytes, rx_ns: int, addr: Any) -> None:
        if len(data) < proto.PROBE.size:
            return
        session = self.sessions.get(data[8:16])
        if session is None or (session.peer_ip and addr[0] != session.peer_ip):
            return  # not an open reflector: unknown sessions and other addresses get nothing
        try:
            probe = proto.unpack_probe(data, session.udp_key)
        except proto.ProtocolError:
            return
        if probe.kind != proto.KIND_REQUEST:
            return
        stream = session.streams.get(probe.stream)
        if stream is None:
            if len(session.streams) >= self.limits.max_probe_streams_per_session:
                return
            stream = session.streams[probe.stream] = ProbeStream()
        if probe.seq >= self.limits.max_probes_per_stream:
            return
        stream.add(probe.seq)
        probe.kind = proto.KIND_REPLY
        probe.server_rx_ns = rx_ns
        probe.server_tx_ns = time.time_ns()
        with contextlib.suppress(OSError):
            sock.sendto(proto.pack_probe(probe, session.udp_key, len(data)), addr)


class ServerThread:
    """A probe server on its own event loop in a background thread (tests, embedding)."""

    def __init__(self, server: ProbeServer) -> None:
        self.server = server
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pdx-probe-server", daemon=True)

    def start(self, timeout_s: float = 10.0) -> ServerThread:
        """Start and wait until both sockets are bound."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise MeasurementError("probe server did not start in time")
        if self._error is not None:
            raise MeasurementError(f"probe server failed to start: {self._error}")
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self.server.start())
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self.server.close())
        self._loop.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close the server and join the thread."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def serve(server: ProbeServer, on_ready: Any = None) -> None:
    """Run ``server`` until cancelled (the CLI's lifecycle)."""
    await server.start()
    try:
        if on_ready is not None:
            on_ready(server)
        await asyncio.Event().wait()
    finally:
        await server.close()
