"""Wire formats: frames and probes survive a round trip; tampering is caught."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdx.link import protocol as proto

u64 = st.integers(min_value=0, max_value=2**64 - 1)


def _split(frame: bytes) -> tuple[int, bytes, bytes]:
    length, mac = proto.parse_header(frame[: proto.FRAME_HEADER.size])
    return length, mac, frame[proto.FRAME_HEADER.size :]


@given(
    st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=20), max_size=5),
    st.one_of(st.none(), st.binary(min_size=1, max_size=16)),
)
def test_frames_round_trip(extra: dict[str, object], secret: bytes | None) -> None:
    message = {**extra, "op": "hello"}
    nonce = proto.new_nonce()
    length, mac, body = _split(proto.encode_frame(message, secret, nonce))
    assert length == len(body)
    assert proto.decode_body(body, mac, secret, nonce) == message


def test_a_frame_signed_for_another_connection_is_refused() -> None:
    frame = proto.encode_frame({"op": "hello"}, b"k", proto.new_nonce())
    _, mac, body = _split(frame)
    with pytest.raises(proto.ProtocolError, match="authentication"):
        proto.decode_body(body, mac, b"k", proto.new_nonce())


def test_oversized_and_malformed_frames_are_rejected() -> None:
    with pytest.raises(proto.ProtocolError, match="exceeds"):
        proto.parse_header(proto.FRAME_HEADER.pack(proto.MAX_FRAME_BYTES + 1, proto.ZERO_MAC))
    with pytest.raises(proto.ProtocolError, match="not JSON"):
        proto.decode_body(b"\xff{", proto.ZERO_MAC, None, b"")
    with pytest.raises(proto.ProtocolError, match="string 'op'"):
        proto.decode_body(b"[1, 2]", proto.ZERO_MAC, None, b"")


@given(
    st.integers(min_value=0, max_value=1),
    st.integers(min_value=0, max_value=65535),
    st.binary(min_size=8, max_size=8),
    u64,
    u64,
    st.integers(min_value=0, max_value=2000),
    st.booleans(),
)
def test_probes_round_trip(
    kind: int, stream: int, session: bytes, seq: int, tx: int, size: int, keyed: bool
) -> None:
    key = proto.session_key(b"secret", session) if keyed else None
    probe = proto.Probe(kind, stream, session, seq, tx, tx // 2, tx // 3)
    data = proto.pack_probe(probe, key, size)
    assert len(data) == max(size, proto.PROBE.size)
    assert proto.unpack_probe(data, key) == probe


def test_a_tampered_probe_is_refused() -> None:
    key = proto.session_key(b"secret", b"12345678")
    data = bytearray(proto.pack_probe(proto.Probe(0, 1, b"12345678", 7, 1), key))
    data[20] ^= 1  # flip a bit of the sequence number
    with pytest.raises(proto.ProtocolError, match="MAC"):
        proto.unpack_probe(bytes(data), key)
    with pytest.raises(proto.ProtocolError):
        proto.unpack_probe(b"short", key)
