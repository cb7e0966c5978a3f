"""The one gRPC service lifecycle used by the prefill and decode services.

``create_server`` binds (port 0 = ephemeral), adds the standard health service and returns
(server, port, health); ``channel`` opens a client channel. Mutual TLS uses the material of
``pdx certs init`` through :mod:`pdx.tls`, as the KV store does.
"""

from __future__ import annotations

from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdx.tls import TLSConfig
from pdx.transfer.client import RECONNECT_OPTIONS

# Token streams are small, but keep the same generous limits as the KV channels.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]
# Client channels reconnect as the KV client's do (at most 1 s apart): an instance restarted
# on its port is used again about a second after it is up, not after gRPC's default backoff,
# which grows through an outage (a decode's third restart in a row took 46 s to be seen).
CLIENT_OPTIONS = [*CHANNEL_OPTIONS, *RECONNECT_OPTIONS]


def channel(target: str, tls: TLSConfig | None) -> grpc.aio.Channel:
    """A client channel to ``target`` (host:port), mutual TLS when ``tls`` is given."""
    if tls is None:
        return grpc.aio.insecure_channel(target, options=CLIENT_OPTIONS)
    from pdx.tls import channel_credentials

    return grpc.aio.secure_channel(target, channel_credentials(tls), options=CLIENT_OPTIONS)


def create_server(
    host: str, port: int, tls: TLSConfig | None, interceptors: list[Any] | None = None
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """A grpc.aio server bound to host:port (0 = ephemeral) with the health service added."""
    server = grpc.aio.server(options=CHANNEL_OPTIONS, interceptors=interceptors or [])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{host}:{port}"
    if tls is None:
        bound = server.add_insecure_port(address)
    else:
        from pdx.tls import server_credentials

        bound = server.add_secure_port(address, server_credentials(tls))
    return server, bound, health_servicer


async def set_serving(health_servicer: health.aio.HealthServicer, service: str) -> None:
    """Mark ``service`` and the whole server SERVING."""
    for name in ("", service):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


async def start_health_server(
    host: str, port: int | None, health_servicer: health.aio.HealthServicer
) -> grpc.aio.Server | None:
    """A plaintext server exposing only the health service (Kubernetes gRPC probes speak no TLS).

    It shares the main server's health state; None when ``port`` is None.
    """
    if port is None:
        return None
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server
