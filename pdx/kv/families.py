"""Classify every decoder layer of a config and size what its cache holds.

Written by hand rather than through ``transformers`` configuration classes so that the
analytic path never imports torch; ``tests/kv/test_families.py`` checks the layer patterns
against the transformers configuration classes and the sizes against real forward passes.
"""

from __future__ import annotations

from typing import Any

from pdx.errors import UnsupportedModelError
from pdx.kv.layers import LayerSpec

#: model_type values pdx sizes exactly (``gemma3`` multimodal configs use their text model).
DENSE_ATTENTION = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
GEMMA = ("gemma", "gemma2", "gemma3_text")
MLA = ("deepseek_v2", "deepseek_v3")
HYBRID = ("qwen3_next", "jamba")
SUPPORTED = (*DENSE_ATTENTION, *GEMMA, "gpt_oss", *MLA, *HYBRID)

_MISSING = object()
_KIND = {
    "full_attention": "full",
    "attention": "full",
    "sliding_attention": "sliding",
    "chunked_attention": "sliding",
    "linear_attention": "linear",
    "mamba": "linear",
    "mla": "mla",
    "moe": "none",
    "mlp": "none",
}


def need(cfg: dict[str, Any], model_type: str, key: str, default: Any = _MISSING) -> Any:
    """A config field the sizing depends on; a missing one names model_type and field."""
    value = cfg.get(key, default)
    if value is _MISSING or value is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r}: config is missing {key!r}, needed to size its KV cache"
        )
    return value


def need_int(cfg: dict[str, Any], model_type: str, key: str, default: Any = _MISSING) -> int:
    """A positive integer config field (see :func:`need`)."""
    value = need(cfg, model_type, key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UnsupportedModelError(
            f"model_type {model_type!r}: config field {key!r} is {value!r}, "
            "expected a positive integer"
        )
    return value


def text_config(config: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The decoder config and its model_type (multimodal wrappers hand over their text model)."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise UnsupportedModelError(
            "config has no 'model_type'; is this a Hugging Face config.json?"
        )
    inner = config.get("text_config")
    if isinstance(inner, dict) and "num_hidden_layers" not in config:
        inner_type = inner.get("model_type") or f"{model_type}_text"
        return inner, str(inner_type)
    if model_type not in SUPPORTED:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}"
        )
    return config, model_type


def layer_types(cfg: dict[str, Any], model_type: str) -> list[str]:
    """Per-layer attention type, following each model's own rules when ``layer_types`` is absent."""
    if model_type not in SUPPORTED:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}"
        )
    n = need_int(cfg, model_type, "num_hidden_layers")
    if model_type in MLA:
        return ["mla"] * n
    explicit = cfg.get("layer_types")
    if explicit is not None and model_type not in ("mistral", "jamba"):
        return _check_explicit(explicit, n, model_type)
    return _derived_layer_types(cfg, model_type, n)


def _check_explicit(explicit: Any, n: int, model_type: str) -> list[str]:
    if not isinstance(explicit, list) or len(explicit) != n:
        raise UnsupportedModelError(
            f"model_type {model_type!r}: 'layer_types' must list {n} entries "
            f"(num_hidden_layers), got {explicit!r:.80}"
        )
    for name in explicit:
        if name not in _KIND:
            raise UnsupportedModelError(
                f"model_type {model_type!r}: layer type {name!r} is not understood "
                f"(known: {', '.join(_KIND)})"
            )
    return list(explicit)


def _derived_layer_types(cfg: dict[str, Any], model_type: str, n: int) -> list[str]:
    if model_type == "jamba":
        period = need_int(cfg, model_type, "attn_layer_period")
        offset = need(cfg, model_type, "attn_layer_offset")
        return ["attention" if i % period == offset else "mamba" for i in range(n)]
    if model_type == "qwen3_next":
        interval = need_int(cfg, model_type, "full_attention_interval")
        return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    if model_type == "gemma3_text":
        pattern = need_int(cfg, model_type, "sliding_window_pattern")
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if model_type in ("gemma2", "gpt_oss"):
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if model_type in ("mistral", "mixtral"):
        if "sliding_window" not in cfg:  # null means "no window"; absent is not a choice
            need(cfg, model_type, "sliding_window")
        return ["full_attention" if cfg.get("sliding_window") is None else "sliding_attention"] * n
    if model_type.startswith("qwen") and cfg.get("use_sliding_window"):
        start = need_int(cfg, model_type, "max_window_layers")
        need_int(cfg, model_type, "sliding_window")
        return ["sliding_attention" if i >= start else "full_attention" for i in range(n)]
    return ["full_attention"] * n


