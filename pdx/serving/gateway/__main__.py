"""Standalone gateway: ``python -m pdx.serving.gateway CONFIG --prefill H:P --decode H:P``.

One per site (e.g. in Kubernetes) over fixed instance addresses.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path
from typing import Any

from pdx.serving.backends.tokenizer import ByteTokenizer
from pdx.serving.deploy_config import load_deploy_config
from pdx.serving.gateway.app import build_gateway
from pdx.tls import tls_for


async def _serve_standalone(args: Any) -> None:
    cfg = load_deploy_config(args.config)
    gw = build_gateway(
        cfg,
        [(f"prefill-{i}", a) for i, a in enumerate(args.prefill)],
        [(f"decode-{i}", a) for i, a in enumerate(args.decode)],
        tls=tls_for(args.cert_dir, "gateway"),
        tokenizer=ByteTokenizer(),
        max_context_tokens=args.max_context_tokens,
        model_name=cfg.model.checkpoint or cfg.model.preset,
        synthetic=cfg.model.backend == "synthetic",
    )
    await gw.start(
        args.host or cfg.gateway.host, cfg.gateway.port if args.port is None else args.port
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await gw.stop()


def main() -> None:
    """Standalone gateway (one per site, e.g. in Kubernetes) over fixed instance addresses."""
    p = argparse.ArgumentParser(prog="python -m pdx.serving.gateway")
    p.add_argument("config")
    p.add_argument("--prefill", action="append", default=[], help="host:port (repeatable)")
    p.add_argument("--decode", action="append", default=[], help="host:port (repeatable)")
    p.add_argument("--cert-dir", type=Path)
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--max-context-tokens", type=int, default=1024)
    asyncio.run(_serve_standalone(p.parse_args()))


if __name__ == "__main__":
    main()
