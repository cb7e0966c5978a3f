"""How decode reads KV from a prefill instance's store: the source protocol and the client
that implements it over the transfer contract."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pdx.serving.deploy_config import DeployConfig
from pdx.serving.kv_settings import kv_client_config
from pdx.tls import tls_for
from pdx.transfer.client import KVClient


@dataclass
class Fetched:
    """One completed KV read."""

    payload: bytes | memoryview
    layout: dict[str, Any]
    kv_bytes: int
    transfer_ms: float
    retries: int
    model_version: str = ""
    # Streamed KV (kv.streaming): the object's tail (prefill's first token), how long the
    # Get waited on the writer and the bytes stored only after it began.
    tail: bytes = b""
    streamed: bool = False
    wait_ms: float = 0.0
    bytes_while_writing: int = 0
    joined: Callable[[], bytes | memoryview] | None = None  # payload, joined on demand


class KVSource(Protocol):
    """How decode reads KV from a prefill instance's store (the transfer layer)."""

    async def fetch(self, endpoint: str, kv_id: str) -> Fetched:
        """Read the whole object (deadline, retries, checksums); raise KVError on failure."""
        ...

    async def fetch_streamed(
        self, endpoint: str, kv_id: str, on_bytes: Callable[[str, memoryview], None]
    ) -> Fetched:
        """Read an object that may still be written, chunks as they are stored; ``on_bytes``
        gets the codec and each verified chunk's bytes in order, as they arrive."""
        ...

    async def release(self, endpoint: str, kv_id: str) -> None:
        """Acknowledge: the object may be deleted now."""
        ...

    async def renew(self, endpoint: str, kv_id: str) -> None:
        """Extend the lease while the request waits for memory."""
        ...


class ClientSource:
    """Reads KV with the transfer client (one client per store endpoint, opened on first use)."""

    def __init__(self, cfg: DeployConfig, cert_dir: Path | None) -> None:
        self._client_cfg = kv_client_config(cfg, "decode")
        self._tls = tls_for(cert_dir, "decode")
        self._clients: dict[str, Any] = {}

    def _client(self, endpoint: str) -> Any:
        if endpoint not in self._clients:
            self._clients[endpoint] = KVClient(endpoint, self._client_cfg, tls=self._tls)
        return self._clients[endpoint]

    async def fetch(self, endpoint: str, kv_id: str) -> Fetched:
        """Whole-object Get with the client's deadline, retry budget and checksums."""
        client = self._client(endpoint)
        t0 = time.perf_counter()
        obj = await client.get(kv_id)
        ms = (time.perf_counter() - t0) * 1e3
        layout = {
            "codec": obj.layout.codec,
            "shapes": obj.layout.shapes,
            "tensor_bytes": obj.layout.tensor_bytes,
        }
        retries = next(
            (r.retries for r in reversed(client.records()) if r.kv_id == kv_id and r.op == "get"),
            0,
        )
        size = int(obj.info.size_bytes)
        return Fetched(obj.data, layout, size, ms, retries, obj.info.model_version)

    async def fetch_streamed(
        self, endpoint: str, kv_id: str, on_bytes: Callable[[str, memoryview], None]
    ) -> Fetched:
        """A Get of an object still being written (gRPC; chunks as they are stored)."""
        client = self._client(endpoint)
        t0 = time.perf_counter()

        def on_chunk(info: Any, data: memoryview) -> None:
            on_bytes(info.layout.codec, data)

        got = await client.get_streamed(kv_id, on_chunk=on_chunk)
        ms = (time.perf_counter() - t0) * 1e3
        obj = got.obj
        layout = {
            "codec": obj.layout.codec,
            "shapes": obj.layout.shapes,
            "tensor_bytes": obj.layout.tensor_bytes,
        }
        size = int(obj.info.size_bytes)
        return Fetched(b"", layout, size, ms, got.record.retries, obj.info.model_version,
                       tail=bytes(obj.info.tail), streamed=True, wait_ms=got.wait_ms,
                       bytes_while_writing=got.bytes_while_writing,
                       joined=lambda: obj.data)  # fmt: skip

    async def release(self, endpoint: str, kv_id: str) -> None:
        """Acknowledge release."""
        await self._client(endpoint).release(kv_id)

    async def renew(self, endpoint: str, kv_id: str) -> None:
        """Extend the lease."""
        await self._client(endpoint).renew(kv_id)

    async def close(self) -> None:
        """Close every client."""
        for client in self._clients.values():
            await client.close()
