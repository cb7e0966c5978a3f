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
import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pdx import __version__
from pdx.errors import MeasurementError
from pdx.link import protocol as proto
from pdx.link.sockets import ANCILLARY_BYTES, enable_rx_timestamps, rx_timestamp_ns
from pdx.tcp import congestion_control, tcp_facts, tcp_info

_RECV_BYTES = 256 * 1024  # a data connection's receive buffer (a sink counting bytes)
_FRAME_RECV_BYTES = 4096  # before a connection is a data connection: frames only
_MAX_UDP_BYTES = 65535
_MAX_PLAN_STREAMS = 1024
_MAX_PLAN_S = 86_400.0

log = logging.getLogger("pdx.link.server")


@dataclass(frozen=True)
class ServerLimits:
    """Bounds that keep a server left on a link from being used as a traffic generator."""

    max_test_s: float = 60.0
    max_test_bytes: int = 256 * 1024**3
    max_sessions: int = 64
    max_probes_per_stream: int = 1_000_000  # sequence numbers below this, one bit each
    max_probe_streams_per_session: int = 16  # probe-link uses 4
    max_chunk_bytes: int = 64 * 1024 * 1024
    idle_timeout_s: float = 120.0
    # Against one client using the server as a traffic generator, or flooding it with
    # connections (a server with no --secret lets anyone open a session):
    max_connections: int = 1024
    max_connections_per_peer: int = 128
    max_data_connections_per_session: int = 16
    max_session_bytes: int = 64 * 1024**3
    # A session that has not proved the secret (the server has none) gets what its hello
    # planned (streams at once; seconds of data tests at anonymous_gbps), within these:
    anonymous_data_connections: int = 4
    anonymous_session_bytes: int = 16 * 10**9
    anonymous_gbps: float = 40.0

    def as_dict(self) -> dict[str, Any]:
        """Limits as announced to clients."""
        return {
            "max_test_s": self.max_test_s,
            "max_test_bytes": self.max_test_bytes,
            "max_probes_per_stream": self.max_probes_per_stream,
            "max_probe_streams_per_session": self.max_probe_streams_per_session,
            "max_chunk_bytes": self.max_chunk_bytes,
            "max_data_connections_per_session": self.max_data_connections_per_session,
            "max_session_bytes": self.max_session_bytes,
            "anonymous_data_connections": self.anonymous_data_connections,
            "anonymous_session_bytes": self.anonymous_session_bytes,
            "anonymous_gbps": self.anonymous_gbps,
        }

    def budget(self, plan: tuple[int, float] | None, *, authenticated: bool) -> SessionBudget:
        """What one session may use. ``plan`` is what its hello asked for (data connections
        open at once, seconds of data tests), None when it named none."""
        if authenticated:  # proved the secret: the configured maximum, streams as planned
            most = self.max_data_connections_per_session
            streams = most if plan is None else min(plan[0], most)
            return SessionBudget(
                data_connections=streams,
                bytes=self.max_session_bytes,
                authenticated=True,
                capped=False,
                data_connections_basis=_basis(streams < most, "--max-data-connections"),
                bytes_basis="--max-session-gb",
            )
        streams, seconds = plan or (1, 1.0)  # nothing planned: one stream for one second
        most = min(self.anonymous_data_connections, self.max_data_connections_per_session)
        most_bytes = min(self.anonymous_session_bytes, self.max_session_bytes)
        wanted = int(seconds * self.anonymous_gbps * 1e9 / 8)
        planned = f"{seconds:g} s of tests at --anonymous-gbps {self.anonymous_gbps:g}"
        return SessionBudget(
            data_connections=min(streams, most),
            bytes=min(wanted, most_bytes),
            authenticated=False,
            capped=wanted > most_bytes,
            data_connections_basis=_basis(
                streams <= most, "--anonymous-data-connections, no secret"
            ),
            bytes_basis=_basis(wanted <= most_bytes, "--anonymous-session-gb, no secret", planned),
        )


