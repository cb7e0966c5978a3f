"""The wire capture's parsing and the canary it looks for (the capture itself runs in
tests/accept/test_accept_netns.py, across real namespaces, with TLS on and off)."""

from __future__ import annotations

import struct

import pytest

from pdx.accept.target.wire import canary_ids, patterns, varints
from pdx.faults.wire import main, payload

ETH_IP4, ETH_IP6 = b"\x00" * 12 + b"\x08\x00", b"\x00" * 12 + b"\x86\xdd"


def ip4_tcp(data: bytes, options: bytes = b"") -> bytes:
    tcp = b"\x00" * 12 + bytes([((20 + len(options)) // 4) << 4]) + b"\x00" * 7 + options
    ip = bytearray(20)
    ip[0], ip[9] = 0x45, 6
    struct.pack_into("!H", ip, 2, 20 + len(tcp) + len(data))
    return ETH_IP4 + bytes(ip) + tcp + data + b"\x00" * 6  # Ethernet padding is not payload


def ip6_udp(data: bytes) -> bytes:
    ip = bytearray(40)
    ip[0], ip[6] = 0x60, 17
    struct.pack_into("!H", ip, 4, 8 + len(data))
    return ETH_IP6 + bytes(ip) + b"\x00" * 8 + data


def test_payload_of_tcp_and_udp_frames_nothing_else() -> None:
    assert payload(ip4_tcp(b"secret prompt")) == b"secret prompt"
    assert payload(ip4_tcp(b"after options", options=b"\x01" * 12)) == b"after options"
    assert payload(ip6_udp(b"datagram")) == b"datagram"
    assert payload(ip4_tcp(b"")) == b""  # a bare ACK carries nothing
    assert payload(b"\x00" * 12 + b"\x08\x06" + b"\x00" * 28) == b""  # ARP
    assert payload(b"\x00" * 10) == b""


def test_the_canary_as_it_travels_in_the_clear() -> None:
    assert varints([1, 127, 128, 300]) == bytes([1, 127, 0x80, 1, 0xAC, 2])
    ids = canary_ids(7, 255)
    assert ids == canary_ids(7, 255) != canary_ids(8, 255)
    assert len(ids) == 12 and all(4 <= i <= 255 for i in ids)
    grpc, text = patterns(ids)
    assert grpc == varints(ids) and text == ",".join(map(str, ids)).encode()
    assert len(grpc) >= 12 and len(text) >= 12


@pytest.mark.parametrize(
    ("args", "needle"),
    [([], "--iface"), (["--iface", "lo"], "--pattern"), (["--iface", "lo", "--pattern", "zz"],
     "hex bytes"), (["--iface", "lo", "--pattern", "0102"], "8 bytes or more")],
)  # fmt: skip
def test_bad_arguments_are_refused_with_the_reason(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2 and needle in capsys.readouterr().err
