"""Every layer kind sized by its rule == the cache transformers' model code returns, per tensor.

Tiny random-weight models (hand-written configs, one per family the installed transformers can
run) prefill real token ids; each tensor of the returned cache (keys, values, indexer keys,
conv and recurrent states) must equal the analytic tensor in dtype, shape and bytes.
"""

from __future__ import annotations

from typing import Any

import pytest

from pdx.kv.empirical import build_model, count_cache, mismatches, prefill
from pdx.kv.spec import build_spec

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 256}
KV2 = {**TINY, "num_key_value_heads": 2}
MOE2 = {"n_routed_experts": 2, "moe_intermediate_size": 32, "num_experts_per_tok": 1}
MLA_TINY = {"kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}

# One hand-written config per family (what a user's scaled-down copy looks like): every field
# the sizing reads is written out (pdx takes none from transformers' class defaults).
FAMILIES: dict[str, dict[str, Any]] = {
    "llama4_chunked": {
        "model_type": "llama4_text", **KV2, "num_hidden_layers": 4, "head_dim": 16,
        "attention_chunk_size": 8, "num_local_experts": 2, "intermediate_size_mlp": 128,
        "no_rope_layers": [1, 1, 1, 0],
    },
    "phi3_all_sliding": {
        "model_type": "phi3", **KV2, "num_hidden_layers": 2, "sliding_window": 8,
        "pad_token_id": 0,
    },
    "falcon_h1_attention_and_mamba2": {
        "model_type": "falcon_h1", **KV2, "num_hidden_layers": 2, "head_dim": 16,
        "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 1,
        "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_chunk_size": 16,
    },
    "lfm2_short_conv": {
        "model_type": "lfm2", **KV2, "num_hidden_layers": 3, "conv_L_cache": 3,
        "layer_types": ["conv", "full_attention", "conv"], "block_auto_adjust_ff_dim": False,
    },
    "granite_hybrid_mamba2": {
        "model_type": "granitemoehybrid", **KV2, "num_hidden_layers": 3,
        "layer_types": ["mamba", "attention", "mamba"], "num_local_experts": 2,
        "shared_intermediate_size": 32, "mamba_n_heads": 4, "mamba_d_head": 32,
        "mamba_d_state": 8, "mamba_n_groups": 1, "mamba_chunk_size": 16, "mamba_d_conv": 4,
    },
    "nemotron_h_mamba2": {
        "model_type": "nemotron_h", **KV2, "num_hidden_layers": 4, "head_dim": 16,
        "layers_block_type": ["mamba", "attention", "mlp", "moe"], "mamba_num_heads": 4,
        "mamba_head_dim": 32, "ssm_state_size": 8, "n_groups": 2, "chunk_size": 16, **MOE2,
        "conv_kernel": 4,
        "moe_shared_expert_intermediate_size": 32,
    },
    "zamba_multihead_mamba_and_shared_attention": {
        "model_type": "zamba", **KV2, "num_hidden_layers": 4,
        "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"], "mamba_d_state": 8,
        "n_mamba_heads": 2, "mamba_d_conv": 3, "mamba_expand": 2, "attention_head_dim": 32,
    },
    "zamba2_mamba2_and_shared_attention": {
        "model_type": "zamba2", **KV2, "num_hidden_layers": 4,
        "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"], "mamba_d_state": 8,
        "n_mamba_heads": 4, "mamba_headdim": 32, "chunk_size": 16, "num_mem_blocks": 1,
        "hybrid_layer_ids": [1, 3], "mamba_ngroups": 1, "mamba_d_conv": 4,
        "attention_head_dim": 32,
    },
    "gemma3n_kv_shared": {
        "model_type": "gemma3n_text", **KV2, "num_hidden_layers": 4, "head_dim": 16,
        "layer_types": [
            "sliding_attention", "full_attention", "sliding_attention", "full_attention"
        ],
        "sliding_window": 8, "num_kv_shared_layers": 2, "intermediate_size": [128] * 4,
        "activation_sparsity_pattern": [0.0] * 4, "vocab_size_per_layer_input": 256,
        "hidden_size_per_layer_input": 8, "laurel_rank": 4, "altup_num_inputs": 2,
    },
    "minimax_lightning": {
        "model_type": "minimax", **KV2, "num_hidden_layers": 2, "head_dim": 16,
        "layer_types": ["linear_attention", "full_attention"], "num_local_experts": 2,
        "block_size": 8,
    },
    "kimi_linear_kda_and_mla": {
        "model_type": "kimi_linear", **TINY, "num_key_value_heads": 4, "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "full_attention"], **MLA_TINY,
        "linear_head_dim": 16, "linear_num_heads": 4, "num_experts": 2,
        "moe_intermediate_size": 32, "num_experts_per_token": 1,
        "mlp_layer_types": ["dense", "sparse"], "linear_conv_kernel_dim": 4, "pad_token_id": 0,
    },
    "glm_moe_dsa_mla_indexer": {
        "model_type": "glm_moe_dsa", **TINY, "num_key_value_heads": 4, "num_hidden_layers": 2,
        **MLA_TINY, "q_lora_rank": 16, **MOE2, "first_k_dense_replace": 1,
        "index_head_dim": 16, "index_n_heads": 2, "index_topk": 8,
        "mlp_layer_types": ["dense", "sparse"],
    },
    "bamba_mamba2": {
        "model_type": "bamba", **KV2, "num_hidden_layers": 2, "attn_layer_indices": [1],
        "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 8, "mamba_chunk_size": 16,
        "mamba_n_groups": 1, "mamba_d_conv": 4,
    },
    "qwen3_5_gated_deltanet": {
        "model_type": "qwen3_5_text", **KV2, "num_hidden_layers": 2, "head_dim": 16,
        "layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 12,
        "linear_conv_kernel_dim": 4,
    },
    "mamba_only": {
        "model_type": "mamba", "hidden_size": 64, "vocab_size": 256, "num_hidden_layers": 2,
        "state_size": 8, "conv_kernel": 3, "expand": 2,
    },
    "olmo_hybrid_gated_deltanet": {
        "model_type": "olmo_hybrid", **KV2, "num_hidden_layers": 2, "pad_token_id": 0,
        "layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 12,
        "linear_conv_kernel_dim": 3,
    },
    "lfm3_conv_sliding_full": {
        "model_type": "lfm3", **KV2, "num_hidden_layers": 5, "head_dim": 16, "conv_L_cache": 3,
        "sliding_window": 8, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    },
    "bailing_hybrid_kda_and_mla": {
        "model_type": "bailing_hybrid", **TINY, "num_key_value_heads": 4, "num_hidden_layers": 2,
        **MLA_TINY, "head_dim": 16, "layer_group_size": 2, "num_local_experts": 2,
        "linear_num_heads": 4, "linear_head_dim": 16, "linear_conv_kernel_dim": 4,
        "num_experts_per_tok": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
        "n_group": 1, "topk_group": 1, "pad_token_id": 0, "eos_token_id": 1,
    },
    "deepseek_v3_mla": {
        "model_type": "deepseek_v3", **TINY, "num_key_value_heads": 4, "num_hidden_layers": 2,
        **MLA_TINY, "q_lora_rank": 16, **MOE2, "n_group": 1, "topk_group": 1,
        "first_k_dense_replace": 1,
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def caches() -> dict[tuple[str, str], Any]:
    """One random-weight model per family and dtype, built once for the module."""
    return {}


def _cache(caches: dict[tuple[str, str], Any], family: str, dtype: str, seq: int) -> Any:
    key = (family, dtype)
    if key not in caches:
        caches[key] = build_model(FAMILIES[family], dtype)
    return prefill(caches[key], seq)[0]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize(("dtype", "seq"), [("bf16", 13), ("fp32", 5)])
def test_every_tensor_matches_the_analytic_rule(
    caches: dict[tuple[str, str], Any], family: str, dtype: str, seq: int
) -> None:
    spec = build_spec(FAMILIES[family], name=family, dtype=dtype, allow_torch=True)
    counted = count_cache(_cache(caches, family, dtype, seq), spec, seq)
    assert mismatches(counted) == []
    assert sum(la.bytes for la in counted) == spec.kv_bytes(seq) > 0


def test_a_wrong_state_dtype_is_caught_tensor_by_tensor(caches: dict[tuple[str, str], Any]) -> None:
    """Sizing the SSM state in bf16 (vLLM's default) misses transformers' fp32 state."""
    family = "falcon_h1_attention_and_mamba2"
    wrong = build_spec(
        FAMILIES[family], name="x", dtype="bf16", state_dtype="bf16", allow_torch=True
    )
    lines = mismatches(count_cache(_cache(caches, family, "bf16", 13), wrong, 13))
    assert len(lines) == 2 and all("recurrent: cache fp32" in line for line in lines)
