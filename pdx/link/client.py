"""Client side of the probe protocol: a control session and the data connections it opens.

The client uses blocking sockets and threads rather than asyncio: each measurement stream
sits in its own system call, so one busy stream does not delay another's timestamps.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from pdx.errors import MeasurementError
from pdx.link import protocol as proto
from pdx.netaddr import parse_hostport


def parse_target(target: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` into (host, port)."""
    return parse_hostport(target, "target")


class FrameConnection:
    """A TCP connection speaking control frames (welcome, then request/reply)."""

    def __init__(self, sock: socket.socket, secret: bytes | None, where: str) -> None:
        self.sock = sock
        self.secret = secret
        self.where = where
        self.nonce = b""
        self.lock = threading.Lock()
        welcome = self._read_welcome()
        self.nonce = bytes.fromhex(str(welcome.get("nonce", "")))
        self.welcome = welcome

    @classmethod
    def connect(
        cls, host: str, port: int, secret: bytes | None, timeout_s: float
    ) -> FrameConnection:
        """Open a connection and read the server's welcome."""
        where = f"{host}:{port}"
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise MeasurementError(f"cannot reach probe server at {where}: {exc}") from None
        try:
            return cls(sock, secret, where)
        except BaseException:
            sock.close()
            raise

    def _read_welcome(self) -> dict[str, Any]:
        try:
            length, mac = proto.parse_header(self._recv_exact(proto.FRAME_HEADER.size))
            body = self._recv_exact(length)
            welcome = proto.decode_body(body, mac, None, b"")
        except proto.ProtocolError as exc:
            raise MeasurementError(f"{self.where}: not a pdx probe server ({exc})") from None
        if welcome.get("op") != "welcome":
            raise MeasurementError(f"{self.where}: not a pdx probe server")
        if welcome.get("auth") and not self.secret:
            raise MeasurementError(f"{self.where}: the server requires a shared secret (--secret)")
        if self.secret and not welcome.get("auth"):
            raise MeasurementError(f"{self.where}: --secret given but the server runs without one")
        if self.secret:
            try:
                proto.decode_body(body, mac, self.secret, b"")
            except proto.ProtocolError:
                raise MeasurementError(
                    f"{self.where}: server authentication failed (wrong secret?)"
                ) from None
        return welcome

    def _recv_exact(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            try:
                piece = self.sock.recv(n - len(out))
            except OSError as exc:
                raise MeasurementError(f"{self.where}: connection failed: {exc}") from None
            if not piece:
                raise MeasurementError(f"{self.where}: server closed the connection")
            out += piece
        return bytes(out)

    def _read_frame(self, verify_nonce: bytes | None = None) -> dict[str, Any]:
        nonce = self.nonce if verify_nonce is None else verify_nonce
        try:
            length, mac = proto.parse_header(self._recv_exact(proto.FRAME_HEADER.size))
            return proto.decode_body(self._recv_exact(length), mac, self.secret, nonce)
        except proto.ProtocolError as exc:
            if "authentication" in str(exc):
                raise MeasurementError(
                    f"{self.where}: server authentication failed (wrong secret?)"
                ) from None
            raise MeasurementError(f"{self.where}: bad frame from server: {exc}") from None

    def send(self, message: dict[str, Any]) -> None:
        """Send one frame."""
        try:
            self.sock.sendall(proto.encode_frame(message, self.secret, self.nonce))
        except OSError as exc:
            raise MeasurementError(f"{self.where}: connection failed: {exc}") from None

    def receive(self) -> dict[str, Any]:
        """Read one frame; an ``error`` frame becomes a :class:`MeasurementError`."""
        reply = self._read_frame()
        if reply.get("op") == "error":
            raise MeasurementError(f"{self.where}: server refused: {reply.get('message')}")
        return reply

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send a frame and return the reply (one request at a time across threads)."""
        with self.lock:
            self.send(message)
            return self.receive()

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()

    def __enter__(self) -> FrameConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class ProbePlan:
    """What a run will ask of the server, sent in its hello: the most data connections open
    at once and the seconds of data tests in all. A server without a secret sizes the
    session's budget to it."""

    streams: int
    seconds: float


@dataclass
class ProbeSession:
    """A live control session with a probe server."""

    host: str
    port: int
    secret: bytes | None
    timeout_s: float = 5.0
    plan: ProbePlan | None = None  # None: what a server grants a session that planned nothing
    control: FrameConnection | None = None
    session_id: bytes = b""
    udp_port: int = 0
    limits: dict[str, Any] = field(default_factory=dict)
    server_version: str = ""
    server_tcp: dict[str, Any] | None = None  # the server's TCP defaults (newer servers)
    # what the server grants this session: data_connections, bytes, authenticated, capped
    # (None from older servers)
    budget: dict[str, Any] | None = None

    def open(self) -> ProbeSession:
        """Connect and say hello."""
        self.control = FrameConnection.connect(self.host, self.port, self.secret, self.timeout_s)
        self.server_version = str(self.control.welcome.get("pdx", ""))
        hello: dict[str, Any] = {"op": "hello"}
        if self.plan is not None:
            hello |= {"streams": self.plan.streams, "seconds": self.plan.seconds}
        reply = self.control.request(hello)
        self.session_id = bytes.fromhex(str(reply["session"]))
        self.udp_port = int(reply["udp_port"])
        self.limits = dict(reply.get("limits", {}))
        budget = reply.get("budget")
        self.budget = dict(budget) if isinstance(budget, dict) else None
        tcp = reply.get("tcp")
        self.server_tcp = dict(tcp) if isinstance(tcp, dict) else None
        return self

    def tcp_report(self, test: str) -> list[dict[str, Any]]:
        """The server's TCP_INFO of the download streams of ``test`` ([] from older servers)."""
        if self.server_tcp is None:
            return []
        assert self.control is not None
        reply = self.control.request({"op": "tcp_report", "test": test})
        if reply.get("stopped"):  # the session's budget cut the test's streams short
            raise MeasurementError(f"{self.control.where}: server stopped: {reply['stopped']}")
        reports = reply.get("reports", [])
        return [r for r in reports if isinstance(r, dict)]

    @property
    def udp_key(self) -> bytes | None:
        """Key for probe MACs in this session."""
        return proto.session_key(self.secret, self.session_id)

    def udp_stats(self, stream: int, sent: int) -> dict[str, Any]:
        """What the server received of probe stream ``stream`` (first ``sent`` sequence numbers)."""
        assert self.control is not None
        return self.control.request({"op": "udp_stats", "stream": stream, "sent": sent})

    def open_data(
        self,
        mode: str,
        *,
        duration_s: float,
        max_bytes: int,
        interval_s: float = 0.1,
        test: str | None = None,
    ) -> FrameConnection:
        """Open a data connection in ``mode`` and wait for the server's ``ready``."""
        conn = FrameConnection.connect(self.host, self.port, self.secret, self.timeout_s)
        try:
            conn.request(
                {
                    "op": "data",
                    "session": self.session_id.hex(),
                    "mode": mode,
                    "duration_s": duration_s,
                    "max_bytes": max_bytes,
                    "interval_s": interval_s,
                    "test": test or uuid.uuid4().hex,
                }
            )
        except BaseException:
            conn.close()
            raise
        return conn

    def close(self) -> None:
        """Say goodbye and close the control connection."""
        if self.control is not None:
            with contextlib.suppress(MeasurementError):
                self.control.request({"op": "bye"})
            self.control.close()
            self.control = None

    def __enter__(self) -> ProbeSession:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()
