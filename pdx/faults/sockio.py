"""Non-blocking socket I/O on the event loop, with a zero-copy splice(2) pass-through.

asyncio transports always copy data through user space and hide the socket from the loop,
so pass-through could never use ``splice``; through a proxy that doubles the copies per byte
and, on a small machine, halves throughput. This small transport-like class keeps the
interface the pipes need (``write``, ``write_eof``, ``pause_reading``, ``close``, ...) and
moves bytes socket → kernel pipe → socket when no toxic needs to see them.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
import struct
from collections.abc import Callable
from typing import Any, Protocol

MAX_READ_BYTES = 256 * 1024
SPLICE_MAX_BYTES = 1024 * 1024
WRITE_HIGH_BYTES = 256 * 1024
CAN_SPLICE = hasattr(os, "splice")
_SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 0) | getattr(os, "SPLICE_F_NONBLOCK", 0)
_F_SETPIPE_SZ = 1031
_SPLICE_ROUNDS = 8


class Owner(Protocol):
    """What a :class:`SockIO` reports to (the connection)."""

    def on_data(self, side: str, data: bytes) -> None: ...
    def on_spliced(self, side: str, nbytes: int) -> None: ...
    def on_eof(self, side: str) -> None: ...
    def on_error(self, side: str, exc: OSError) -> None: ...
    def on_closed(self, side: str) -> None: ...
    def on_write_paused(self, side: str) -> None: ...
    def on_write_resumed(self, side: str) -> None: ...
    def splice_target(self, side: str) -> SockIO | None: ...


class SockIO:
    """One connected, non-blocking TCP socket driven by loop reader/writer callbacks."""

    def __init__(self, owner: Owner, side: str, sock: socket.socket) -> None:
        self.owner = owner
        self.side = side
        self.sock = sock
        self.fd = sock.fileno()
        self.loop = asyncio.get_running_loop()
        sock.setblocking(False)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()
        self.spliced_pending = 0  # bytes sitting in our kernel pipe, waiting for this socket
        self._kpipe: tuple[int, int] | None = None
        self._reading = False
        self._writing = False
        self._write_paused = False
        self._eof_wanted = False
        self._closing = False
        self.closed = False

    # -- transport-like surface -----------------------------------------------------------------
    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """``socket`` or ``peername``, like an asyncio transport."""
        if name == "socket":
            return self.sock
        if name == "peername":
            with contextlib.suppress(OSError):
                return self.sock.getpeername()
        return default

    def is_closing(self) -> bool:
        """True once close/abort started."""
        return self._closing or self.closed

    def pause_reading(self) -> None:
        """Stop reading (back-pressure)."""
        if self._reading and not self.closed:
            self.loop.remove_reader(self.fd)
        self._reading = False

    def resume_reading(self) -> None:
        """Read again."""
        if not self._reading and not self.is_closing():
            self.loop.add_reader(self.fd, self._on_readable)
            self._reading = True

    def can_write_eof(self) -> bool:
        """TCP can half-close."""
        return True

    def write(self, data: bytes) -> None:
        """Send now if possible, buffer the rest (after anything spliced before it)."""
        if self.is_closing():
            return
        if self.buf or self.spliced_pending:
            self.buf += data
        else:
            try:
                sent = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self._fail(exc)
                return
            if sent < len(data):
                self.buf += memoryview(data)[sent:]
        self._settle()

    def write_eof(self) -> None:
        """Half-close once everything queued is sent."""
        self._eof_wanted = True
        self._settle()

    def close(self) -> None:
        """Close after flushing what is queued."""
        if self.is_closing():
            return
        self._closing = True
        self.pause_reading()
        self._settle()

    def abort(self) -> None:
        """Close now, dropping anything queued."""
        if self.closed:
            return
        self.pause_reading()
        if self._writing:
            self.loop.remove_writer(self.fd)
            self._writing = False
        self.closed = True
        self._closing = True
        self.sock.close()
        self._close_kpipe()
        self.owner.on_closed(self.side)

    def reset(self) -> None:
        """Abort with SO_LINGER 0 so the peer gets a RST."""
        if not self.closed:
            with contextlib.suppress(OSError):
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.abort()

    # -- reading --------------------------------------------------------------------------------
    def _on_readable(self) -> None:
        target = self.owner.splice_target(self.side) if CAN_SPLICE else None
        if target is not None and not target.buf and not target.is_closing():
            self._splice_into(target)
            return
        try:
            data = self.sock.recv(MAX_READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._fail(exc)
            return
        if not data:
            self.pause_reading()
            self.owner.on_eof(self.side)
            return
        self.owner.on_data(self.side, data)

    def _splice_into(self, target: SockIO) -> None:
        """Move what is readable straight to ``target`` (a few rounds, fewer loop wakeups)."""
        _, write_end = target.kpipe()
        total = 0
        for _ in range(_SPLICE_ROUNDS):
            try:
                moved = os.splice(self.fd, write_end, SPLICE_MAX_BYTES, flags=_SPLICE_FLAGS)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._fail(exc)
                return
            if moved == 0:
                self._spliced(target, total)
                self.pause_reading()
                self.owner.on_eof(self.side)
                return
            total += moved
            target.spliced_pending += moved
            if not target._drain_spliced():
                break
        self._spliced(target, total)

    def _spliced(self, target: SockIO, total: int) -> None:
        if total:
            self.owner.on_spliced(self.side, total)
        target._settle()

    def _drain_spliced(self) -> bool:
        """Push spliced bytes into this socket; True when none are left."""
        read_end = self.kpipe()[0]
        try:
            while self.spliced_pending:
                out = os.splice(read_end, self.fd, self.spliced_pending, flags=_SPLICE_FLAGS)
                self.spliced_pending -= out
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            self._fail(exc)
            return False
        return True

    # -- writing --------------------------------------------------------------------------------
    def kpipe(self) -> tuple[int, int]:
        """The kernel pipe that carries spliced bytes to this socket (made on first use)."""
        if self._kpipe is None:
            read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            with contextlib.suppress(OSError):
                fcntl.fcntl(write_end, _F_SETPIPE_SZ, SPLICE_MAX_BYTES)
            self._kpipe = (read_end, write_end)
        return self._kpipe

    def _flush(self) -> None:
        try:
            while self.spliced_pending:
                read_end = self.kpipe()[0]
                out = os.splice(read_end, self.fd, self.spliced_pending, flags=_SPLICE_FLAGS)
                self.spliced_pending -= out
            while self.buf:
                sent = self.sock.send(self.buf)
                del self.buf[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            self._fail(exc)
            return
        self._settle()

    def _settle(self) -> None:
        """Register for writability while data waits; signal back-pressure; finish closes."""
        if self.closed:
            return
        pending = self.spliced_pending + len(self.buf)
        if pending:
            if not self._writing:
                self.loop.add_writer(self.fd, self._flush)
                self._writing = True
            limit = 0 if self.spliced_pending else WRITE_HIGH_BYTES
            if pending > limit and not self._write_paused:
                self._write_paused = True
                self.owner.on_write_paused(self.side)
            return
        if self._writing:
            self.loop.remove_writer(self.fd)
            self._writing = False
        if self._write_paused:
            self._write_paused = False
            self.owner.on_write_resumed(self.side)
        if self._closing:
            self.abort()
        elif self._eof_wanted:
            self._eof_wanted = False
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_WR)

    def _fail(self, exc: OSError) -> None:
        self.owner.on_error(self.side, exc)

    def _close_kpipe(self) -> None:
        if self._kpipe is not None:
            for fd in self._kpipe:
                os.close(fd)
            self._kpipe = None


def listen(
    host: str, port: int, on_socket: Callable[[socket.socket], None]
) -> tuple[socket.socket, Callable[[], None]]:
    """Bind a listening socket and accept with a loop reader; returns it and a stop function."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    lsock = socket.create_server((host, port), family=family, backlog=1024)
    lsock.setblocking(False)
    loop = asyncio.get_running_loop()

    def accept() -> None:
        for _ in range(64):
            try:
                conn, _ = lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            on_socket(conn)

    loop.add_reader(lsock.fileno(), accept)

    def stop() -> None:
        loop.remove_reader(lsock.fileno())
        lsock.close()

    return lsock, stop
