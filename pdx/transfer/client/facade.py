""":class:`KVClient`: one client of one KV store, its calls and what they share.

The client owns its requests' :class:`~pdx.transfer.client.attempts.Attempts` (deadlines,
retries, records), its gRPC channels, and the transport policy ``kv.transport`` names;
Put and Get themselves live in :mod:`.put` and :mod:`.get`.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from pdx._proto import kv_transfer_pb2 as pb
from pdx.tcp import default_congestion_control
from pdx.tls import TLSConfig, channel_credentials, client_ssl_context
from pdx.transfer.audit import AuditLog
from pdx.transfer.client import get as get_op
from pdx.transfer.client import put as put_op
from pdx.transfer.client.attempts import Attempts, Request
from pdx.transfer.client.get import StreamedGet
from pdx.transfer.client.grpc_transport import GrpcTransport
from pdx.transfer.client.put import StreamWriter
from pdx.transfer.client.transport import TRANSPORTS, TransportContext
from pdx.transfer.contract import KVClientConfig, KVError, KVLayout
from pdx.transfer.dataplane.client import Endpoint
from pdx.transfer.metrics import KVMetrics, TransferRecord
from pdx.transfer.objects import KVObject
from pdx.transfer.path import PathEstimate
from pdx.transfer.retry import GlobalRetryBudget

if TYPE_CHECKING:
    import torch


class KVClient:
    """Talks to one store. Use as ``async with KVClient(target, cfg) as kv:``."""

    def __init__(
        self,
        target: str,
        cfg: KVClientConfig | None = None,
        *,
        tls: TLSConfig | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        audit: AuditLog | None = None,
        metrics: KVMetrics | None = None,
        retry_budget: GlobalRetryBudget | None = None,
        data_ssl: ssl.SSLContext | None = None,
    ) -> None:
        self.target = target
        self.cfg = cfg or KVClientConfig()
        self.audit = audit or AuditLog()
        self.metrics = metrics or KVMetrics()
        self.retry_budget = retry_budget or GlobalRetryBudget(
            self.cfg.retry_ratio, self.cfg.retry_min_per_s, self.cfg.retry_window_s
        )
        if credentials is None and tls is not None:
            credentials = channel_credentials(tls)
        if data_ssl is None and tls is not None:
            data_ssl = client_ssl_context(tls)
        self._secure = credentials is not None or data_ssl is not None
        self.path = PathEstimate(self.cfg.link_gbps)
        self.system_cc = default_congestion_control()
        self._attempts = Attempts(
            target, self.cfg, path=self.path, metrics=self.metrics, audit=self.audit,
            retry_budget=self.retry_budget, system_cc=self.system_cc,
        )  # fmt: skip
        self._grpc = GrpcTransport(target, self.cfg, credentials, self._attempts)
        ctx = TransportContext(target, self.cfg, self._grpc, self.path, data_ssl, self._secure)
        self._route = TRANSPORTS[self.cfg.transport](ctx)

    async def __aenter__(self) -> KVClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every channel and data-plane connection."""
        self._route.close()
        await self._grpc.close()

    @property
    def secure(self) -> bool:
        """Whether this client presents a TLS identity (gRPC or data plane)."""
        return self._secure

    def records(self) -> list[TransferRecord]:
        """Per-transfer records of this client, oldest first."""
        return self.metrics.records()

    def _begin(self, op: str, kv_id: str = "", size_bytes: int | None = 0) -> Request:
        return self._attempts.begin(op, kv_id, size_bytes)

    def _rpc(self, i: int, kind: str, name: str, **kw: Any) -> Any:
        return self._grpc.rpc(i, kind, name, **kw)

    async def _unary(self, req: Request, name: str, request: Any, reply: Any) -> Any:
        return await self._grpc.unary(req, name, request, reply)

    async def data_endpoint(self) -> Endpoint | None:
        """Where this client moves Put/Get bytes: the store's data plane, or None for gRPC."""
        return await self._route.endpoint(self._begin("data_plane"))

    async def put(
        self,
        data: bytes | bytearray | memoryview | Sequence[torch.Tensor],
        layout: KVLayout | None = None,
        *,
        codec: str = "raw",
        model_version: str = "unversioned",
        ttl_s: int = 0,
    ) -> str:
        """Store tensors (encoded with ``codec``) or ready bytes; return the new kv_id."""
        return await put_op.put(
            self._attempts, self._route, data, layout,
            codec=codec, model_version=model_version, ttl_s=ttl_s,
        )  # fmt: skip

    async def open(
        self,
        reserve_bytes: int,
        layout: KVLayout | None = None,
        *,
        model_version: str = "unversioned",
        ttl_s: int = 0,
    ) -> StreamWriter:
        """Open a streamed object of at most ``reserve_bytes``; write it with the writer.

        The kv_id is known at once and readers may Get the object while it is written.
        Its Put travels on gRPC (the data plane carries whole objects only).
        """
        return await put_op.open_stream(
            self._attempts, self._grpc, reserve_bytes, layout,
            model_version=model_version, ttl_s=ttl_s,
        )  # fmt: skip

    async def get_streamed(
        self,
        kv_id: str,
        *,
        size_hint: int | None = None,
        on_chunk: Callable[[pb.ObjectInfo, memoryview], None] | None = None,
    ) -> StreamedGet:
        """Fetch an object that may still be written: chunks as they are stored (gRPC).

        Verifies every chunk on arrival and the whole object against its closed info. The
        writer ending it is KV_INCOMPLETE (not retried); a writer slower than this request's
        deadline is KV_TIMEOUT.
        """
        return await get_op.get_streamed(
            self._attempts, self._grpc, kv_id, size_hint=size_hint, on_chunk=on_chunk
        )

    async def get(self, kv_id: str, *, size_hint: int | None = None) -> KVObject:
        """Fetch and verify a whole object (every chunk and the object digest).

        ``size_hint`` (bytes, when the caller knows it) sizes a derived deadline; without it
        the largest object this client has moved stands in.
        """
        return await get_op.get(self._attempts, self._route, self._grpc, kv_id,
                                size_hint=size_hint)  # fmt: skip

    async def _small(self, op: str, kv_id: str, name: str, request: Any, reply: Any) -> Any:
        req = self._begin(op, kv_id)
        try:
            result = await self._unary(req, name, request, reply)
        except KVError as exc:
            self._attempts.finish(req, 0, 0, exc.code.value)
            raise
        self._attempts.finish(req, 0, 0, "ok")
        return result

    async def release(self, kv_id: str) -> int:
        """Acknowledge consumption: the store deletes the object now. Returns its size."""
        resp = await self._small(
            "release", kv_id, "Release", pb.ReleaseRequest(kv_id=kv_id), pb.ReleaseResponse
        )
        return int(resp.size_bytes)

    async def renew(self, kv_id: str, lease_s: int = 0) -> pb.ObjectInfo:
        """Lease heartbeat: keep the object past its TTL while still needed."""
        resp = await self._small(
            "renew", kv_id, "Renew", pb.RenewRequest(kv_id=kv_id, lease_s=lease_s), pb.RenewResponse
        )
        return resp.info

    async def stat(self, kv_id: str) -> pb.ObjectInfo:
        """Describe an object without moving its bytes."""
        resp = await self._small(
            "stat", kv_id, "Stat", pb.StatRequest(kv_id=kv_id), pb.StatResponse
        )
        return resp.info
