"""vLLM sizing: whole blocks, sliding windows in blocks, conv k-1, padded state pages."""

from __future__ import annotations

import pytest

from pdx.errors import InputError
from pdx.kv.engines import (
    DEFAULT_BLOCK_SIZE,
    VLLM_RULES,
    VLLMSizing,
    vllm_kv_bytes,
    vllm_max_blocks,
)
from pdx.kv.source import load_preset
from pdx.kv.spec import KVSpec, build_spec


def vllm(
    name: str, prompt: int, block: int | None = None, state_dtype: str = "auto"
) -> tuple[KVSpec, VLLMSizing]:
    config = load_preset(name).config
    spec = build_spec(config, name=name, engine="vllm", state_dtype=state_dtype)
    return spec, vllm_kv_bytes(spec, prompt, block)


def test_full_attention_rounds_up_to_whole_blocks() -> None:
    _, sizing = vllm("llama-3.1-8b", 1000)
    assert sizing.block_size == DEFAULT_BLOCK_SIZE["gpu"] == 16
    assert sizing.total_bytes == 63 * 16 * 131072  # cdiv(1000, 16) = 63 blocks
    _, exact = vllm("llama-3.1-8b", 1024)
    assert exact.total_bytes == 1024 * 131072


def test_default_block_size_follows_the_device() -> None:
    spec = build_spec(load_preset("llama-3.1-8b").config, name="x", engine="vllm")
    assert vllm_kv_bytes(spec, 1000, device="cpu").block_size == 128
    assert vllm_kv_bytes(spec, 1000, device="cpu").total_bytes == 8 * 128 * 131072


@pytest.mark.parametrize("prompt", [100, 4095, 4096, 4097, 8192, 10_000])
def test_sliding_layers_free_whole_blocks_outside_the_window(prompt: int) -> None:
    spec, sizing = vllm("mistral-7b-v0.1", prompt)
    skipped = max(0, prompt - 4096 + 1)
    blocks = -(-prompt // 16) - skipped // 16
    assert {la.blocks for la in sizing.layers} == {blocks}
    assert vllm_max_blocks(spec.layers[0], 16) == -(-4095 // 16) + 1
    assert blocks <= -(-4095 // 16) + 1
    assert sizing.total_bytes == 32 * blocks * 16 * 4096


def test_hybrid_block_size_and_padded_state_page() -> None:
    """Jamba: one attention page (80 tokens) must hold a Mamba state page, which is padded."""
    _, sizing = vllm("jamba-v0.1", 32768)
    conv = 8192 * (4 - 1) * 2  # vLLM keeps kernel - 1 columns
    ssm = 8192 * 16 * 2  # both states in the model dtype by default
    per_token = 2 * 8 * 128 * 2
    assert sizing.state_page_unpadded == conv + ssm == 311_296
    assert sizing.attention_block_size == 16 * -(-(conv + ssm) // (16 * per_token)) == 80
    assert sizing.state_page_bytes == 80 * per_token == 327_680
    attention = 4 * -(-32768 // 80) * 80 * per_token
    assert sizing.total_bytes == attention + 28 * 327_680


def test_state_dtypes_follow_vllm_defaults_and_overrides() -> None:
    spec, _ = vllm("qwen3-next-80b-a3b", 10)
    assert spec.state_dtypes() == {"conv": "bf16", "recurrent": "bf16"}
    fp32, _ = vllm("qwen3-next-80b-a3b", 10, state_dtype="fp32")  # --mamba-ssm-cache-dtype
    assert fp32.state_dtypes() == {"conv": "bf16", "recurrent": "fp32"}


def test_mla_block_bytes_have_no_factor_two() -> None:
    _, sizing = vllm("deepseek-v3", 17)
    assert sizing.total_bytes == 61 * 2 * 16 * 576 * 2


def test_vllm_kv_bytes_takes_a_config_dict_and_rejects_a_transformers_spec() -> None:
    config = load_preset("llama-3.1-8b").config
    assert vllm_kv_bytes(config, 1000, 16).total_bytes == 63 * 16 * 131072
    with pytest.raises(InputError, match="engine"):
        vllm_kv_bytes(build_spec(config, name="x"), 1000)
    with pytest.raises(InputError, match="--block-size"):
        vllm_kv_bytes(config, 1000, 0)
    assert "vLLM" in VLLM_RULES
