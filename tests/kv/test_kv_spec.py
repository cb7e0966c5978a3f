"""Analytic KV sizes from configs: presets, every attention family, errors, no torch."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest

from pdx.errors import InputError, UnsupportedModelError
from pdx.kv.source import ModelSource, apply_overrides, load_preset, preset_names
from pdx.kv.spec import build_spec, parse_seq_list

# bf16 bytes per token of the growing (full / MLA) layers, from the public configs.
GROWING_BF16 = {
    "llama-3.1-8b": 131072,
    "llama-3.1-70b": 327680,
    "qwen2.5-72b": 327680,
    "qwen3-32b": 262144,
    "deepseek-v3": 70272,
    "mistral-7b-v0.1": 0,
    "gemma-3-27b": 81920,
    "gpt-oss-120b": 36864,
    "qwen3-next-80b-a3b": 24576,
    "jamba-v0.1": 16384,
    "llama-4-scout-17b-16e": 12 * 2 * 8 * 128 * 2,  # 12 global layers; 36 chunked ones slide
    "phi-3-mini-4k-instruct": 0,  # every layer slides (window 2047)
    "falcon-h1-7b-instruct": 44 * 2 * 2 * 128 * 2,  # attention in every layer, beside Mamba-2
    "lfm2-1.2b": 6 * 2 * 8 * 64 * 2,
    "gemma-3-4b-it": 5 * 2 * 4 * 256 * 2,  # heads and head_dim written out in the preset
    "kimi-k2.6": 70272,  # MLA under model_type kimi_k2
}


def spec_of(name: str, **kw: str):
    return build_spec(load_preset(name).config, name=name, **kw)


def test_every_preset_is_listed() -> None:
    assert sorted(GROWING_BF16) == preset_names()


@pytest.mark.parametrize("name", sorted(GROWING_BF16))
def test_preset_kv_bytes_per_token(name: str) -> None:
    assert spec_of(name).kv_bytes_per_token == GROWING_BF16[name]


def test_qwen3_honours_head_dim_not_hidden_over_heads() -> None:
    spec = spec_of("qwen3-32b")
    assert spec.kv_bytes_per_token == 64 * 2 * 8 * 128 * 2 != 64 * 2 * 8 * 80 * 2


def test_deepseek_mla_latent_has_no_factor_two() -> None:
    spec = spec_of("deepseek-v3")
    assert {la.kind for la in spec.layers} == {"mla"}
    assert spec.layers[0].bytes_per_token == (512 + 64) * 2
    assert spec.kv_bytes(1000) == 61 * 576 * 2 * 1000


def test_mistral_sliding_window_caps_at_window_minus_one() -> None:
    spec = spec_of("mistral-7b-v0.1")
    assert spec.sliding_bytes_per_token == 131072
    assert spec.kv_bytes(1000) == 131072 * 1000
    assert spec.kv_bytes(4095) == spec.kv_bytes(100_000) == 131072 * 4095


def test_gemma3_full_and_capped_sliding_layers() -> None:
    spec = spec_of("gemma-3-27b")
    assert spec.kind_counts() == {"sliding": 52, "full": 10}
    assert [la.index for la in spec.layers if la.kind == "full"] == list(range(5, 62, 6))
    per_layer = 2 * 16 * 128 * 2
    assert spec.kv_bytes(32768) == 10 * per_layer * 32768 + 52 * per_layer * 1023


def test_gpt_oss_alternates_sliding_128() -> None:
    spec = spec_of("gpt-oss-120b")
    assert spec.kind_counts() == {"sliding": 18, "full": 18}
    assert spec.layers[0].kind == "sliding" and spec.layers[0].window_tokens == 127
    assert spec.kv_bytes(8192) == 36864 * 8192 + 36864 * 127


def test_qwen3_next_gated_deltanet_state_per_tensor() -> None:
    spec = spec_of("qwen3-next-80b-a3b")
    assert spec.kind_counts() == {"linear": 36, "full": 12}
    conv = (2 * 16 * 128 + 32 * 128) * 4
    recurrent = 32 * 128 * 128
    # transformers keeps the conv state in the model dtype and the recurrent state in fp32
    assert spec.state_dtypes() == {"conv": "bf16", "recurrent": "fp32"}
    assert spec.state_bytes_per_request == 36 * (conv * 2 + recurrent * 4) == 77_856_768
    assert spec.kv_bytes(1) == 24576 + 77_856_768


def test_jamba_mamba_state_per_tensor() -> None:
    spec = spec_of("jamba-v0.1")
    assert [la.index for la in spec.layers if la.kind == "full"] == [4, 12, 20, 28]
    inner = 2 * 4096
    # the figure the issue measured from transformers' own cache (jamba-1.5-mini, same shape)
    assert spec.state_bytes_per_request == 28 * (inner * 4 * 2 + inner * 16 * 4) == 16_515_072
    conv, ssm = spec.layers[0].states
    assert (conv.shape, conv.dtype, ssm.shape, ssm.dtype) == (
        (inner, 4),
        "bf16",
        (inner, 16),
        "fp32",
    )


def test_state_dtype_and_kv_dtype() -> None:
    assert spec_of("llama-3.1-70b", dtype="fp8").kv_bytes_per_token == 163840
    assert spec_of("llama-3.1-70b", dtype="fp32").kv_bytes_per_token == 655360
    inner = 2 * 4096
    fp8 = spec_of("jamba-v0.1", dtype="fp8")  # fp8 KV: the model (and its conv state) is bf16
    assert fp8.state_dtypes() == {"conv": "bf16", "recurrent": "fp32"}
    assert fp8.state_bytes_per_request == 16_515_072
    bf16_state = spec_of("jamba-v0.1", state_dtype="bf16")  # overrides the SSM state only
    assert bf16_state.state_bytes_per_request == 28 * (inner * 4 + inner * 16) * 2 == 9_175_040
    assert bf16_state.kv_bytes_per_token == 16384
    vllm = spec_of("jamba-v0.1", engine="vllm")  # vLLM keeps both in the model dtype
    assert vllm.state_dtypes() == {"conv": "bf16", "recurrent": "bf16"}


def test_user_config_of_a_known_family_is_sized_exactly() -> None:
    cfg = {
        "model_type": "qwen3",
        "num_hidden_layers": 7,
        "hidden_size": 1000,
        "num_attention_heads": 10,
        "num_key_value_heads": 5,
        "head_dim": 96,
        "intermediate_size": 3000,
        "vocab_size": 5000,
        "use_sliding_window": True,
        "sliding_window": 300,
        "max_window_layers": 4,
    }
    spec = build_spec(cfg, name="custom", dtype="fp16")
    per_layer = 2 * 5 * 96 * 2
    assert spec.kind_counts() == {"full": 4, "sliding": 3}
    assert spec.kv_bytes(1000) == 4 * per_layer * 1000 + 3 * per_layer * 299


def test_explicit_layer_types_win() -> None:
    cfg = copy.deepcopy(load_preset("gpt-oss-120b").config)
    cfg["layer_types"] = ["full_attention"] * 36
    assert build_spec(cfg, name="x").kv_bytes_per_token == 36 * 2048


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda c: c.update(model_type="bert"), "'bert' is not a decoder-only language model"),
        (lambda c: c.update(model_type="t5"), "'t5' is not a decoder-only language model"),
        (lambda c: c.pop("model_type"), "no 'model_type'"),
        (lambda c: c.update(num_key_value_heads=0), "num_key_value_heads: got 0, expected"),
    ],
)
def test_bad_configs_name_the_problem(mutate, needle: str) -> None:
    cfg = copy.deepcopy(load_preset("llama-3.1-8b").config)
    mutate(cfg)
    with pytest.raises(UnsupportedModelError, match=needle):
        build_spec(cfg, name="x")


def test_unknown_model_type_names_every_missing_field_at_once() -> None:
    cfg = {"model_type": "in_house_lm", "num_hidden_layers": 4, "hidden_size": 256}
    with pytest.raises(UnsupportedModelError) as err:
        build_spec(cfg, name="x")
    message = str(err.value)
    assert message.startswith("missing ") and message.count("missing") == 1
    assert "num_attention_heads" in message and "num_key_value_heads" in message
    assert "'in_house_lm'" in message and "--set FIELD=VALUE" in message and "\n" not in message


def test_unknown_model_type_with_mla_fields_is_sized_as_mla() -> None:
    cfg = {**load_preset("deepseek-v3").config, "model_type": "kimi_k2"}
    spec = build_spec(cfg, name="kimi")
    assert spec.kind_counts() == {"mla": 61} and spec.kv_bytes_per_token == 70272
    assert spec.config_source is None and any("kimi_k2" in n for n in spec.notes)


def test_class_defaults_never_fill_what_the_file_omits() -> None:
    """Gemma3TextConfig would supply 8 heads, 4 KV heads and a 5:1 pattern: named instead."""
    cfg = copy.deepcopy(load_preset("gemma-3-27b").config)
    for key in ("sliding_window_pattern", "num_attention_heads", "num_key_value_heads"):
        del cfg["text_config"][key]
    with pytest.raises(UnsupportedModelError) as err:
        build_spec(cfg, name="x")
    message = str(err.value)
    assert message.startswith("missing ") and "\n" not in message
    for key in ("sliding_window_pattern", "num_attention_heads", "num_key_value_heads"):
        assert key in message
    assert "head_dim" not in message  # the file sets it
    given = {"sliding_window_pattern": 6, "num_attention_heads": 32, "num_key_value_heads": 16}
    spec = build_spec(apply_overrides(ModelSource("x", cfg), given).config, name="x")
    assert spec.kv_bytes_per_token == GROWING_BF16["gemma-3-27b"]


def test_parameter_count_is_unknown_not_defaulted() -> None:
    cfg = copy.deepcopy(load_preset("gemma-3-27b").config)
    del cfg["text_config"]["vocab_size"]  # Gemma3TextConfig would count 262,208
    spec = build_spec(cfg, name="x")
    assert spec.kv_bytes_per_token == GROWING_BF16["gemma-3-27b"] and spec.params_total == 0
    assert any(n.startswith("parameter count unknown: missing vocab_size") for n in spec.notes)
    cfg["text_config"]["vocab_size"] = 1.5  # a bad value is an error, even for the count
    with pytest.raises(UnsupportedModelError, match=r"^vocab_size: got 1\.5, expected a posi"):
        build_spec(cfg, name="x")


def test_head_dim_is_derived_only_where_the_class_derives_it() -> None:
    llama = copy.deepcopy(load_preset("llama-3.1-8b").config)
    spec = build_spec(llama, name="x")  # LlamaConfig: head_dim = hidden_size // heads
    assert spec.derived == {"head_dim": "head_dim = 128 (hidden_size / num_attention_heads)"}
    assert any("derived: head_dim = 128" in n for n in spec.notes)
    gemma = copy.deepcopy(load_preset("gemma-3-27b").config)
    del gemma["text_config"]["head_dim"]  # Gemma3TextConfig's default 256, not 5376 / 32
    with pytest.raises(UnsupportedModelError, match=r"^missing head_dim: "):
        build_spec(gemma, name="x")
    llama["hidden_size"] = 4100  # not a multiple of 32 heads
    with pytest.raises(UnsupportedModelError, match=r"^head_dim: got nothing, expected a head"):
        build_spec(llama, name="x")


def test_a_derived_layer_pattern_needs_every_field_it_derives_from() -> None:
    text = {"model_type": "llama4_text", "num_hidden_layers": 4, "hidden_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "attn_temperature_tuning": 4, "attention_chunk_size": 8192}  # fmt: skip
    cfg = {"model_type": "llama4", "text_config": text}
    with pytest.raises(UnsupportedModelError, match=r"^missing no_rope_layer_interval: "):
        build_spec(cfg, name="x")  # Llama4TextConfig would derive the pattern from 4
    text["no_rope_layer_interval"] = 4
    spec = build_spec(cfg, name="x")
    assert spec.kind_counts() == {"sliding": 3, "full": 1}
    assert spec.layers[0].window_tokens == 8191
    assert "layer_types" in spec.derived
    # a field the class rejects and the sizing does not read is named in a note
    assert any("attn_temperature_tuning" in n and "ignored" in n for n in spec.notes)


def test_family_specific_bad_fields() -> None:
    bad_types = copy.deepcopy(load_preset("gpt-oss-120b").config)
    bad_types["layer_types"] = ["full_attention"] * 3
    with pytest.raises(UnsupportedModelError):
        build_spec(bad_types, name="x")
    raw = {
        "model_type": "in_house_ssm",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "layer_types": ["linear_attention", "full_attention"],
        "num_attention_heads": 4,
    }
    with pytest.raises(UnsupportedModelError, match="no sizing rule for this model's state mixer"):
        build_spec(raw, name="x")  # fmt: skip


@pytest.mark.parametrize("text", ["0", "-5", "abc", "1024,,x", ""])
def test_bad_seq_lists(text: str) -> None:
    with pytest.raises(InputError, match="--seq"):
        parse_seq_list(text)


def test_seq_list_parses_k_suffix() -> None:
    assert parse_seq_list("1024, 8k,32K") == [1024, 8192, 32768]


def test_spec_rejects_non_positive_seq() -> None:
    with pytest.raises(InputError, match="seq"):
        spec_of("llama-3.1-8b").kv_bytes(0)


def test_unknown_dtype() -> None:
    with pytest.raises(InputError, match="--dtype"):
        spec_of("llama-3.1-8b", dtype="int3")
    with pytest.raises(InputError, match="--state-dtype"):
        spec_of("jamba-v0.1", state_dtype="fp8")


@pytest.mark.parametrize(
    ("name", "total_b", "active_b"),
    [
        ("llama-3.1-70b", 70.6, 70.6),
        ("llama-3.1-8b", 8.03, 8.03),
        ("deepseek-v3", 671.0, 37.0),
        ("qwen3-next-80b-a3b", 80.0, 3.9),
        ("jamba-v0.1", 51.6, 12.0),
        ("gpt-oss-120b", 116.8, 5.7),
        ("gemma-3-27b", 27.0, 27.0),
        ("llama-4-scout-17b-16e", 109.0, 17.0),
    ],
)
def test_parameter_counts_near_published(name: str, total_b: float, active_b: float) -> None:
    spec = spec_of(name)
    assert spec.params_total / 1e9 == pytest.approx(total_b, rel=0.03)
    assert spec.params_active / 1e9 == pytest.approx(active_b, rel=0.05)


def test_analytic_path_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from pdx.kv.report import MeasureOptions, measure_kv\n"
        "from pdx.kv.source import load_preset\n"
        "r = measure_kv(load_preset('gemma-3-27b'), MeasureOptions())\n"
        "assert r.kv_bytes_per_token == 81920\n"
        "bad = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
