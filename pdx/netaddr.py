"""Parsing ``HOST:PORT`` addresses given on the command line, in one place."""

from __future__ import annotations

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
