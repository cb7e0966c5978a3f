"""Wire formats shared by the probe server and client.

Control frames (TCP): ``u32 body length | 32-byte MAC | JSON body``. The server opens every
connection with a ``welcome`` frame that carries a random nonce; with a shared secret each
later frame's MAC is HMAC-SHA256(secret, nonce || body), both ways, so frames cannot be
forged or replayed on another connection. Without a secret the MAC field is zero.

UDP probes: a fixed header (``PROBE``) padded to the requested size; with a secret the last
16 header bytes are a truncated HMAC over the rest of the header, keyed per session.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import struct
from dataclasses import dataclass
from typing import Any

from pdx.errors import MeasurementError

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 64 * 1024
FRAME_HEADER = struct.Struct("!I32s")
ZERO_MAC = b"\0" * 32

# magic, version, kind, stream, session, seq, client_tx_ns, server_rx_ns, server_tx_ns, mac
PROBE = struct.Struct("!4sBBH8sQQQQ16s")
PROBE_MAGIC = b"PDXP"
KIND_REQUEST = 0
KIND_REPLY = 1
ZERO_PROBE_MAC = b"\0" * 16

# Chunk framing on a ``chunks`` data connection: u64 length then payload; ack = u64 length.
CHUNK_HEADER = struct.Struct("!Q")


class ProtocolError(MeasurementError):
    """A frame or packet that does not follow the probe protocol."""


def new_nonce() -> bytes:
    """16 random bytes, the per-connection MAC salt."""
    return secrets.token_bytes(16)


def frame_mac(secret: bytes | None, nonce: bytes, body: bytes) -> bytes:
    """MAC of one control frame (zero without a secret)."""
    if not secret:
        return ZERO_MAC
    return hmac.new(secret, nonce + body, hashlib.sha256).digest()


def encode_frame(message: dict[str, Any], secret: bytes | None, nonce: bytes) -> bytes:
    """Serialise one control message into a frame."""
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return FRAME_HEADER.pack(len(body), frame_mac(secret, nonce, body)) + body


def parse_header(header: bytes) -> tuple[int, bytes]:
    """Split a frame header into (body length, MAC); reject oversized frames."""
    length, mac = FRAME_HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    return length, mac


def decode_body(body: bytes, mac: bytes, secret: bytes | None, nonce: bytes) -> dict[str, Any]:
    """Check the MAC and parse the JSON object of one frame."""
    if secret and not hmac.compare_digest(mac, frame_mac(secret, nonce, body)):
        raise ProtocolError("authentication failed (wrong or missing secret)")
    try:
        message = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"frame is not JSON: {exc.__class__.__name__}") from None
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise ProtocolError("frame must be a JSON object with a string 'op'")
    return message


@dataclass
class Probe:
    """One UDP probe or its reflection."""

    kind: int
    stream: int
    session: bytes
    seq: int
    client_tx_ns: int
    server_rx_ns: int = 0
    server_tx_ns: int = 0


def session_key(secret: bytes | None, session: bytes) -> bytes | None:
    """Per-session key for probe MACs, derived from the shared secret."""
    if not secret:
        return None
    return hmac.new(secret, b"pdx-probe-udp" + session, hashlib.sha256).digest()


def _probe_mac(key: bytes | None, unsigned: bytes) -> bytes:
    if key is None:
        return ZERO_PROBE_MAC
    return hmac.new(key, unsigned, hashlib.sha256).digest()[:16]


def pack_probe(probe: Probe, key: bytes | None, size: int = 0) -> bytes:
    """Serialise a probe, padded with zeros to ``size`` bytes (at least the header)."""
    fields = (
        PROBE_MAGIC,
        PROTOCOL_VERSION,
        probe.kind,
        probe.stream,
        probe.session,
        probe.seq,
        probe.client_tx_ns,
        probe.server_rx_ns,
        probe.server_tx_ns,
    )
    unsigned = PROBE.pack(*fields, ZERO_PROBE_MAC)[: -len(ZERO_PROBE_MAC)]
    header = unsigned + _probe_mac(key, unsigned)
    return header + b"\0" * max(0, size - len(header))


def unpack_probe(data: bytes | memoryview, key: bytes | None) -> Probe:
    """Parse and authenticate a probe header; padding is ignored."""
    if len(data) < PROBE.size:
        raise ProtocolError("probe shorter than its header")
    raw = bytes(data[: PROBE.size])
    magic, version, kind, stream, session, seq, ctx, srx, stx, mac = PROBE.unpack(raw)
    if magic != PROBE_MAGIC or version != PROTOCOL_VERSION:
        raise ProtocolError("not a pdx probe")
    if key is not None and not hmac.compare_digest(mac, _probe_mac(key, raw[:-16])):
        raise ProtocolError("probe MAC mismatch")
    return Probe(kind, stream, session, seq, ctx, srx, stx)
