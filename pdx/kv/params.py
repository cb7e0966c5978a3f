"""Parameter counts from a config (total and active per token), for recompute-time estimates.

An estimate from the weight shapes the config implies (projections, MLP / experts,
embeddings); norms and biases are ignored (well under 0.1 % for the families covered).
"""

from __future__ import annotations

from typing import Any

from pdx.errors import UnsupportedModelError
from pdx.kv.families import head_dim, kv_heads, layer_types, need, need_int


def count_params(cfg: dict[str, Any], model_type: str) -> tuple[int, int]:
    """(total, active-per-token) parameter counts of the decoder and its embeddings."""
    hidden = need_int(cfg, model_type, "hidden_size")
    vocab = need_int(cfg, model_type, "vocab_size")
    tied = cfg.get("tie_word_embeddings", model_type.startswith("gemma"))  # the models' defaults
    embed = vocab * hidden * (1 if tied else 2)
    total = active = embed
    for index, kind in enumerate(layer_types(cfg, model_type)):
        mixer = _mixer_params(cfg, model_type, kind)
        mlp_total, mlp_active = _mlp_params(cfg, model_type, index)
        total += mixer + mlp_total
        active += mixer + mlp_active
    return total, active


def _mixer_params(cfg: dict[str, Any], model_type: str, kind: str) -> int:
    hidden = need_int(cfg, model_type, "hidden_size")
    if kind in ("mamba", "linear_attention"):
        return _linear_mixer_params(cfg, model_type, hidden)
    if kind in ("mla", "indexed_attention") or cfg.get("kv_lora_rank") is not None:
        return _mla_params(cfg, model_type, hidden)
    if kind in ("moe", "mlp"):
        return 0
    if kind in ("hybrid", "conv", "mamba2"):
        raise UnsupportedModelError(f"model_type {model_type!r}: no parameter count for {kind!r}")
    heads = need_int(cfg, model_type, "num_attention_heads")
    dim = head_dim(cfg, model_type)
    q_out = heads * dim * (2 if model_type == "qwen3_next" else 1)  # gated attention output
    return hidden * (q_out + 2 * kv_heads(cfg, model_type) * dim) + heads * dim * hidden


def _mla_params(cfg: dict[str, Any], model_type: str, hidden: int) -> int:
    heads = need_int(cfg, model_type, "num_attention_heads")
    nope = need_int(cfg, model_type, "qk_nope_head_dim")
    rope = need_int(cfg, model_type, "qk_rope_head_dim")
    v_dim = need_int(cfg, model_type, "v_head_dim")
    rank = need_int(cfg, model_type, "kv_lora_rank")
    q_rank = cfg.get("q_lora_rank")
    q = hidden * heads * (nope + rope) if not q_rank else (hidden + heads * (nope + rope)) * q_rank
    return q + hidden * (rank + rope) + rank * heads * (nope + v_dim) + heads * v_dim * hidden


def _linear_mixer_params(cfg: dict[str, Any], model_type: str, hidden: int) -> int:
    if model_type == "jamba":
        inner = need_int(cfg, model_type, "mamba_expand") * hidden
        d_state = need_int(cfg, model_type, "mamba_d_state")
        rank = cfg.get("mamba_dt_rank", "auto")
        rank = -(-hidden // 16) if rank == "auto" else int(rank)
        conv = inner * need_int(cfg, model_type, "mamba_d_conv")
        return (
            hidden * 2 * inner
            + inner * (rank + 2 * d_state)
            + rank * inner
            + conv
            + inner * (d_state + hidden)
        )
    nk, nv = (
        need_int(cfg, model_type, k) for k in ("linear_num_key_heads", "linear_num_value_heads")
    )
    dk, dv = (
        need_int(cfg, model_type, k) for k in ("linear_key_head_dim", "linear_value_head_dim")
    )
    conv = (2 * nk * dk + nv * dv) * need_int(cfg, model_type, "linear_conv_kernel_dim")
    return hidden * (2 * nk * dk + 2 * nv * dv + 2 * nv) + conv + nv * dv * hidden


def _mlp_params(cfg: dict[str, Any], model_type: str, index: int) -> tuple[int, int]:
    hidden = need_int(cfg, model_type, "hidden_size")
    experts, top_k, expert_inter, shared_inter = _moe_shape(cfg, model_type, index)
    if experts == 0:
        width = "intermediate_size_mlp" if model_type == "llama4_text" else "intermediate_size"
        dense = 3 * hidden * need_int(cfg, model_type, width)
        return dense, dense
    per_expert = 3 * hidden * expert_inter
    router = hidden * experts
    shared = 3 * hidden * shared_inter
    return experts * per_expert + shared + router, top_k * per_expert + shared + router


def _moe_shape(cfg: dict[str, Any], model_type: str, index: int) -> tuple[int, int, int, int]:
    """(experts, top_k, expert width, shared width) of one layer; 0 experts means dense."""
    if model_type in ("deepseek_v2", "deepseek_v3"):
        if index < int(cfg.get("first_k_dense_replace", 0)):
            return 0, 0, 0, 0
        inter = need_int(cfg, model_type, "moe_intermediate_size")
        shared = int(cfg.get("n_shared_experts") or 0) * inter
        top = need_int(cfg, model_type, "num_experts_per_tok")
        return need_int(cfg, model_type, "n_routed_experts"), top, inter, shared
    if model_type == "llama4_text":  # routed experts + one shared expert on the MoE layers
        moe_layers = cfg.get("moe_layers")
        step = int(cfg.get("interleave_moe_layer_step") or 1)
        is_moe = index in moe_layers if isinstance(moe_layers, list) else (index + 1) % step == 0
        if not is_moe:
            return 0, 0, 0, 0
        inter = need_int(cfg, model_type, "intermediate_size")
        top = need_int(cfg, model_type, "num_experts_per_tok")
        return need_int(cfg, model_type, "num_local_experts"), top, inter, inter
    if model_type in ("mixtral", "gpt_oss"):
        top = need_int(cfg, model_type, "num_experts_per_tok", cfg.get("experts_per_token"))
        experts = need_int(cfg, model_type, "num_local_experts")
        return experts, top, need_int(cfg, model_type, "intermediate_size"), 0
    if model_type == "jamba":
        period = int(cfg.get("expert_layer_period", 1))
        if index % period != int(cfg.get("expert_layer_offset", 0)):
            return 0, 0, 0, 0
        inter = need_int(cfg, model_type, "intermediate_size")
        top = need_int(cfg, model_type, "num_experts_per_tok")
        return need_int(cfg, model_type, "num_experts"), top, inter, 0
    if model_type in ("qwen2_moe", "qwen3_moe", "qwen3_next"):
        step = int(cfg.get("decoder_sparse_step", 1))
        if index in (cfg.get("mlp_only_layers") or []) or (index + 1) % step:
            return 0, 0, 0, 0
        inter = need_int(cfg, model_type, "moe_intermediate_size")
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        top = need_int(cfg, model_type, "num_experts_per_tok")
        return need_int(cfg, model_type, "num_experts"), top, inter, shared
    need(cfg, model_type, "intermediate_size")
    return 0, 0, 0, 0
