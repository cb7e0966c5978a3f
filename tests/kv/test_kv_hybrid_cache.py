"""Hybrid models' analytic bytes == every tensor transformers' cache holds after a real prefill.

Qwen3-Next (Gated DeltaNet + full attention), Jamba (Mamba + attention) and Zamba (multi-head
Mamba + shared attention): tiny random-weight models from configs written the way their
published ``config.json`` files are (the layer pattern given by ``full_attention_interval``,
``attn_layer_period`` / ``attn_layer_offset``, ``layers_block_type``), prefilled on CPU. The
cache object is walked here, independently of pdx's own walker: every tensor reachable from it
counts, except the position counters (0-dim integer tensors, one per cache layer whatever the
batch), which are named and set aside. The same configs read without transformers (its
configuration classes absent) must size the same.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pdx.errors import MeasurementError, UnsupportedModelError
from pdx.kv import hfconfig
from pdx.kv.empirical import build_model, count_cache, mismatches, prefill
from pdx.kv.families import kind_of, layer_types
from pdx.kv.spec import KVSpec, build_spec

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 256}

QWEN3_NEXT = {
    "model_type": "qwen3_next", **TINY, "num_key_value_heads": 2, "head_dim": 16,
    "num_hidden_layers": 4, "full_attention_interval": 2, "linear_conv_kernel_dim": 3,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
    "linear_value_head_dim": 12, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
}  # fmt: skip
JAMBA = {
    "model_type": "jamba", **TINY, "num_key_value_heads": 2, "num_hidden_layers": 4,
    "attn_layer_period": 3, "attn_layer_offset": 1, "expert_layer_period": 2,
    "expert_layer_offset": 1, "num_experts": 2, "num_experts_per_tok": 1, "mamba_d_state": 6,
    "mamba_d_conv": 3, "mamba_expand": 2, "mamba_dt_rank": 4,
}  # fmt: skip
ZAMBA = {
    "model_type": "zamba", **TINY, "num_key_value_heads": 2, "num_hidden_layers": 4,
    "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"], "attention_head_dim": 32,
    "n_mamba_heads": 2, "mamba_d_state": 8, "mamba_d_conv": 3, "mamba_expand": 2,
}  # fmt: skip
CONFIGS = {"qwen3_next": QWEN3_NEXT, "jamba": JAMBA, "zamba": ZAMBA}

# Worked by hand from the model code (batch 1; conv states in the model dtype, recurrent /
# SSM states in float32 whatever the model dtype):
#   Qwen3-Next: layers (i + 1) % 2 == 0 attend: [linear, full, linear, full]; K+V 2 heads x 16;
#     conv (2*2*8 + 4*12, 3) = (80, 3); recurrent (4 value heads, 8, 12).
#   Jamba: layer i % 3 == 1 attends: [mamba, full, mamba, mamba]; K+V 2 heads x 64/4;
#     conv (2*64, 3); ssm (2*64, 6).
#   Zamba: hybrid layers attend (K+V 2 heads x 32) beside their Mamba; every layer's Mamba
#     keeps conv (2*64, 3) and an ssm per head (2 heads, 128/2, 8).
PATTERN = {
    "qwen3_next": ["linear", "full", "linear", "full"],
    "jamba": ["linear", "full", "linear", "linear"],
    "zamba": ["linear", "hybrid", "linear", "hybrid"],
}
STATES = {  # per state layer: (conv shape, recurrent shape)
    "qwen3_next": ((80, 3), (4, 8, 12)),
    "jamba": ((128, 3), (128, 6)),
    "zamba": ((128, 3), (2, 64, 8)),
}
PER_TOKEN = {  # (bf16, fp32) bytes per token over the attention layers
    "qwen3_next": (2 * 2 * 2 * 16 * 2, 2 * 2 * 2 * 16 * 4),
    "jamba": (1 * 2 * 2 * 16 * 2, 1 * 2 * 2 * 16 * 4),
    "zamba": (2 * 2 * 2 * 32 * 2, 2 * 2 * 2 * 32 * 4),
}
PER_REQUEST = {  # (bf16, fp32) state bytes: layers x (conv in the model dtype + fp32 state)
    "qwen3_next": (2 * (80 * 3 * 2 + 4 * 8 * 12 * 4), 2 * (80 * 3 * 4 + 4 * 8 * 12 * 4)),
    "jamba": (3 * (128 * 3 * 2 + 128 * 6 * 4), 3 * (128 * 3 * 4 + 128 * 6 * 4)),
    "zamba": (4 * (128 * 3 * 2 + 2 * 64 * 8 * 4), 4 * (128 * 3 * 4 + 2 * 64 * 8 * 4)),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SHORT, LONG = 2, 19  # shorter than the conv kernel, and longer


def every_tensor(obj: Any, path: str = "cache", seen: set[int] | None = None) -> list[tuple]:
    """``(path, tensor)`` for every tensor reachable from ``obj``: attributes, dicts, lists."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    if isinstance(obj, dict):
        items = [(f"{path}[{k!r}]", v) for k, v in obj.items()]
    elif isinstance(obj, list | tuple):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        items = [(f"{path}.{k}", v) for k, v in vars(obj).items()]
    else:
        return []
    return [found for sub, value in items for found in every_tensor(value, sub, seen)]


def is_counter(tensor: torch.Tensor) -> bool:
    return tensor.dim() == 0 and not tensor.is_floating_point()


def nbytes(tensors: list[tuple]) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors)


