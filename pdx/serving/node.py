"""A child process of a deployment: parse its arguments, start its node, announce it, stop it.

Prefill and decode processes run ``python -m pdx.serving.prefill|decode CONFIG INDEX ...``,
which calls :func:`run_child`; the supervisor reads the ``PDX-READY {json}`` line each
prints once ready.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import grpc

from pdx.serving.deploy_config import DeployConfig, NodeOptions, load_deploy_config

READY_PREFIX = "PDX-READY "


class Node(Protocol):
    """What a child process runs (prefill or decode)."""

    def announce(self) -> dict[str, Any]:
        """Ports and labels, sent to the supervisor once ready."""
        ...

    async def stop(self, grace_s: float = 2.0) -> None:
        """Graceful shutdown."""
        ...


StartFn = Callable[..., Awaitable[Node]]


async def stop_serving(
    health: Any, server: grpc.aio.Server | None, health_server: grpc.aio.Server | None,
    grace_s: float,
) -> None:  # fmt: skip
    """A node's gRPC side, gracefully: health NOT_SERVING while in-flight calls drain for
    ``grace_s``, then the health server (any of the three may be None: a node that never
    finished starting)."""
    if health is not None:
        await health.enter_graceful_shutdown()
    if server is not None:
        await server.stop(grace_s)
    if health_server is not None:
        await health_server.stop(0)


def child_arguments(argv: list[str]) -> tuple[str, NodeOptions]:
    """Parse a child's command line: ``CONFIG INDEX [--cert-dir D] [--port P] ...``."""
    import argparse

    p = argparse.ArgumentParser(prog="pdx-node")
    p.add_argument("config")
    p.add_argument("index", type=int)
    p.add_argument("--cert-dir", type=Path)
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--kv-port", type=int)
    p.add_argument("--advertise-host")
    p.add_argument("--health-port", type=int)
    a = p.parse_args(argv)
    opts = NodeOptions(a.index, a.cert_dir, a.host, a.port, a.kv_port, a.advertise_host,
                       a.health_port)  # fmt: skip
    return a.config, opts


def run_child(start: StartFn) -> None:
    """Child main (see :func:`child_arguments`); SIGTERM or SIGINT stops it gracefully."""
    config, opts = child_arguments(sys.argv[1:])
    cfg = load_deploy_config(config)  # YAML or JSON (a ConfigMap mounts the YAML)
    asyncio.run(_child(start, cfg, opts))
    # Everything was stopped explicitly above; skip interpreter teardown, where the gRPC
    # core can spend seconds (measured ~5 s) with nothing left to do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


async def _child(start: StartFn, cfg: DeployConfig, opts: NodeOptions) -> None:
    node = await start(cfg, opts)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    sys.stdout.write(READY_PREFIX + json.dumps(node.announce()) + "\n")
    sys.stdout.flush()
    await stop.wait()
    await node.stop(cfg.supervisor.shutdown_grace_s)
