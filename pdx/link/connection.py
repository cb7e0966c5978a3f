"""One TCP connection to the probe server: frames until it is a control connection (a
session) or a data connection (``sink``, ``source`` or ``chunks``) bounded by the server's
time and byte limits and its session's budget."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from typing import Any, Protocol

from pdx import __version__
from pdx.link import protocol as proto
from pdx.link.budget import ServerLimits
from pdx.link.session import ProbeStream, Refused, Session
from pdx.tcp import congestion_control, tcp_facts, tcp_info

_RECV_BYTES = 256 * 1024  # a data connection's receive buffer (a sink counting bytes)
_FRAME_RECV_BYTES = 4096  # before a connection is a data connection: frames only
_MAX_PLAN_STREAMS = 1024
_MAX_PLAN_S = 86_400.0

log = logging.getLogger("pdx.link.server")  # the probe server's one logger


class Host(Protocol):
    """What a connection needs of the server that accepted it."""

    secret: bytes | None
    limits: ServerLimits
    udp_port: int
    sessions: dict[bytes, Session]
    connections: set[Connection]

    def admit(self, ip: str) -> str | None:
        """Count a new TCP connection; why it is refused, or None."""

    def leave(self, ip: str) -> None:
        """A counted connection ended."""

    def open_session(self, peer_ip: str, plan: tuple[int, float] | None = None) -> Session:
        """Create a session, or refuse when the server is full."""

    def session_for(self, sid_hex: Any) -> Session:
        """Look a session up by its hex id."""


class Connection(asyncio.BufferedProtocol):
    """One TCP connection: frames until it becomes a control, sink, source or chunk stream."""

    def __init__(self, server: Host) -> None:
        self.server = server
        self.nonce = proto.new_nonce()
        self.buf = bytearray(_FRAME_RECV_BYTES)  # grown once it is a data connection
        self.peer_ip = ""
        self.counted_data = False
        self.pending = bytearray()
        self.mode = "frames"
        self.session: Session | None = None
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
        self.server.connections.add(self)
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
        if self in self.server.connections:
            self.server.connections.discard(self)
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
            self._fail(str(exc), close=isinstance(exc, Refused))

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
        stream = self.session.streams.get(stream_id, ProbeStream())
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