def _basis(planned: bool, limit: str, plan: str = "") -> str:
    """Which bound set a budget figure, for the message that refuses past it."""
    return f"what its hello planned{': ' + plan if plan else ''}" if planned else limit


@dataclass(frozen=True)
class SessionBudget:
    """What one session may use: data connections open at once, bytes over all of them."""

    data_connections: int
    bytes: int
    authenticated: bool
    capped: bool  # its plan asked for more bytes than the server grants
    data_connections_basis: str  # which limit set data_connections, for error messages
    bytes_basis: str

    def as_dict(self) -> dict[str, Any]:
        """As announced in the hello reply."""
        return {"data_connections": self.data_connections, "bytes": self.bytes,
                "authenticated": self.authenticated, "capped": self.capped}  # fmt: skip


class _Refused(proto.ProtocolError):
    """A data connection over its session's budget: answered, then closed."""


@dataclass
class _ProbeStream:
    """The sequence numbers of one UDP probe stream the reflector saw, one bit each: 125 KB
    at most for the 10^6 a stream may use (a set of ints would take ~60 MB)."""

    seen: bytearray = field(default_factory=bytearray)
    duplicates: int = 0

    def add(self, seq: int) -> None:
        """Record ``seq``; a second copy counts as a duplicate."""
        byte, bit = divmod(seq, 8)
        if byte >= len(self.seen):
            self.seen.extend(bytes(byte + 1 - len(self.seen)))
        if self.seen[byte] >> bit & 1:
            self.duplicates += 1
        self.seen[byte] |= 1 << bit

    def count_below(self, n: int) -> int:
        """Distinct sequence numbers seen below ``n``."""
        full, rest = divmod(max(0, min(n, 8 * len(self.seen))), 8)
        count = int.from_bytes(self.seen[:full], "little").bit_count()
        if rest:
            count += (self.seen[full] & ((1 << rest) - 1)).bit_count()
        return count


