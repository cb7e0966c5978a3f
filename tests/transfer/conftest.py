"""Fixtures for the KV transfer tests: real store servers on ephemeral loopback ports."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from pdx.transfer.audit import AuditLog
from pdx.transfer.contract import KVClientConfig, KVStoreConfig, ManualClock
from pdx.transfer.server import KVServer, create_kv_server


@pytest.fixture
def kv_clock() -> ManualClock:
    """A store clock the test moves by hand (TTL tests without waiting)."""
    return ManualClock()


@pytest.fixture
async def kv_server_factory(
    tmp_path: Path,
) -> AsyncIterator[Callable[..., Any]]:
    """Start store servers (port 0, audited to a file); all are stopped at teardown."""
    started: list[KVServer] = []

    async def start(clock: ManualClock | None = None, **cfg: Any) -> tuple[KVServer, str]:
        cfg.setdefault("audit_path", tmp_path / f"audit-{len(started)}.jsonl")
        server, port = await create_kv_server(KVStoreConfig(**cfg), clock=clock)
        started.append(server)
        return server, f"127.0.0.1:{port}"

    yield start
    for server in started:
        await server.stop(0.2)


@pytest.fixture(params=["data", "grpc"])
def kv_transport(request: pytest.FixtureRequest) -> str:
    """Each client test runs over both transports: the data plane and gRPC messages."""
    return str(request.param)


@pytest.fixture
def kv_client_cfg(kv_transport: str) -> Callable[..., KVClientConfig]:
    """Client config with a test-friendly deadline (loopback under a busy CI box)."""

    def make(**kw: Any) -> KVClientConfig:
        kw.setdefault("transport", kv_transport)
        kw.setdefault("kv_transfer_timeout_ms", 5000)
        kw.setdefault("chunk_size_kb", 64)
        return KVClientConfig(**kw)

    return make


@pytest.fixture
def kv_audit(tmp_path: Path) -> AuditLog:
    """A client-side audit log in a temp file."""
    return AuditLog(tmp_path / "client-audit.jsonl")
