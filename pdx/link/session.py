"""One probe session's state on the server: its UDP probe streams, its data connections
and what they moved against the session's budget."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdx.link import protocol as proto
from pdx.link.budget import SessionBudget

log = logging.getLogger("pdx.link.server")  # the probe server's one logger


class DataConnection(Protocol):
    """A live data connection of a session, which a spent budget stops."""

    def stop(self) -> None:
        """End the connection now."""


class Refused(proto.ProtocolError):
    """A data connection over its session's budget: answered, then closed."""


@dataclass
class ProbeStream:
    """The sequence numbers of one UDP probe stream the reflector saw, one bit each: 125 KB
    at most for the 10^6 a stream may use (a set of ints would take ~60 MB)."""

    seen: bytearray = field(default_factory=bytearray)
    duplicates: int = 0

    def add(self, seq: int) -> None:
        """Record ``seq``; a second copy counts as a duplicate."""
        byte, bit = divmod(seq, 8)
        if byte >= len(self.seen):
            self.seen.extend(bytes(byte + 1 - len(self.seen)))
        if self.seen[byte] >> bit & 1:
            self.duplicates += 1
        self.seen[byte] |= 1 << bit

    def count_below(self, n: int) -> int:
        """Distinct sequence numbers seen below ``n``."""
        full, rest = divmod(max(0, min(n, 8 * len(self.seen))), 8)
        count = int.from_bytes(self.seen[:full], "little").bit_count()
        if rest:
            count += (self.seen[full] & ((1 << rest) - 1)).bit_count()
        return count


@dataclass
class Session:
    sid: bytes
    udp_key: bytes | None
    budget: SessionBudget
    streams: dict[int, ProbeStream] = field(default_factory=dict)
    test_epochs: dict[str, float] = field(default_factory=dict)
    # TCP_INFO of this session's download (source) streams, by test; bounded per test
    tcp_reports: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    peer_ip: str = ""  # UDP probes are answered only to the address that opened it
    data: set[DataConnection] = field(default_factory=set)  # its live data connections
    data_connections: int = 0
    bytes_moved: int = 0  # of budget.bytes, over all its data connections
    refused: int = 0  # data connections refused for its budget
    stopped: str = ""  # why its budget ended its data connections ("" while it has not)

    def epoch(self, test: str) -> float:
        """Common time origin of all data connections of one test (bins line up across streams)."""
        return self.test_epochs.setdefault(test, time.monotonic())

    def name(self) -> str:
        """``session 1a2b3c4d from 127.0.0.1 (no secret)``, for log lines."""
        proof = "secret" if self.budget.authenticated else "no secret"
        return f"session {self.sid.hex()[:8]} from {self.peer_ip} ({proof})"

    def refuse(self, why: str) -> Refused:
        """Count a refused data connection; the first one of a session is logged."""
        self.refused += 1
        if self.refused == 1:
            log.warning("probe %s: data connection refused: %s (later refusals are counted)",
                        self.name(), why)  # fmt: skip
        return Refused(why)

    def left(self) -> int:
        """Bytes its budget still allows."""
        return self.budget.bytes - self.bytes_moved

    def spent(self) -> str:
        """Why a spent budget refuses more."""
        return (f"this session moved its budget of {self.budget.bytes / 1e9:.3g} GB "
                f"({self.budget.bytes_basis})")  # fmt: skip

    def spend(self, nbytes: int) -> bool:
        """Count bytes moved; True once the budget is spent (then every stream is stopped)."""
        self.bytes_moved += nbytes
        if self.left() > 0:
            return False
        if not self.stopped:
            self.stopped = self.spent()
            log.warning("probe %s: %s; its data connections are closed", self.name(),
                        self.stopped)  # fmt: skip
            for conn in list(self.data):
                conn.stop()
        return True