@dataclass
class _Session:
    sid: bytes
    udp_key: bytes | None
    budget: SessionBudget
    streams: dict[int, _ProbeStream] = field(default_factory=dict)
    test_epochs: dict[str, float] = field(default_factory=dict)
    # TCP_INFO of this session's download (source) streams, by test; bounded per test
    tcp_reports: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    peer_ip: str = ""  # UDP probes are answered only to the address that opened it
    data: set[_Connection] = field(default_factory=set)  # its live data connections
    data_connections: int = 0
    bytes_moved: int = 0  # of budget.bytes, over all its data connections
    refused: int = 0  # data connections refused for its budget
    stopped: str = ""  # why its budget ended its data connections ("" while it has not)

    def epoch(self, test: str) -> float:
        """Common time origin of all data connections of one test (bins line up across streams)."""
        return self.test_epochs.setdefault(test, time.monotonic())

    def name(self) -> str:
        """``session 1a2b3c4d from 127.0.0.1 (no secret)``, for log lines."""
        proof = "secret" if self.budget.authenticated else "no secret"
        return f"session {self.sid.hex()[:8]} from {self.peer_ip} ({proof})"

    def refuse(self, why: str) -> _Refused:
        """Count a refused data connection; the first one of a session is logged."""
        self.refused += 1
        if self.refused == 1:
            log.warning("probe %s: data connection refused: %s (later refusals are counted)",
                        self.name(), why)  # fmt: skip
        return _Refused(why)

    def left(self) -> int:
        """Bytes its budget still allows."""
        return self.budget.bytes - self.bytes_moved

    def spent(self) -> str:
        """Why a spent budget refuses more."""
        return (f"this session moved its budget of {self.budget.bytes / 1e9:.3g} GB "
                f"({self.budget.bytes_basis})")  # fmt: skip

    def spend(self, nbytes: int) -> bool:
        """Count bytes moved; True once the budget is spent (then every stream is stopped)."""
        self.bytes_moved += nbytes
        if self.left() > 0:
            return False
        if not self.stopped:
            self.stopped = self.spent()
            log.warning("probe %s: %s; its data connections are closed", self.name(),
                        self.stopped)  # fmt: skip
            for conn in list(self.data):
                conn.stop()
        return True


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
        self.sessions: dict[bytes, _Session] = {}
        self.tcp_port = 0
        self.udp_port = 0
        self._server: asyncio.Server | None = None
        self._udp: socket.socket | None = None
        self._connections: set[_Connection] = set()
        self._per_peer: dict[str, int] = {}

    async def start(self) -> None:
        """Bind both sockets; UDP takes the TCP port number unless told otherwise."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), self.bind, self.requested_port, reuse_address=True
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
        for conn in list(self._connections):
            conn.abort()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    # -- sessions -----------------------------------------------------------------------
    def open_session(self, peer_ip: str, plan: tuple[int, float] | None = None) -> _Session:
        """Create a session with the budget ``plan`` earns it, or refuse when the server is full.

        Every frame of a server with a secret is authenticated, so its sessions have proved
        the secret; a server without one has only anonymous sessions.
        """
        if len(self.sessions) >= self.limits.max_sessions:
            raise proto.ProtocolError(f"server busy: {len(self.sessions)} sessions open")
        sid = secrets.token_bytes(8)
        budget = self.limits.budget(plan, authenticated=bool(self.secret))
        session = _Session(sid, proto.session_key(self.secret, sid), budget, peer_ip=peer_ip)
        self.sessions[sid] = session
        return session

    def admit(self, ip: str) -> str | None:
        """Count a new TCP connection; why it is refused (too many open), or None."""
        lim = self.limits
        mine = self._per_peer.get(ip, 0)
        if len(self._connections) >= lim.max_connections:
            return f"{len(self._connections)} connections open"
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

    def session_for(self, sid_hex: Any) -> _Session:
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
            stream = session.streams[probe.stream] = _ProbeStream()
        if probe.seq >= self.limits.max_probes_per_stream:
            return
        stream.add(probe.seq)
        probe.kind = proto.KIND_REPLY
        probe.server_rx_ns = rx_ns
        probe.server_tx_ns = time.time_ns()
        with contextlib.suppress(OSError):
            sock.sendto(proto.pack_probe(probe, session.udp_key, len(data)), addr)


class _Connection(asyncio.BufferedProtocol):
    """One TCP connection: frames until it becomes a control, sink, source or chunk stream."""

    def __init__(self, server: ProbeServer) -> None:
        self.server = server
        self.nonce = proto.new_nonce()
        self.buf = bytearray(_FRAME_RECV_BYTES)  # grown once it is a data connection
        self.peer_ip = ""
        self.counted_data = False
        self.pending = bytearray()
        self.mode = "frames"
        self.session: _Session | None = None
        self.control = False
        self.transport: asyncio.Transport | None = None
        self.deadline_handle: asyncio.TimerHandle | None = None
        self.idle_handle: asyncio.TimerHandle | None = None
        self.bytes = 0
        self.byte_limit = 0
        self.bins: dict[int, int] = {}
        self.epoch = 0.0
        self.test = ""
        self.interval_s = 0.1
        self.chunk_left = -1
        self.chunk_len = 0
        self.can_write: asyncio.Event = asyncio.Event()
        self.can_write.set()
        self.task: asyncio.Task[None] | None = None

    # -- asyncio callbacks --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer_ip = str(peer[0]) if peer else ""
        why = self.server.admit(self.peer_ip)
        if why is not None:
            self.mode = "closing"
            transport.abort()
            return
        self.server._connections.add(self)
        transport.set_write_buffer_limits(high=4 * 1024 * 1024)
        sock = transport.get_extra_info("socket")
        if sock is not None:  # small frames and chunk acks must not wait for Nagle
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._arm_idle()
        welcome = {
            "op": "welcome",
            "version": proto.PROTOCOL_VERSION,
            "pdx": __version__,
            "nonce": self.nonce.hex(),
            "auth": bool(self.server.secret),
        }
        # The welcome is signed with an all-zero nonce: the client cannot know ours yet.
        transport.write(proto.encode_frame(welcome, self.server.secret, b""))

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.server._connections:
            self.server._connections.discard(self)
            self.server.leave(self.peer_ip)
        if self.counted_data and self.session is not None:
            self.session.data_connections -= 1
            self.session.data.discard(self)
        for handle in (self.deadline_handle, self.idle_handle):
            if handle is not None:
                handle.cancel()
        if self.task is not None:
            self.task.cancel()
        if self.control and self.session is not None:
            self.server.sessions.pop(self.session.sid, None)
            if self.session.refused > 1:
                log.warning("probe %s ended: %d data connections refused in all",
                            self.session.name(), self.session.refused)  # fmt: skip

    def get_buffer(self, sizehint: int) -> bytearray:
        return self.buf

    def buffer_updated(self, nbytes: int) -> None:
        if self.mode == "sink":
            self._count(nbytes)
        elif self.mode == "chunks":
            self._chunk_bytes(memoryview(self.buf)[:nbytes])
        elif self.mode == "frames":
            self.pending += self.buf[:nbytes]
            self._arm_idle()
            self._drain_frames()
        # "source" and "closing": ignore what the client sends

    def eof_received(self) -> bool:
        if self.mode == "sink":
            self._finish_sink(hang_up=True)
            return True
        return False

    def pause_writing(self) -> None:
        self.can_write.clear()

    def resume_writing(self) -> None:
        self.can_write.set()

    def abort(self) -> None:
        """Drop the connection now."""
        if self.transport is not None:
            self.transport.abort()

    def stop(self) -> None:
        """End a data connection now: a sink reports what it counted, the others close."""
        if self.mode == "sink":
            self._finish_sink(hang_up=False)
        else:
            self._deadline()

    # -- frames -------------------------------------------------------------------------
    def _send(self, message: dict[str, Any]) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(proto.encode_frame(message, self.server.secret, self.nonce))

    def _fail(self, message: str, *, close: bool) -> None:
        self._send({"op": "error", "message": message})
        if close and self.transport is not None:
            self.mode = "closing"
            self.transport.close()

    def _drain_frames(self) -> None:
        while self.mode == "frames" and len(self.pending) >= 4:
            # Judge the length as soon as it arrives, so garbage is answered at once.
            header = bytes(self.pending[: proto.FRAME_HEADER.size]).ljust(
                proto.FRAME_HEADER.size, b"\0"
            )
            try:
                length, mac = proto.parse_header(header)
            except proto.ProtocolError as exc:
                # The stream cannot be resynchronised after a bad length: answer, then hang up.
                self._fail(str(exc), close=True)
                return
            if len(self.pending) < proto.FRAME_HEADER.size:
                return
            end = proto.FRAME_HEADER.size + length
            if len(self.pending) < end:
                return
            body = bytes(self.pending[proto.FRAME_HEADER.size : end])
            del self.pending[:end]
            try:
                message = proto.decode_body(body, mac, self.server.secret, self.nonce)
            except proto.ProtocolError as exc:
                self._fail(str(exc), close="authentication" in str(exc))
                continue
            self._dispatch(message)

    def _dispatch(self, message: dict[str, Any]) -> None:
        op = message["op"]
        try:
            if op == "hello":
                self._on_hello(message)
            elif op == "udp_stats":
                self._on_udp_stats(message)
            elif op == "data":
                self._on_data(message)
            elif op == "tcp_report":
                self._on_tcp_report(message)
            elif op == "bye":
                self._send({"op": "bye"})
                if self.transport is not None:
                    self.transport.close()
            else:
                raise proto.ProtocolError(f"unknown op {op!r}")
        except proto.ProtocolError as exc:
            self._fail(str(exc), close=isinstance(exc, _Refused))

    def _on_hello(self, message: dict[str, Any]) -> None:
        if self.session is not None:
            raise proto.ProtocolError("hello sent twice")
        plan = None
        if "streams" in message or "seconds" in message:  # what the run will ask for
            plan = (_int_field(message, "streams", 0, _MAX_PLAN_STREAMS),
                    _float_field(message, "seconds", 0.0, _MAX_PLAN_S))  # fmt: skip
        self.session = self.server.open_session(self.peer_ip, plan)
        self.control = True
        self._send(
            {
                "op": "hello",
                "session": self.session.sid.hex(),
                "udp_port": self.server.udp_port,
                "limits": self.server.limits.as_dict(),
                "budget": self.session.budget.as_dict(),
                "tcp": tcp_facts(),
            }
        )

    def _on_udp_stats(self, message: dict[str, Any]) -> None:
        if not self.control or self.session is None:
            raise proto.ProtocolError("udp_stats needs a hello first")
        stream_id = _int_field(message, "stream", 0, 65535)
        sent = _int_field(message, "sent", 0, 2**63)
        stream = self.session.streams.get(stream_id, _ProbeStream())
        received = stream.count_below(sent)
        self._send(
            {
                "op": "udp_stats",
                "stream": stream_id,
                "received": received,
                "duplicates": stream.duplicates,
            }
        )

    def _on_tcp_report(self, message: dict[str, Any]) -> None:
        if not self.control or self.session is None:
            raise proto.ProtocolError("tcp_report needs a hello first")
        reports = self.session.tcp_reports.pop(str(message.get("test", "")), [])
        reply: dict[str, Any] = {"op": "tcp_report", "reports": reports}
        if self.session.stopped:  # its budget cut the streams short: the test is not whole
            reply["stopped"] = self.session.stopped
        self._send(reply)

    def _on_data(self, message: dict[str, Any]) -> None:
        if self.session is not None:
            raise proto.ProtocolError("a control connection cannot become a data connection")
        session = self.server.session_for(message.get("session"))
        mode = message.get("mode")
        if mode not in ("sink", "source", "chunks"):
            raise proto.ProtocolError("mode must be one of sink, source, chunks")
        limits, budget = self.server.limits, session.budget
        left = session.left()
        if left <= 0:
            raise session.refuse(session.spent())
        if session.data_connections >= budget.data_connections:
            raise session.refuse(
                f"{session.data_connections} data connections open in this session (at most "
                f"{budget.data_connections}: {budget.data_connections_basis})"
            )
        duration_s = min(_float_field(message, "duration_s", 0.01, 3600.0), limits.max_test_s)
        self.byte_limit = min(
            _int_field(message, "max_bytes", 1, 2**63), limits.max_test_bytes, left
        )
        session.data_connections += 1
        session.data.add(self)
        self.counted_data = True
        self.buf = bytearray(_RECV_BYTES)
        if "interval_s" in message:
            self.interval_s = _float_field(message, "interval_s", 0.01, 10.0)
        self.test = str(message.get("test", ""))[:64]
        self.epoch = session.epoch(self.test)
        self.session = session
        self.mode = mode
        loop = asyncio.get_running_loop()
        self._cancel_idle()
        self.deadline_handle = loop.call_later(duration_s + 2.0, self._deadline)
        self._send({"op": "ready", "duration_s": duration_s, "max_bytes": self.byte_limit})
        leftover = bytes(self.pending)
        self.pending.clear()
        if mode == "source":
            self.task = loop.create_task(self._source(duration_s))
        elif leftover:
            self.buf[: len(leftover)] = leftover
            self.buffer_updated(len(leftover))

    # -- data modes ---------------------------------------------------------------------
    def _session_spent(self, nbytes: int) -> bool:
        """Count bytes against the session's budget; True once it is used up."""
        return self.session is not None and self.session.spend(nbytes)

    def _count(self, nbytes: int) -> None:
        now = time.monotonic()
        index = int((now - self.epoch) / self.interval_s)
        self.bins[index] = self.bins.get(index, 0) + nbytes
        self.bytes += nbytes
        if self._session_spent(nbytes) or self.bytes >= self.byte_limit:
            self._finish_sink(hang_up=False)

    def _finish_sink(self, *, hang_up: bool) -> None:
        """Report what was counted; close, or (a client still sending past its session's
        budget) stop reading and half-close, so a reset does not lose the report."""
        if self.mode != "sink":
            return
        self.mode = "closing"
        first = min(self.bins, default=0)
        last = max(self.bins, default=-1)
        report = {
            "op": "sink_report",
            "bytes": self.bytes,
            "interval_s": self.interval_s,
            "first_bin": first,
            "bins": [self.bins.get(i, 0) for i in range(first, last + 1)],
        }
        stopped = self.session.stopped if self.session is not None else ""
        if stopped:
            report["stopped"] = stopped
        self._send(report)
        if self.transport is None:
            return
        if hang_up or not stopped:
            self.transport.close()
        else:  # closed at its deadline (at most max_test_s + 2 s from its start)
            self.transport.pause_reading()
            self.transport.write_eof()

    async def _source(self, duration_s: float) -> None:
        block = memoryview(bytes(_RECV_BYTES))
        end = time.monotonic() + duration_s
        transport, session = self.transport, self.session
        assert transport is not None and session is not None
        while time.monotonic() < end and self.bytes < self.byte_limit:
            await self.can_write.wait()
            if transport.is_closing():
                return
            size = min(len(block), self.byte_limit - self.bytes, session.left())
            if size <= 0:
                break
            transport.write(block[:size])
            self.bytes += size
            if self._session_spent(size):
                break
            await asyncio.sleep(0)
        self.mode = "closing"
        self._record_tcp_info(transport)
        transport.close()

    def _record_tcp_info(self, transport: asyncio.BaseTransport) -> None:
        """What TCP saw sending this stream (what capped it), for the client to ask for."""
        sock = transport.get_extra_info("socket")
        info = tcp_info(sock) if sock is not None else None
        if info is None or self.session is None:
            return
        mine = self.session.tcp_reports.setdefault(self.test, [])
        if len(mine) < 64 and len(self.session.tcp_reports) < 256:
            mine.append({**info.as_dict(), "congestion_control": congestion_control(sock)})

    def _chunk_bytes(self, data: memoryview) -> None:
        while data:
            if self.chunk_left < 0:  # reading a header
                need = proto.CHUNK_HEADER.size - len(self.pending)
                self.pending += data[:need]
                data = data[need:]
                if len(self.pending) < proto.CHUNK_HEADER.size:
                    return
                (self.chunk_len,) = proto.CHUNK_HEADER.unpack(bytes(self.pending))
                self.pending.clear()
                if self.chunk_len > self.server.limits.max_chunk_bytes:
                    self._fail(f"chunk of {self.chunk_len} bytes exceeds the limit", close=True)
                    return
                self.chunk_left = self.chunk_len
            take = min(self.chunk_left, len(data))
            self.chunk_left -= take
            self.bytes += take
            data = data[take:]
            if self.chunk_left == 0:
                self.chunk_left = -1
                assert self.transport is not None
                self.transport.write(proto.CHUNK_HEADER.pack(self.chunk_len))
            if self._session_spent(take) or self.bytes >= self.byte_limit:
                self._deadline()
                return

    def _deadline(self) -> None:
        if self.mode == "sink":
            self._finish_sink(hang_up=True)
        elif self.transport is not None:
            self.mode = "closing"
            self.transport.close()

    def _arm_idle(self) -> None:
        self._cancel_idle()
        loop = asyncio.get_running_loop()
        self.idle_handle = loop.call_later(self.server.limits.idle_timeout_s, self.abort)

    def _cancel_idle(self) -> None:
        if self.idle_handle is not None:
            self.idle_handle.cancel()
            self.idle_handle = None


def _int_field(message: dict[str, Any], name: str, low: int, high: int) -> int:
    value = message.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise proto.ProtocolError(f"{name}: expected an integer in {low}..{high}, got {value!r}")
    return value


def _float_field(message: dict[str, Any], name: str, low: float, high: float) -> float:
    value = message.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise proto.ProtocolError(f"{name}: expected a number in {low}..{high}, got {value!r}")
    return float(value)


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
