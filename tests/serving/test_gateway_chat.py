"""A local checkpoint (saved here, loaded back) with its own tokenizer and chat template."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from pdx.serving.backends import BackendConfig, create_backend
from pdx.serving.backends.tokenizer import HFTokenizer
from pdx.serving.decode import DecodeNode
from pdx.serving.deploy_config import NodeOptions, load_deploy_config
from pdx.serving.gateway import Gateway, build_gateway
from pdx.serving.prefill import PrefillNode


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset saved as a checkpoint, with a word-level tokenizer and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("ckpt")
    create_backend(BackendConfig()).model.save_pretrained(d)  # type: ignore[attr-defined]
    # Fixed-width names: a special token must not be a prefix of another word.
    tok = Tokenizer(models.WordLevel({f"w{i:03d}": i for i in range(260)}, unk_token="w000"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w000", eos_token="w001")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}w009"
    fast.save_pretrained(d)
    return d


def test_checkpoint_loads_the_same_weights_and_its_tokenizer(checkpoint: Path) -> None:
    preset = create_backend(BackendConfig())
    ckpt = create_backend(BackendConfig(checkpoint=str(checkpoint)))
    assert isinstance(ckpt.tokenizer, HFTokenizer)
    assert ckpt.tokenizer.encode("w005 w006") == [5, 6]
    _, a = preset.prefill([5, 6, 7])
    _, b = ckpt.prefill([5, 6, 7])
    assert torch.equal(a, b)
    assert ckpt.model_version.endswith(preset.model_version.split("+")[1])


@pytest.fixture
async def gateway(checkpoint: Path) -> AsyncIterator[Gateway]:
    cfg = load_deploy_config(
        dotted=[f"model.checkpoint={checkpoint}", "kv.kv_transfer_timeout_ms=5000"]
    )
    prefill = await PrefillNode.start(cfg, NodeOptions())
    decode = await DecodeNode.start(cfg, NodeOptions())
    tokenizer = create_backend(cfg.model).tokenizer
    gw = build_gateway(
        cfg, [("prefill-0", f"127.0.0.1:{prefill.port}")],
        [("decode-0", f"127.0.0.1:{decode.port}")], tls=None, tokenizer=tokenizer,
        max_context_tokens=1024, model_name="ckpt",
    )  # fmt: skip
    await gw.start("127.0.0.1", 0)
    yield gw
    await gw.stop()
    await decode.stop(0.5)
    await prefill.stop(0.5)


async def test_chat_completions_use_the_chat_template(gateway: Gateway) -> None:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "w005 w007 w011"}],
                            "max_tokens": 5, "return_token_ids": True, "ignore_eos": True,
                            "pdx_route": "disaggregated"}  # fmt: skip
    url = f"http://127.0.0.1:{gateway.port}/v1/chat/completions"
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        data = await r.json()
    choice = data["choices"][0]
    assert data["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    assert choice["prompt_token_ids"] == [5, 7, 11, 9]  # the template appended w009
    assert len(choice["token_ids"]) == 5 and data["pdx"]["route"] == "disaggregated"
    assert choice["message"]["content"] == " ".join(f"w{t:03d}" for t in choice["token_ids"])
