"""Analytic == empirical, to the byte: tiny random models of each family run through the
transformers model code, and the cache object they return is counted tensor by tensor."""

from __future__ import annotations

from typing import Any

import pytest

from pdx.kv.empirical import build_model, count_cache, measure_empirical, prefill, tiny_config
from pdx.kv.families import layer_types, text_config
from pdx.kv.source import load_preset, preset_names
from pdx.kv.spec import build_spec

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 256}

# Hand-written configs (not presets): what a user could bring, one per family.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "num_hidden_layers": 2, "num_key_value_heads": 2, **TINY},
    "qwen3": {
        "model_type": "qwen3",
        "num_hidden_layers": 2,
        "num_key_value_heads": 1,
        "head_dim": 24,  # differs from hidden / heads = 16
        **TINY,
    },
    "mistral": {
        "model_type": "mistral",
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "sliding_window": 12,
        **TINY,
    },
    "gemma3_text": {
        "model_type": "gemma3_text",
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "sliding_window": 10,
        "sliding_window_pattern": 3,
        **TINY,
    },
    "deepseek_v3": {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "kv_lora_rank": 24,
        "q_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 8,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        **TINY,
    },
    "qwen3_next": {
        "model_type": "qwen3_next",
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "full_attention_interval": 2,
        "linear_conv_kernel_dim": 3,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 12,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16,
        **TINY,
    },
    "jamba": {
        "model_type": "jamba",
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "attn_layer_period": 3,
        "attn_layer_offset": 1,
        "num_experts": 2,
        "num_experts_per_tok": 1,
        "mamba_d_state": 6,
        "mamba_d_conv": 3,
        "mamba_expand": 2,
        "mamba_dt_rank": 4,
        **TINY,
    },
    "gpt_oss": {
        "model_type": "gpt_oss",
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 9,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        **TINY,
    },
}


def _run(cfg: dict[str, Any], seq: int, dtype: str) -> tuple[int, int]:
    """(analytic bytes from the config alone, bytes of the cache the model code returned)."""
    spec = build_spec(cfg, name="t", dtype=dtype, state_dtype=dtype)
    model = build_model(cfg, dtype)
    cache, _ = prefill(model, seq)
    counted = count_cache(cache, spec, seq)
    return spec.kv_bytes(seq), sum(la.bytes for la in counted)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("seq", [5, 29])
def test_family_analytic_equals_empirical_fp32(family: str, seq: int) -> None:
    analytic, empirical = _run(FAMILIES[family], seq, "fp32")
    assert empirical == analytic > 0


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3_text", "deepseek_v3", "gpt_oss"])
def test_attention_families_bf16_to_the_byte(family: str) -> None:
    analytic, empirical = _run(FAMILIES[family], 23, "bf16")
    assert empirical == analytic


def test_sliding_layers_hold_window_minus_one_tokens() -> None:
    cfg = FAMILIES["mistral"]
    spec = build_spec(cfg, name="t", dtype="fp32")
    cache, _ = prefill(build_model(cfg, "fp32"), 40)
    counted = count_cache(cache, spec, 40)
    assert [la.tokens_held for la in counted] == [11, 11]


def test_hybrid_recurrent_state_is_float32_in_transformers_and_reported() -> None:
    result = measure_empirical(
        load_preset("qwen3-next-80b-a3b").config, name="q", seq=20, dtype="bf16"
    )
    assert result.match
    linear = [la for la in result.layers if la.kind == "linear"]
    assert linear and all("recurrent:float32" in la.dtypes for la in linear)
    assert any("float32" in note for note in result.notes)


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_scaled_down_matches(name: str) -> None:
    result = measure_empirical(load_preset(name).config, name=name, seq=40, dtype="fp32")
    assert result.match, result.layers
    assert result.empirical_bytes == result.run_spec.kv_bytes(40)
    assert result.scaled["num_hidden_layers"][1] <= result.scaled["num_hidden_layers"][0]


@pytest.mark.parametrize("name", preset_names())
def test_scaled_model_keeps_the_layer_pattern_prefix(name: str) -> None:
    full_cfg, model_type = text_config(load_preset(name).config)
    small, _ = tiny_config(load_preset(name).config)
    full, tiny = layer_types(full_cfg, model_type), layer_types(small, model_type)
    assert tiny == full[: len(tiny)]
    assert set(tiny) == set(full)


@pytest.mark.parametrize("name", preset_names())
def test_layer_pattern_matches_what_the_transformers_cache_builds(name: str) -> None:
    """Our hand-written layer rules agree with the function transformers' cache uses."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    from pdx.kv.hfconfig import build_hf_config

    config = load_preset(name).config
    hf_config, _ = build_hf_config(config)
    theirs, kwargs = get_layer_types_and_kwargs(hf_config.get_text_config(decoder=True))
    spec = build_spec(config, name=name)
    hf_name = {"full": "full_attention", "mla": "full_attention", "sliding": "sliding_attention"}
    hf_name.update(linear="linear_attention", hybrid="hybrid", none="dummy")
    by_mixer = {"chunked": "chunked_attention", "short_conv": "conv"}
    ours = [by_mixer.get(la.mixer, hf_name[la.kind]) for la in spec.layers]
    assert ours == list(theirs)
    windows = [kw.get("sliding_window") for kw in kwargs]
    assert [la.window_tokens for la in spec.layers] == [w - 1 if w else None for w in windows]
