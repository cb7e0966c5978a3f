"""Prefill, decode and gateway in the test's own process: real gRPC and HTTP on loopback."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

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


def greedy_reference() -> Callable[[list[int], int], list[int]]:
    """The embedded default's model built in this process: what plain greedy decoding with
    transformers' own ``generate`` produces (no pdx code, no cache of pdx's)."""
    import torch

    from pdx.serving.backends import create_backend
    from pdx.serving.deploy_config import DeployConfig

    backend: Any = create_backend(DeployConfig().model)

    def generate(prompt_ids: list[int], n: int) -> list[int]:
        ids = torch.tensor([prompt_ids])
        out = backend.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
            eos_token_id=None,
        )  # fmt: skip
        return list(out[0, len(prompt_ids) :].tolist())

    return generate