@pytest.fixture(scope="module")
def models() -> dict[tuple[str, str], Any]:
    """One random-weight model per family and dtype, built once for the module."""
    return {}


def cache_after(models: dict[tuple[str, str], Any], family: str, dtype: str, seq: int) -> Any:
    """The cache object a prefill of ``seq`` random tokens returns."""
    if (family, dtype) not in models:
        models[family, dtype] = build_model(CONFIGS[family], dtype)
    return prefill(models[family, dtype], seq)[0]


def held(models: dict[tuple[str, str], Any], family: str, dtype: str, seq: int) -> list[tuple]:
    """Every tensor of the cache after prefilling ``seq`` tokens (position counters aside)."""
    tensors = every_tensor(cache_after(models, family, dtype, seq))
    counters = [(p, t) for p, t in tensors if is_counter(t)]
    linear = [i for i, kind in enumerate(PATTERN[family]) if kind != "full"]
    # the only tensors set aside: one int64 token counter per linear-attention cache layer
    # (transformers' ``cumulative_length_linear``), the same for any batch size
    assert [p.split("].")[0] + "]" for p, _ in counters] == [f"cache.layers[{i}]" for i in linear]
    assert all(t.dtype == torch.int64 for _, t in counters)
    return [(p, t) for p, t in tensors if not is_counter(t)]


def spec_for(family: str, dtype: str) -> KVSpec:
    return build_spec(CONFIGS[family], name=family, dtype=dtype, allow_torch=True)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_cache_bytes_equal_the_prediction_per_token_and_per_request(
    models: dict[tuple[str, str], Any], family: str, dtype: str
) -> None:
    spec = spec_for(family, dtype)
    short = nbytes(held(models, family, dtype, SHORT))
    long = nbytes(held(models, family, dtype, LONG))
    assert (short, long) == (spec.kv_bytes(SHORT), spec.kv_bytes(LONG))
    per_token = (long - short) // (LONG - SHORT)
    per_request = short - SHORT * per_token
    column = 0 if dtype == "bf16" else 1
    assert per_token == spec.kv_bytes_per_token == PER_TOKEN[family][column]
    assert per_request == spec.state_bytes_per_request == PER_REQUEST[family][column]


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_each_layer_holds_the_predicted_tensors(
    models: dict[tuple[str, str], Any], family: str
) -> None:
    spec = spec_for(family, "bf16")
    assert [la.kind for la in spec.layers] == PATTERN[family]
    tensors = held(models, family, "bf16", LONG)
    conv, recurrent = STATES[family]
    for la in spec.layers:
        mine = [(p, t) for p, t in tensors if p.startswith(f"cache.layers[{la.index}].")]
        shapes = sorted((tuple(t.shape), t.dtype) for _, t in mine)
        expected = [((1, *conv), torch.bfloat16), ((1, *recurrent), torch.float32)]
        if la.kind == "linear":
            assert shapes == sorted(expected)
        else:
            heads = CONFIGS[family]["num_key_value_heads"]
            kv = [((1, heads, LONG, la.tokens[0].elems // heads), torch.bfloat16)] * 2
            assert shapes == sorted(kv + (expected if la.kind == "hybrid" else []))
        assert nbytes(mine) == la.bytes_for(LONG)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_the_config_read_without_transformers_sizes_the_same(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layer pattern and every state from the config's own fields, no class to derive them."""
    resolved = spec_for(family, "bf16")
    monkeypatch.setattr(hfconfig, "transformers_version", lambda: None)
    raw = build_spec(CONFIGS[family], name=family, dtype="bf16")
    assert raw.config_source is None
    assert [(la.kind, la.tokens, la.states) for la in raw.layers] == [
        (la.kind, la.tokens, la.states) for la in resolved.layers
    ]
    assert raw.kv_bytes(LONG) == resolved.kv_bytes(LONG)
    types = layer_types(CONFIGS[family], CONFIGS[family]["model_type"])
    assert [kind_of(t) for t in types] == PATTERN[family]


def test_state_mixer_fields_without_a_layer_pattern_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not every layer silently sized as attention: the missing pattern is named."""
    monkeypatch.setattr(hfconfig, "transformers_version", lambda: None)
    cfg = {k: v for k, v in JAMBA.items() if k not in ("attn_layer_period", "attn_layer_offset")}
    with pytest.raises(UnsupportedModelError, match="no layer pattern") as err:
        build_spec(cfg, name="x")
    assert "'attn_layer_period'" in str(err.value)


def test_pdx_walker_reports_a_tensor_no_rule_accounts_for(
    models: dict[tuple[str, str], Any],
) -> None:
    """The --empirical comparison counts every tensor, not just the names it expects."""
    spec = spec_for("qwen3_next", "fp32")
    cache = cache_after(models, "qwen3_next", "fp32", 7)
    counted = count_cache(cache, spec, 7)
    assert mismatches(counted) == [] and sum(la.bytes for la in counted) == spec.kv_bytes(7)
    assert [la.counter_bytes for la in counted] == [8, 0, 8, 0]
    cache.layers[0].scratch = {"extra": torch.zeros(1, 7)}
    lines = mismatches(count_cache(cache, spec, 7))
    assert lines == ["layer 0 scratch['extra']: cache fp32 [1, 7] 28 B, analytic - [] 0 B"]
    del cache.layers[0].scratch
    cache.stray = [torch.zeros(3)]
    with pytest.raises(MeasurementError, match=r"outside its layers: stray\[0\]"):
        count_cache(cache, spec, 7)
