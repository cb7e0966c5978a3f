"""Fixtures for the load tests: the locustfile's helpers on sys.path and a real SSE server."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

LOADTESTS = Path(__file__).resolve().parents[2] / "loadtests"
sys.path.insert(0, str(LOADTESTS))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from openai_sse_server import OpenAIStreamServer, StreamServerConfig  # noqa: E402


@pytest.fixture
def sse_server() -> Iterator[OpenAIStreamServer]:
    """A real OpenAI-compatible streaming server on 127.0.0.1:<ephemeral>."""
    server = OpenAIStreamServer(StreamServerConfig(first_token_delay_s=0.02, token_gap_s=0.003))
    server.start()
    try:
        yield server
    finally:
        server.stop()
