"""Ports picked for a listener that another process starts later."""

from __future__ import annotations

import socket

import pytest

from pdx import netaddr
from pdx.netaddr import ephemeral_range, listen_ports


def test_ports_for_later_listeners_lie_outside_the_ephemeral_range() -> None:
    lo, hi = ephemeral_range()
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        assert (lo, hi) == tuple(int(x) for x in f.read().split())
    ports = [p for _ in range(20) for p in listen_ports("127.0.0.1", 3)]
    assert all(not lo <= p <= hi and p >= 1024 for p in ports)
    assert len(set(ports[:3])) == 3  # distinct within one call
    for p in ports[:3]:  # and free: each binds now
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_held_by_a_listener_is_never_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        # a range with room for this one port and one other only
        monkeypatch.setattr(netaddr, "LISTEN_PORTS_FROM", port)
        monkeypatch.setattr(netaddr, "MIN_POOL", 1)
        monkeypatch.setattr(netaddr, "ephemeral_range", lambda: (port + 2, 65535))
        picked = {listen_ports("127.0.0.1", 1)[0] for _ in range(10)}
    assert port not in picked
    if picked != {port + 1}:  # only when that one was taken too (then the kernel chose)
        with pytest.raises(OSError), socket.socket() as s:
            s.bind(("127.0.0.1", port + 1))


def test_with_no_room_outside_the_range_the_kernel_chooses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(netaddr, "ephemeral_range", lambda: (1024, 65535))
    ports = listen_ports("127.0.0.1", 2)
    assert len(set(ports)) == 2 and all(p > 0 for p in ports)
