"""Prefill, decode and gateway in the test's own process: real gRPC and HTTP on loopback."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from pdx.serving.backends.tokenizer import ByteTokenizer
from pdx.serving.decode import DecodeNode
from pdx.serving.deploy_config import NodeOptions, load_deploy_config
from pdx.serving.gateway import Gateway, build_gateway
from pdx.serving.prefill import PrefillNode


@contextlib.asynccontextmanager
async def inprocess_pair(sets: list[str]) -> AsyncIterator[tuple[Gateway, PrefillNode, DecodeNode]]:
    """Start the tiny-model pair and its gateway (plaintext, ephemeral ports); stop all after."""
    cfg = load_deploy_config(dotted=sets)
    prefill = await PrefillNode.start(cfg, NodeOptions())
    decode = await DecodeNode.start(cfg, NodeOptions())
    gw = build_gateway(
        cfg, [("prefill-0", f"127.0.0.1:{prefill.port}")],
        [("decode-0", f"127.0.0.1:{decode.port}")], tls=None, tokenizer=ByteTokenizer(),
        max_context_tokens=1024, model_name="tiny-llama",
    )  # fmt: skip
    await gw.start("127.0.0.1", 0)
    try:
        yield gw, prefill, decode
    finally:
        await gw.stop()
        await decode.stop(0.5)
        await prefill.stop(0.5)
