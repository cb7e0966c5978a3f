"""Every field the sizing reads comes from the file: removed or corrupted, it is named.

A property test over hand-written configs of three families (GQA attention with and without
``head_dim``, sliding windows, MLA): any set of one to three fields removed or given a bad
value (0, negative, fractional, a string, a boolean, a non-divisor) either fails with one
line naming each such field, or (a field only the parameter count reads, removed) sizes the
KV exactly as before with the count unknown and the field named in a note. It never sizes
with a different number. The configs are read in this process (``allow_torch``) so that each
example costs milliseconds, not a child process.
"""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdx.errors import UnsupportedModelError
from pdx.kv.fields import screen_values
from pdx.kv.source import load_preset
from pdx.kv.spec import KVSpec, build_spec

LLAMA_70B = {
    "model_type": "llama", "hidden_size": 8192, "num_attention_heads": 64,
    "num_key_value_heads": 8, "num_hidden_layers": 80, "head_dim": 128,
    "intermediate_size": 28672, "vocab_size": 128256, "torch_dtype": "bfloat16",
}  # fmt: skip
LLAMA_NO_HEAD_DIM = {k: v for k, v in LLAMA_70B.items() if k != "head_dim"}
MISTRAL = {
    "model_type": "mistral", "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 8, "num_hidden_layers": 32, "sliding_window": 4096,
    "intermediate_size": 14336, "vocab_size": 32000,
}  # fmt: skip
DEEPSEEK = copy.deepcopy(load_preset("deepseek-v3").config)

# (config, fields the KV sizing reads, fields only the parameter count reads)
BASES: dict[str, tuple[dict[str, Any], tuple[str, ...], tuple[str, ...]]] = {
    "llama": (
        LLAMA_70B,
        ("num_hidden_layers", "num_key_value_heads", "num_attention_heads", "head_dim"),
        ("hidden_size", "intermediate_size", "vocab_size"),
    ),  # head_dim removed is derived (LlamaConfig's rule, hidden_size / num_attention_heads)
    "llama_derived_head_dim": (
        LLAMA_NO_HEAD_DIM,
        ("num_hidden_layers", "num_key_value_heads", "hidden_size", "num_attention_heads"),
        ("intermediate_size", "vocab_size"),
    ),
    "mistral": (
        MISTRAL,
        ("num_hidden_layers", "num_key_value_heads", "hidden_size", "num_attention_heads",
         "sliding_window"),
        ("intermediate_size", "vocab_size"),
    ),
    "deepseek_mla": (
        DEEPSEEK,
        ("num_hidden_layers", "kv_lora_rank", "qk_rope_head_dim"),
        ("hidden_size", "num_attention_heads", "qk_nope_head_dim", "v_head_dim", "vocab_size",
         "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok"),
    ),
}  # fmt: skip
REFERENCE = {name: build_spec(base[0], name=name, allow_torch=True) for name, base in BASES.items()}

#: Removed, these may be derived from fields the file keeps (and the derivation noted).
DERIVABLE = ("head_dim",)
#: Null in these says "off", which the file may say; removing them is what is tested.
NULL_MEANS_OFF = ("sliding_window",)
_REMOVE = "<removed>"
_NON_DIVISOR = "<non-divisor>"
_HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads")
BAD_VALUES = st.one_of(
    st.just(_REMOVE),
    st.just(None),  # null is as good as absent
    st.just(0),
    st.integers(min_value=-(10**6), max_value=-1),
    st.floats(min_value=0.01, max_value=1e6).filter(lambda x: not x.is_integer()),
    st.text(min_size=1, max_size=6),
    st.booleans(),
    st.just(_NON_DIVISOR),
)


def _mutate(cfg: dict[str, Any], key: str, bad: Any, heads: int) -> dict[str, Any]:
    if bad == _REMOVE:
        cfg.pop(key, None)
    elif bad == _NON_DIVISOR:  # a positive count that breaks the heads / KV-heads ratio
        cfg[key] = heads - 1 if key == "num_key_value_heads" else heads + 1
    else:
        cfg[key] = bad
    return cfg