def classify_layers(
    cfg: dict[str, Any], model_type: str, kv_bytes: int, state_bytes: int
) -> tuple[list[LayerSpec], list[str]]:
    """Every layer's kind and exact sizes at the given element sizes, plus notes for the user."""
    notes: list[str] = []
    layers = []
    for index, name in enumerate(layer_types(cfg, model_type)):
        kind = _KIND[name]
        if kind in ("full", "sliding"):
            layers.append(_attention_layer(cfg, model_type, index, kind, kv_bytes))
        elif kind == "mla":
            layers.append(_mla_layer(cfg, model_type, index, kv_bytes))
        elif kind == "linear":
            layers.append(_linear_layer(cfg, model_type, index, state_bytes))
        else:
            layers.append(LayerSpec(index, "none", 0, kv_bytes, detail="no cache"))
    if any(la.kind == "sliding" for la in layers):
        notes.append(
            "sliding layers keep sliding_window - 1 tokens (what the transformers cache keeps; "
            "the next token's own K/V completes the window)"
        )
    if model_type in MLA:
        notes.append("MLA: one latent (kv_lora_rank + qk_rope_head_dim) per token per layer")
    return layers, notes


def head_dim(cfg: dict[str, Any], model_type: str) -> int:
    """``head_dim`` when the config sets it, else hidden_size / num_attention_heads."""
    if cfg.get("head_dim") is not None:
        return need_int(cfg, model_type, "head_dim")
    hidden = need_int(cfg, model_type, "hidden_size")
    return hidden // need_int(cfg, model_type, "num_attention_heads")


def kv_heads(cfg: dict[str, Any], model_type: str) -> int:
    """``num_key_value_heads``; absent means MHA, as the model code does."""
    heads = need_int(cfg, model_type, "num_attention_heads")
    return need_int(cfg, model_type, "num_key_value_heads", heads)


def _attention_layer(
    cfg: dict[str, Any], model_type: str, index: int, kind: str, kv_bytes: int
) -> LayerSpec:
    heads, dim = kv_heads(cfg, model_type), head_dim(cfg, model_type)
    per_token = 2 * heads * dim
    detail = f"K+V {heads}x{dim}"
    if kind == "full":
        return LayerSpec(index, "full", per_token, kv_bytes, detail=detail)
    key = "sliding_window"
    if cfg.get("layer_types") and cfg["layer_types"][index] == "chunked_attention":
        key = "attention_chunk_size"
    window = need_int(cfg, model_type, key)
    detail = f"{detail}, window {window}"
    return LayerSpec(index, "sliding", per_token, kv_bytes, window - 1, detail=detail)


def _mla_layer(cfg: dict[str, Any], model_type: str, index: int, kv_bytes: int) -> LayerSpec:
    rank = need_int(cfg, model_type, "kv_lora_rank")
    rope = need_int(cfg, model_type, "qk_rope_head_dim")
    detail = f"latent {rank}+{rope}"
    return LayerSpec(index, "mla", rank + rope, kv_bytes, detail=detail)


def _linear_layer(cfg: dict[str, Any], model_type: str, index: int, elem: int) -> LayerSpec:
    if model_type == "qwen3_next":
        nk = need_int(cfg, model_type, "linear_num_key_heads")
        nv = need_int(cfg, model_type, "linear_num_value_heads")
        dk = need_int(cfg, model_type, "linear_key_head_dim")
        dv = need_int(cfg, model_type, "linear_value_head_dim")
        kernel = need_int(cfg, model_type, "linear_conv_kernel_dim")
        conv, recurrent = (2 * nk * dk + nv * dv) * kernel, nv * dk * dv
        detail = f"GatedDeltaNet conv {2 * nk * dk + nv * dv}x{kernel} + state {nv}x{dk}x{dv}"
    elif model_type == "jamba":
        inner = need_int(cfg, model_type, "mamba_expand") * need_int(cfg, model_type, "hidden_size")
        kernel = need_int(cfg, model_type, "mamba_d_conv")
        d_state = need_int(cfg, model_type, "mamba_d_state")
        conv, recurrent = inner * kernel, inner * d_state
        detail = f"Mamba conv {inner}x{kernel} + ssm {inner}x{d_state}"
    else:
        raise UnsupportedModelError(f"model_type {model_type!r}: linear-attention layers unknown")
    return LayerSpec(
        index, "linear", 0, 0, None, conv, recurrent, state_elem_bytes=elem, detail=detail
    )
