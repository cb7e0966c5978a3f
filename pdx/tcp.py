"""TCP facts and knobs of a Linux socket: ``TCP_INFO``, congestion control, buffer limits.

Shared by the link probe (what capped a stream), the KV transfer (congestion control per
socket, buffers sized to the path) and the WAN tests (the RTT TCP itself measured). The
standard ``socket`` module names ``TCP_INFO`` and ``TCP_CONGESTION`` but not the layout of
``struct tcp_info`` (``include/uapi/linux/tcp.h``), which is read here by offset.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

TCP_INFO = getattr(socket, "TCP_INFO", 11)
TCP_CONGESTION = getattr(socket, "TCP_CONGESTION", 13)
_INFO_BYTES = 232
_SYSCTL = Path("/proc/sys/net")


@dataclass(frozen=True)
class TcpInfo:
    """The parts of ``struct tcp_info`` pdx uses (times in ms, sizes in bytes/segments)."""

    rtt_ms: float  # smoothed RTT
    rttvar_ms: float
    min_rtt_ms: float
    snd_cwnd: int  # segments
    snd_mss: int
    total_retrans: int
    bytes_acked: int
    delivery_rate_bps: int  # bytes/s
    busy_ms: float  # time with data in flight
    rwnd_limited_ms: float  # ... of it limited by the receiver's window
    sndbuf_limited_ms: float  # ... of it limited by this socket's send buffer

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (JSON)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TcpInfo:
        """Back from :meth:`as_dict` (extra keys ignored)."""
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})

    @property
    def limited_by(self) -> str | None:
        """``send buffer`` / ``receive window`` when that limited the stream most of its busy
        time, else None."""
        if self.busy_ms <= 0:
            return None
        if self.sndbuf_limited_ms / self.busy_ms > 0.5:
            return "send buffer"
        if self.rwnd_limited_ms / self.busy_ms > 0.5:
            return "receive window"
        return None


def tcp_info(sock: socket.socket) -> TcpInfo | None:
    """``TCP_INFO`` of a connected TCP socket, or None where the kernel gives less."""
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, TCP_INFO, _INFO_BYTES)
    except OSError:
        return None
    if len(raw) < 192:
        return None
    u32 = lambda off: struct.unpack_from("=I", raw, off)[0]  # noqa: E731
    u64 = lambda off: struct.unpack_from("=Q", raw, off)[0]  # noqa: E731
    return TcpInfo(
        rtt_ms=u32(68) / 1e3,
        rttvar_ms=u32(72) / 1e3,
        min_rtt_ms=u32(148) / 1e3,
        snd_cwnd=u32(80),
        snd_mss=u32(16),
        total_retrans=u32(100),
        bytes_acked=u64(120),
        delivery_rate_bps=u64(160),
        busy_ms=u64(168) / 1e3,
        rwnd_limited_ms=u64(176) / 1e3,
        sndbuf_limited_ms=u64(184) / 1e3,
    )


def congestion_control(sock: socket.socket) -> str | None:
    """The congestion-control algorithm of ``sock`` (``cubic``, ``bbr``, ...)."""
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, TCP_CONGESTION, 16)
    except OSError:
        return None
    return raw.split(b"\0", 1)[0].decode() or None


def set_congestion_control(sock: socket.socket, name: str) -> None:
    """Use ``name`` for this socket; ``OSError`` when the kernel does not have it."""
    sock.setsockopt(socket.IPPROTO_TCP, TCP_CONGESTION, name.encode())


def _read(path: str) -> str | None:
    try:
        return (_SYSCTL / path).read_text().strip()
    except OSError:
        return None


def available_congestion_controls() -> list[str]:
    """Algorithms this kernel offers (``net.ipv4.tcp_available_congestion_control``)."""
    return (_read("ipv4/tcp_available_congestion_control") or "").split()


def default_congestion_control() -> str | None:
    """The namespace's default algorithm (``net.ipv4.tcp_congestion_control``)."""
    return _read("ipv4/tcp_congestion_control")


@dataclass(frozen=True)
class BufferLimits:
    """The sysctls that cap one TCP stream's window, in bytes."""

    tcp_wmem_max: int | None  # net.ipv4.tcp_wmem[2]: autotuned send buffer cap
    tcp_rmem_max: int | None  # net.ipv4.tcp_rmem[2]: autotuned receive buffer cap
    wmem_max: int | None  # net.core.wmem_max: cap of an explicit SO_SNDBUF
    rmem_max: int | None  # net.core.rmem_max: cap of an explicit SO_RCVBUF
    slow_start_after_idle: bool | None  # net.ipv4.tcp_slow_start_after_idle

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (JSON)."""
        return asdict(self)


def _third(text: str | None) -> int | None:
    parts = (text or "").split()
    return int(parts[2]) if len(parts) == 3 and parts[2].isascii() and parts[2].isdigit() else None


def _int(text: str | None) -> int | None:
    return int(text) if text and text.isascii() and text.isdigit() else None


def buffer_limits() -> BufferLimits:
    """This namespace's TCP buffer sysctls."""
    ssai = _read("ipv4/tcp_slow_start_after_idle")
    return BufferLimits(
        tcp_wmem_max=_third(_read("ipv4/tcp_wmem")),
        tcp_rmem_max=_third(_read("ipv4/tcp_rmem")),
        wmem_max=_int(_read("core/wmem_max")),
        rmem_max=_int(_read("core/rmem_max")),
        slow_start_after_idle=None if ssai is None else ssai == "1",
    )


def tcp_facts() -> dict[str, Any]:
    """This namespace's TCP defaults: congestion control and the buffer sysctls that cap a
    stream (what ``probe-link`` reports for each end)."""
    return {
        "congestion_control": default_congestion_control(),
        "available": available_congestion_controls(),
        "buffers": buffer_limits().as_dict(),
    }


def bdp_bytes(rate_bps: float, rtt_ms: float) -> int:
    """Bandwidth-delay product: bytes in flight that keep a path of ``rate_bps`` (bits/s) busy."""
    return int(rate_bps / 8 * rtt_ms / 1e3)


def window_for(bdp: int) -> int:
    """A buffer size that does not cap a stream on a path of ``bdp`` bytes: twice the BDP
    (Linux counts bookkeeping against the buffer, about half of it carries data), rounded up
    to a MiB."""
    mib = 1 << 20
    return max(4 * mib, -(-2 * bdp // mib) * mib)
