"""Parsing ``HOST:PORT`` addresses given on the command line, and picking ports for
listeners started later, in one place."""

from __future__ import annotations

import random
import socket

from pdx.errors import InputError


def parse_hostport(
    text: str, field: str, *, allow_port_zero: bool = False, numeric_host: bool = False
) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` → (host, port), with an error naming ``field``.

    ``allow_port_zero`` is for listening addresses (0 = any free port); ``numeric_host``
    refuses names (``localhost`` is accepted and becomes 127.0.0.1).
    """
    low = 0 if allow_port_zero else 1
    host, sep, port_text = text.rpartition(":")
    host = host.strip("[]")
    if numeric_host and host == "localhost":
        host = "127.0.0.1"
    digits = port_text.isascii() and port_text.isdigit()  # "²".isdigit(), but int() refuses it
    if not sep or not host or not digits or not low <= int(port_text) <= 65535:
        raise InputError(field, text, f"HOST:PORT with a port in {low}..65535")
    if numeric_host:
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
        except socket.gaierror:
            raise InputError(field, text, "a numeric IP address such as 127.0.0.1") from None
    return host, int(port_text)


#: Where a port for a later listener is drawn from, before falling back to the whole range
#: outside the kernel's ephemeral ports: well above the common services' low ports.
LISTEN_PORTS_FROM = 20000
#: Fewer ports than this there (a wide ephemeral range): every port outside it from 1024 on.
MIN_POOL = 1000
_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral ports (``net.ipv4.ip_local_port_range``, of this process's
    network namespace); Linux's default when it cannot be read."""
    try:
        with open(_RANGE_FILE) as f:
            lo, hi = (int(x) for x in f.read().split()[:2])
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def listen_ports(host: str, count: int, *, tries: int = 200) -> list[int]:
    """``count`` distinct ports free on ``host`` now, for a process that binds them later.

    Drawn outside the ephemeral range: a port the kernel hands out from bind(0) or to an
    outgoing connection can be taken by anyone on the box between this check and the other
    process's bind, one outside it only by a listener that names it. Each is checked by
    binding it; the kernel's own choice is the fallback when no such port is free.
    """
    lo, hi = ephemeral_range()
    pool = [(a, b) for a, b in ((LISTEN_PORTS_FROM, lo - 1), (hi + 1, 65535)) if b >= a]
    if sum(b - a + 1 for a, b in pool) < MIN_POOL:
        pool = [(a, b) for a, b in ((1024, lo - 1), (hi + 1, 65535)) if b >= a]
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    rng = random.SystemRandom()
    held: list[socket.socket] = []
    try:
        while len(held) < count:
            held.append(_bind_one(host, family, pool, rng, tries))
        return [int(s.getsockname()[1]) for s in held]
    finally:
        for s in held:
            s.close()


def listen_port(host: str = "127.0.0.1") -> int:
    """One port for a tool that binds later and cannot report a port-0 bind
    (:func:`listen_ports`)."""
    return listen_ports(host, 1)[0]


def _bind_one(
    host: str, family: int, pool: list[tuple[int, int]], rng: random.Random, tries: int
) -> socket.socket:
    weights = [b - a + 1 for a, b in pool]
    for _ in range(tries if pool else 0):
        a, b = rng.choices(pool, weights)[0]
        s = socket.socket(family, socket.SOCK_STREAM)
        try:
            s.bind((host, rng.randint(a, b)))
            return s
        except OSError:
            s.close()
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.bind((host, 0))
    except OSError:
        s.close()
        raise
    return s
