"""Linux socket options the standard ``socket`` module does not name, and kernel timestamps."""

from __future__ import annotations

import socket
import struct
import time

# From <asm-generic/socket.h> and <linux/in.h>, <linux/in6.h>.
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
IP_MTU_DISCOVER = getattr(socket, "IP_MTU_DISCOVER", 10)
IP_PMTUDISC_DO = getattr(socket, "IP_PMTUDISC_DO", 2)
IP_MTU = getattr(socket, "IP_MTU", 14)
IPV6_MTU_DISCOVER = getattr(socket, "IPV6_MTU_DISCOVER", 23)
IPV6_PMTUDISC_DO = getattr(socket, "IPV6_PMTUDISC_DO", 2)
IPV6_MTU = getattr(socket, "IPV6_MTU", 24)

_TIMESPEC = struct.Struct("@qq")
ANCILLARY_BYTES = socket.CMSG_SPACE(_TIMESPEC.size)


def enable_rx_timestamps(sock: socket.socket) -> bool:
    """Ask the kernel to stamp each received datagram (CLOCK_REALTIME, ns). False if refused."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    except OSError:
        return False
    return True


def rx_timestamp_ns(ancdata: list[tuple[int, int, bytes]]) -> int:
    """Kernel receive time from ``recvmsg`` ancillary data, or now when absent."""
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= _TIMESPEC.size:
            sec, nsec = _TIMESPEC.unpack(data[: _TIMESPEC.size])
            return sec * 1_000_000_000 + nsec
    return time.time_ns()


def set_dont_fragment(sock: socket.socket) -> None:
    """Set the DF bit and forbid local fragmentation (``IP_PMTUDISC_DO``)."""
    if sock.family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, IPV6_MTU_DISCOVER, IPV6_PMTUDISC_DO)
    else:
        sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)


def kernel_path_mtu(sock: socket.socket) -> int | None:
    """The kernel's current path MTU estimate for a connected socket."""
    try:
        if sock.family == socket.AF_INET6:
            return int(sock.getsockopt(socket.IPPROTO_IPV6, IPV6_MTU))
        return int(sock.getsockopt(socket.IPPROTO_IP, IP_MTU))
    except OSError:
        return None