def _kv_figures(spec: KVSpec) -> tuple[Any, ...]:
    return spec.kv_bytes_per_token, spec.sliding_bytes_per_token, spec.kv_bytes(8192)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    base=st.sampled_from(sorted(BASES)),
    picks=st.lists(st.tuples(st.integers(0, 99), BAD_VALUES), min_size=1, max_size=3),
)
def test_a_removed_or_corrupted_field_is_named_never_guessed(
    base: str, picks: list[tuple[int, Any]]
) -> None:
    config, kv_fields, param_fields = BASES[base]
    fields = (*kv_fields, *param_fields)
    cfg = copy.deepcopy(config)
    changes = {fields[i % len(fields)]: bad for i, bad in picks}
    changes = {
        k: 0 if bad == _NON_DIVISOR and k not in _HEAD_COUNTS else bad for k, bad in changes.items()
    }
    # "sliding_window": null says "no window" (a statement, not a gap): removal is the test
    changes = {
        k: _REMOVE if bad is None and k in NULL_MEANS_OFF else bad for k, bad in changes.items()
    }
    for key, bad in changes.items():
        _mutate(cfg, key, bad, int(config["num_attention_heads"]))
    corrupted = [k for k, bad in changes.items() if bad not in (_REMOVE, None)]
    if len(set(_HEAD_COUNTS) & set(changes)) == 2:  # a ratio is wrong only against the other
        corrupted = [k for k in corrupted if changes[k] != _NON_DIVISOR]
    removed = [k for k, bad in changes.items() if bad in (_REMOVE, None)]
    needed = [k for k in removed if k in kv_fields and k not in DERIVABLE]
    try:
        spec = build_spec(cfg, name=base, allow_torch=True)
    except UnsupportedModelError as exc:
        message = str(exc)
        assert "\n" not in message and message.count("missing") <= 1
        for key in corrupted + needed:
            assert key in message, (key, message)
        return
    # Sized: only removals the KV does not need or a documented rule derives; same KV figures.
    assert not corrupted, (changes, spec.kv_bytes_per_token)
    assert not needed, changes
    assert _kv_figures(spec) == _kv_figures(REFERENCE[base])
    for key in removed:
        if key in DERIVABLE and key in kv_fields:
            assert key in spec.derived and any(f"derived: {key} =" in n for n in spec.notes)
        else:
            assert spec.params_total == 0  # unknown, never counted from a class default
            note = next(n for n in spec.notes if n.startswith("parameter count unknown"))
            assert key in note, note


def test_every_bad_value_is_one_problem_not_one_per_layer() -> None:
    cfg = {**LLAMA_70B, "num_key_value_heads": -8, "head_dim": 0, "vocab_size": "many"}
    assert screen_values(cfg) == {
        "num_key_value_heads": "got -8, expected a positive integer",
        "head_dim": "got 0, expected a positive integer",
        "vocab_size": "got 'many', expected a positive integer",
    }
    try:
        build_spec(cfg, name="x", allow_torch=True)
    except UnsupportedModelError as exc:
        assert str(exc) == (
            "num_key_value_heads: got -8, expected a positive integer; "
            "head_dim: got 0, expected a positive integer; "
            "vocab_size: got 'many', expected a positive integer"
        )
    else:  # pragma: no cover - the assertion message names what went wrong
        raise AssertionError("a config with three bad fields was sized")


def test_missing_and_bad_fields_are_named_together() -> None:
    cfg = {k: v for k, v in LLAMA_70B.items() if k not in ("num_hidden_layers", "head_dim")}
    cfg["hidden_size"] = 8192.5
    try:
        build_spec(cfg, name="x", allow_torch=True)
    except UnsupportedModelError as exc:
        message = str(exc)
    else:  # pragma: no cover
        raise AssertionError("sized")
    assert message.startswith("hidden_size: got 8192.5, expected a positive integer; missing ")
    assert "num_hidden_layers" in message
