"""Parameter counts from a config (total and active per token), for recompute-time estimates.

An estimate from the weight shapes the config implies (projections, MLP / experts,
embeddings); norms and biases are ignored (well under 0.1 % for the families covered). The
sizes it reads come from the file, as the KV sizing's do (:class:`pdx.kv.fields.Fields`):
one the file lacks makes the count unknown, it is never filled with a class default. The
structural switches (tied embeddings, dense leading layers, the MoE layer step) follow the
configuration class when the file omits them.
"""

from __future__ import annotations

from typing import Any

from pdx.errors import UnsupportedModelError
from pdx.kv.families import attention_head_dim, kv_head_count, layer_types
from pdx.kv.fields import Fields
from pdx.kv.hfconfig import ResolvedConfig


def count_params(
    cfg: dict[str, Any], model_type: str, resolved: ResolvedConfig | None = None
) -> tuple[int, int]:
    """(total, active-per-token) parameter counts of the decoder and its embeddings.

    ``cfg`` is the config as read (``resolved.text``); with ``resolved`` every size must come
    from the file. Raises UnsupportedModelError naming every missing field at once.
    """
    f = Fields(cfg, model_type, resolved, needed_for="to count the parameters")
    hidden = f.int("hidden_size")
    vocab = f.int("vocab_size")
    tied = cfg.get("tie_word_embeddings", model_type.startswith("gemma"))  # the models' defaults
    embed = vocab * hidden * (1 if tied else 2)
    total = active = embed
    for index, kind in enumerate(layer_types(cfg, model_type)):
        mixer = _mixer_params(f, kind)
        mlp_total, mlp_active = _mlp_params(f, index)
        total += mixer + mlp_total
        active += mixer + mlp_active
    f.check()
    return total, active


def _mixer_params(f: Fields, kind: str) -> int:
    hidden = f.int("hidden_size")
    if kind in ("mamba", "linear_attention"):
        return _linear_mixer_params(f, hidden)
    if kind in ("mla", "indexed_attention") or f.marker("kv_lora_rank") is not None:
        return _mla_params(f, hidden)
    if kind in ("moe", "mlp"):
        return 0
    if kind in ("hybrid", "conv", "mamba2"):
        raise UnsupportedModelError(f"no parameter formula for {kind!r} layers")
    heads = f.int("num_attention_heads")
    dim = attention_head_dim(f)
    q_out = heads * dim * (2 if f.model_type == "qwen3_next" else 1)  # gated attention output
    return hidden * (q_out + 2 * kv_head_count(f) * dim) + heads * dim * hidden


def _mla_params(f: Fields, hidden: int) -> int:
    heads = f.int("num_attention_heads")
    nope, rope = f.int("qk_nope_head_dim"), f.int("qk_rope_head_dim")
    v_dim, rank = f.int("v_head_dim"), f.int("kv_lora_rank")
    q_rank = f.optional("q_lora_rank") or 0
    q = hidden * heads * (nope + rope) if not q_rank else (hidden + heads * (nope + rope)) * q_rank
    return q + hidden * (rank + rope) + rank * heads * (nope + v_dim) + heads * v_dim * hidden


def _linear_mixer_params(f: Fields, hidden: int) -> int:
    if f.model_type == "jamba":
        inner = f.int("mamba_expand") * hidden
        d_state = f.int("mamba_d_state")
        rank = f.cfg.get("mamba_dt_rank", "auto")
        rank = -(-hidden // 16) if rank == "auto" else int(rank)
        conv = inner * f.int("mamba_d_conv")
        return (
            hidden * 2 * inner
            + inner * (rank + 2 * d_state)
            + rank * inner
            + conv
            + inner * (d_state + hidden)
        )
    nk, nv = f.int("linear_num_key_heads"), f.int("linear_num_value_heads")
    dk, dv = f.int("linear_key_head_dim"), f.int("linear_value_head_dim")
    conv = (2 * nk * dk + nv * dv) * f.int("linear_conv_kernel_dim")
    return hidden * (2 * nk * dk + 2 * nv * dv + 2 * nv) + conv + nv * dv * hidden


def _mlp_params(f: Fields, index: int) -> tuple[int, int]:
    hidden = f.int("hidden_size")
    experts, top_k, expert_inter, shared_inter = _moe_shape(f, index)
    if experts == 0:
        width = "intermediate_size_mlp" if f.model_type == "llama4_text" else "intermediate_size"
        if isinstance(f.file_value(width), list):  # Gemma 3n: one width per layer
            raise UnsupportedModelError(f"no parameter formula for a per-layer {width}")
        dense = 3 * hidden * f.int(width)
        return dense, dense
    per_expert = 3 * hidden * expert_inter
    router = hidden * experts
    shared = 3 * hidden * shared_inter
    return experts * per_expert + shared + router, top_k * per_expert + shared + router


def _moe_shape(f: Fields, index: int) -> tuple[int, int, int, int]:
    """(experts, top_k, expert width, shared width) of one layer; 0 experts means dense."""
    cfg, model_type = f.cfg, f.model_type
    if model_type in ("deepseek_v3", "deepseek_v2"):
        if index < int(cfg.get("first_k_dense_replace", 0)):
            return 0, 0, 0, 0
        inter = f.int("moe_intermediate_size")
        shared = int(cfg.get("n_shared_experts") or 0) * inter
        return f.int("n_routed_experts"), f.int("num_experts_per_tok"), inter, shared
    if model_type == "llama4_text":  # routed experts + one shared expert on the MoE layers
        moe_layers = cfg.get("moe_layers")
        step = int(cfg.get("interleave_moe_layer_step") or 1)
        is_moe = index in moe_layers if isinstance(moe_layers, list) else (index + 1) % step == 0
        if not is_moe:
            return 0, 0, 0, 0
        inter = f.int("intermediate_size")
        return f.int("num_local_experts"), f.int("num_experts_per_tok"), inter, inter
    if model_type in ("mixtral", "gpt_oss"):
        top = f.int("num_experts_per_tok", "experts_per_token")
        return f.int("num_local_experts"), top, f.int("intermediate_size"), 0
    if model_type == "jamba":
        period = int(cfg.get("expert_layer_period", 1))
        if index % period != int(cfg.get("expert_layer_offset", 0)):
            return 0, 0, 0, 0
        inter = f.int("intermediate_size")
        return f.int("num_experts"), f.int("num_experts_per_tok"), inter, 0
    if model_type in ("qwen2_moe", "qwen3_moe", "qwen3_next"):
        step = int(cfg.get("decoder_sparse_step", 1))
        if index in (cfg.get("mlp_only_layers") or []) or (index + 1) % step:
            return 0, 0, 0, 0
        inter = f.int("moe_intermediate_size")
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        return f.int("num_experts"), f.int("num_experts_per_tok"), inter, shared
    return 0, 0, 0, 0
