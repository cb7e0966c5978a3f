"""Real servers for proxy tests: TCP echo, TCP sink, UDP echo/counter, all on 127.0.0.1:0."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from faults_helpers import Sink


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.write_eof()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


@pytest.fixture
async def echo_port() -> AsyncIterator[int]:
    """Port of a TCP echo server."""
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()


@pytest.fixture
async def sink() -> AsyncIterator[Sink]:
    """A TCP sink server."""
    sink = Sink()
    server = await asyncio.start_server(sink.handle, "127.0.0.1", 0)
    sink.port = server.sockets[0].getsockname()[1]
    yield sink
    server.close()
