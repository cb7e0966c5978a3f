"""Fixtures for link probing: a real probe server on an ephemeral loopback port."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdx.link.server import ProbeServer, ServerLimits, ServerThread


@pytest.fixture
def probe_server() -> Iterator[ProbeServer]:
    """A probe server without a secret on 127.0.0.1, stopped by handle after the test."""
    with ServerThread(ProbeServer("127.0.0.1", 0, limits=ServerLimits(max_test_s=10))) as st:
        yield st.server


@pytest.fixture
def loopback_probe_server() -> Iterator[ProbeServer]:
    """``probe_server`` with an anonymous budget sized for loopback: an idle machine moves
    20-40 Gbit/s per stream and direction there, more than the defaults plan for a real link
    (40 Gbit/s in all, 16 GB a session), so a throughput test measures the probe, not that
    limit (which has its own tests)."""
    limits = ServerLimits(max_test_s=10, anonymous_gbps=400, anonymous_session_bytes=400 * 10**9)
    with ServerThread(ProbeServer("127.0.0.1", 0, limits=limits)) as st:
        yield st.server


@pytest.fixture
def secret_server() -> Iterator[ProbeServer]:
    """A probe server that requires the shared secret ``s3cret``."""
    with ServerThread(ProbeServer("127.0.0.1", 0, secret=b"s3cret")) as st:
        yield st.server
