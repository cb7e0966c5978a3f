"""The KV store server: build, bind and start the gRPC service and its data plane.

``server, port = await create_kv_server(cfg)`` returns a started server (port 0 binds an
ephemeral port); :func:`serve_kv` runs one until SIGINT/SIGTERM (``pdx kv-serve``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdx.transfer.audit import AuditLog
from pdx.transfer.contract import Clock, KVStoreConfig
from pdx.transfer.dataplane.server import DataLimits, DataServer
from pdx.transfer.metrics import KVMetrics
from pdx.transfer.rpc import CHANNEL_OPTIONS, SERVICE_NAME, ErrorMappingInterceptor
from pdx.transfer.service import KVService
from pdx.transfer.store import KVStore


class KVServer:
    """A started store server: the gRPC server, its store, health and sweeper."""

    def __init__(
        self, grpc_server: grpc.aio.Server, service: KVService, health_servicer: Any
    ) -> None:
        self.grpc_server = grpc_server
        self.service = service
        self.store = service.store
        self.audit = service.audit
        self.metrics = service.metrics
        self.health = health_servicer
        self._sweeper: asyncio.Task[None] | None = None

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.service.cfg.sweep_interval_s)
            self.store.sweep()

    async def stop(self, grace_s: float | None = 1.0) -> None:
        """Graceful shutdown: health NOT_SERVING, then ``stop(grace)``; sweeper stopped."""
        await self.health.enter_graceful_shutdown()
        if self.service.data_server is not None:
            await asyncio.to_thread(self.service.data_server.stop, grace_s or 0.5)
        await self.grpc_server.stop(grace_s)
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        self.audit.close()

    async def wait_for_termination(self) -> None:
        """Block until the server stops."""
        await self.grpc_server.wait_for_termination()


async def create_kv_server(
    cfg: KVStoreConfig,
    *,
    clock: Clock | None = None,
    audit: AuditLog | None = None,
    metrics: KVMetrics | None = None,
) -> tuple[KVServer, int]:
    """Build, bind (port 0 = ephemeral) and start a store server; return it and its port."""
    audit = audit or AuditLog(cfg.audit_path)
    store = KVStore(cfg, clock=clock, audit=audit, metrics=metrics)
    service = KVService(store, cfg)
    # What a peer may make the store receive in one message: a chunk at the largest chunk
    # size and its framing (a client needs more, the other way: ObjectInfo lists digests).
    receive = cfg.chunk_size_kb_max * 1024 + 64 * 1024
    options = [(k, receive if k == "grpc.max_receive_message_length" else v)
               for k, v in CHANNEL_OPTIONS]  # fmt: skip
    server = grpc.aio.server(interceptors=[ErrorMappingInterceptor()], options=options)
    server.add_generic_rpc_handlers((service.handler(),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{cfg.host}:{cfg.port}"
    if cfg.tls is not None:
        from pdx.tls import server_credentials

        port = server.add_secure_port(address, server_credentials(cfg.tls))
    else:
        port = server.add_insecure_port(address)
    await server.start()
    if cfg.data_plane:
        service.data_server = _data_server(service, cfg)
        service.data_server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    kv_server = KVServer(server, service, health_servicer)
    kv_server._sweeper = asyncio.create_task(kv_server._sweep_forever())
    return kv_server, port


def _data_server(service: KVService, cfg: KVStoreConfig) -> DataServer:
    ssl_context = None
    if cfg.tls is not None:
        from pdx.tls import server_ssl_context

        ssl_context = server_ssl_context(cfg.tls)
    return DataServer(
        service,
        asyncio.get_running_loop(),
        cfg.host,
        cfg.data_port,
        ssl_context=ssl_context,
        max_frame_bytes=cfg.chunk_size_kb_max * 1024,
        congestion_control=cfg.congestion_control,
        max_send_buffer_bytes=cfg.max_send_buffer_bytes,
        max_get_gbps=cfg.max_get_gbps,
        limits=DataLimits(
            max_connections=cfg.max_connections,
            max_unauthenticated=cfg.max_unauthenticated,
            max_connections_per_peer=cfg.max_connections_per_peer,
            max_unauthenticated_per_peer=cfg.max_unauthenticated_per_peer,
            handshake_timeout_s=cfg.handshake_timeout_s,
            max_request_timeout_s=cfg.max_request_timeout_ms / 1000,
            stall_timeout_s=cfg.stall_timeout_s,
        ),
    )


def tune_malloc() -> bool:
    """Keep glibc from returning (and re-faulting) MiB-sized buffers on every message.

    Chunk messages are 0.25-8 MiB; by default glibc serves each with mmap and unmaps it
    on free, so every chunk pays page faults. Raising the mmap and trim thresholds
    keeps them on the heap. Process-wide: call it only in a dedicated process.
    Returns False where it does not apply (not glibc).
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    ok = mallopt(m_mmap_threshold, 32 * 1024 * 1024) and mallopt(m_trim_threshold, 1 << 30)
    return bool(ok)


async def serve_kv(
    cfg: KVStoreConfig,
    on_ready: Callable[[int, int | None], None],
    *,
    metrics_port: int | None = None,
    grace_s: float = 5.0,
) -> None:
    """Run a store until SIGINT/SIGTERM, then shut down gracefully (``kv-serve``)."""
    import signal

    tune_malloc()  # a dedicated store process: keep chunk buffers off mmap/munmap
    server, port = await create_kv_server(cfg)
    if metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, addr=cfg.host, registry=server.metrics.registry)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        ds = server.service.data_server
        on_ready(port, ds.port if ds is not None else None)
        await stop.wait()
    finally:
        await server.stop(grace_s)
