"""What a probe server allows: its limits, and the budget each session gets from them.

A session that proved the shared secret gets the configured maximum; one that proved nothing
(a server without a secret) gets what its ``hello`` planned, within smaller caps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ServerLimits:
    """Bounds that keep a server left on a link from being used as a traffic generator."""

    max_test_s: float = 60.0
    max_test_bytes: int = 256 * 1024**3
    max_sessions: int = 64
    max_probes_per_stream: int = 1_000_000  # sequence numbers below this, one bit each
    max_probe_streams_per_session: int = 16  # probe-link uses 4
    max_chunk_bytes: int = 64 * 1024 * 1024
    idle_timeout_s: float = 120.0
    # Against one client using the server as a traffic generator, or flooding it with
    # connections (a server with no --secret lets anyone open a session):
    max_connections: int = 1024
    max_connections_per_peer: int = 128
    max_data_connections_per_session: int = 16
    max_session_bytes: int = 64 * 1024**3
    # A session that has not proved the secret (the server has none) gets what its hello
    # planned (streams at once; seconds of data tests at anonymous_gbps), within these:
    anonymous_data_connections: int = 4
    anonymous_session_bytes: int = 16 * 10**9
    anonymous_gbps: float = 40.0

    def as_dict(self) -> dict[str, Any]:
        """Limits as announced to clients."""
        return {
            "max_test_s": self.max_test_s,
            "max_test_bytes": self.max_test_bytes,
            "max_probes_per_stream": self.max_probes_per_stream,
            "max_probe_streams_per_session": self.max_probe_streams_per_session,
            "max_chunk_bytes": self.max_chunk_bytes,
            "max_data_connections_per_session": self.max_data_connections_per_session,
            "max_session_bytes": self.max_session_bytes,
            "anonymous_data_connections": self.anonymous_data_connections,
            "anonymous_session_bytes": self.anonymous_session_bytes,
            "anonymous_gbps": self.anonymous_gbps,
        }

    def budget(self, plan: tuple[int, float] | None, *, authenticated: bool) -> SessionBudget:
        """What one session may use. ``plan`` is what its hello asked for (data connections
        open at once, seconds of data tests), None when it named none."""
        if authenticated:  # proved the secret: the configured maximum, streams as planned
            most = self.max_data_connections_per_session
            streams = most if plan is None else min(plan[0], most)
            return SessionBudget(
                data_connections=streams,
                bytes=self.max_session_bytes,
                authenticated=True,
                capped=False,
                data_connections_basis=_basis(streams < most, "--max-data-connections"),
                bytes_basis="--max-session-gb",
            )
        streams, seconds = plan or (1, 1.0)  # nothing planned: one stream for one second
        most = min(self.anonymous_data_connections, self.max_data_connections_per_session)
        most_bytes = min(self.anonymous_session_bytes, self.max_session_bytes)
        wanted = int(seconds * self.anonymous_gbps * 1e9 / 8)
        planned = f"{seconds:g} s of tests at --anonymous-gbps {self.anonymous_gbps:g}"
        return SessionBudget(
            data_connections=min(streams, most),
            bytes=min(wanted, most_bytes),
            authenticated=False,
            capped=wanted > most_bytes,
            data_connections_basis=_basis(
                streams <= most, "--anonymous-data-connections, no secret"
            ),
            bytes_basis=_basis(wanted <= most_bytes, "--anonymous-session-gb, no secret", planned),
        )


def _basis(planned: bool, limit: str, plan: str = "") -> str:
    """Which bound set a budget figure, for the message that refuses past it."""
    return f"what its hello planned{': ' + plan if plan else ''}" if planned else limit


@dataclass(frozen=True)
class SessionBudget:
    """What one session may use: data connections open at once, bytes over all of them."""

    data_connections: int
    bytes: int
    authenticated: bool
    capped: bool  # its plan asked for more bytes than the server grants
    data_connections_basis: str  # which limit set data_connections, for error messages
    bytes_basis: str

    def as_dict(self) -> dict[str, Any]:
        """As announced in the hello reply."""
        return {"data_connections": self.data_connections, "bytes": self.bytes,
                "authenticated": self.authenticated, "capped": self.capped}  # fmt: skip
