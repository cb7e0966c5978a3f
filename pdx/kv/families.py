"""Classify every decoder layer of a config and size what its cache holds, by layer kind.

The config arrives as transformers' configuration class read it (:mod:`pdx.kv.hfconfig`:
derived ``layer_types``, nested text configs, aliases) beside the file itself; model types
transformers does not know arrive as their raw dict, whose layer pattern is derived from its
own pattern fields as the hybrids' configuration classes derive it. Every value a rule uses
comes from the file (or ``--set``) or from a documented derivation (:class:`Fields`); a field
missing from the file is named, never filled with a class default. Each layer type is sized
by one rule, whatever the model's name: attention (full, sliding, chunked), MLA (any config
with ``kv_lora_rank``), MLA with a sparse-attention indexer, attention + SSM in one layer,
and the fixed-state mixers below (short convolution, Mamba-1, Mamba-2, Gated DeltaNet, Kimi
Delta Attention, lightning attention), each read from its own config fields.
``tests/kv/test_kv_families.py`` checks the rules against real forward passes, tensor by
tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pdx.kv.fields import Fields, is_positive_int
from pdx.kv.hfconfig import ResolvedConfig, one_line, raw_text_config
from pdx.kv.layers import LayerKind, LayerSpec, StateTensor, TokenTensor

Engine = Literal["transformers", "vllm"]
ENGINES: tuple[str, ...] = ("transformers", "vllm")

_NO_CACHE = ("moe", "mlp", "dummy")
_ATTENTION = ("full_attention", "attention")
_SLIDING = ("sliding_attention", "chunked_attention")
_STATEFUL = ("linear_attention", "mamba", "mamba2", "conv", "hybrid")
KNOWN_LAYER_TYPES = (*_ATTENTION, *_SLIDING, "indexed_attention", *_STATEFUL, *_NO_CACHE)
#: Mixers whose recurrent state transformers' PyTorch path keeps in the model dtype.
_RECURRENT_IN_MODEL_DTYPE = ("lightning",)
_HF_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class Dtypes:
    """Element types of every tensor kind: KV, activations (conv, indexer), recurrent states.

    ``state`` is ``auto`` (each engine's own choice per mixer) or an explicit override of the
    recurrent / SSM states.
    """

    kv: str
    model: str
    state: str = "auto"
    engine: str = "transformers"

    def recurrent(self, mixer: str, cfg: Fields) -> str:
        """The dtype ``engine`` keeps this mixer's recurrent / SSM state in."""
        if self.state != "auto":
            return self.state
        if self.engine == "transformers":
            return self.model if mixer in _RECURRENT_IN_MODEL_DTYPE else "fp32"
        if mixer == "kda":
            return "fp32"  # vLLM keeps the KDA recurrent state in float32 whatever the setting
        declared = cfg.marker("mamba_ssm_cache_dtype")  # vLLM reads the class's value
        return _HF_DTYPES.get(str(declared), self.model) if declared else self.model


def text_config(config: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The decoder part of a raw config and its model_type (multimodal wrappers hand over)."""
    return raw_text_config(config)


# --- which layer is which -------------------------------------------------------------------


def layer_types(cfg: dict[str, Any], model_type: str) -> list[str]:
    """Per-layer type names, as the transformers cache derives them (see module docstring)."""
    f = Fields(cfg, model_type)
    types = _layer_types(f)
    f.check()
    return types


def _layer_types(f: Fields) -> list[str]:
    # Zamba, Zamba2 and Nemotron-H name their list layers_block_type (their classes alias it)
    own = f.in_file("layers_block_type") and not f.in_file("layer_types")
    key = "layers_block_type" if own else "layer_types"
    explicit = f.optional(key)
    n = _layer_count(f)
    types = _checked_types(f, key, explicit, n) if explicit is not None else _inferred_types(f, n)
    return _apply_kv_sharing(f, types)


def _layer_count(f: Fields) -> int:
    """``num_hidden_layers``; without it, the length of the layer list or pattern the file gives
    (Nemotron-H's configuration class does the same)."""
    if not f.in_file("num_hidden_layers"):
        for key in ("layer_types", "layers_block_type", "hybrid_override_pattern"):
            listed = f.file_value(key) if f.in_file(key) else None
            if isinstance(listed, list | str) and listed:
                return int(f.derive("num_hidden_layers", len(listed), f"the length of {key}"))
    return f.int("num_hidden_layers")


def _checked_types(f: Fields, key: str, explicit: Any, n: int) -> list[str]:
    if not isinstance(explicit, list) or len(explicit) != n:
        got = f"{len(explicit)} entries" if isinstance(explicit, list) else f"{explicit!r:.80}"
        f.problem(key, f"got {got}, expected a list of {n} layer types (num_hidden_layers)")
        return ["full_attention"] * n
    unknown = sorted({str(t) for t in explicit} - set(KNOWN_LAYER_TYPES))
    if unknown:
        f.problem(
            key, f"got {', '.join(map(repr, unknown))}, expected layer types with a sizing rule "
            f"({', '.join(KNOWN_LAYER_TYPES)})",
        )  # fmt: skip
        return ["full_attention"] * n
    return [str(t) for t in explicit]


def _inferred_types(f: Fields, n: int) -> list[str]:
    """No layer list: a hybrid's pattern fields, else transformers' own inference (a window
    slides every layer); a config with state-mixer fields but no pattern is refused."""
    hybrid = _hybrid_pattern(f, n)
    if hybrid is not None:
        return hybrid
    if any(applies(f, "") for _, applies, _ in _MIXERS):
        f.problem(
            "layer_types", "got no layer pattern for a config with state-mixer fields, expected "
            f"one of 'layer_types', 'layers_block_type', {', '.join(map(repr, _PATTERN_FIELDS))}",
        )  # fmt: skip
    if f.optional("use_sliding_window") is False:
        return ["full_attention"] * n
    if f.optional("sliding_window") is not None:
        start = f.optional("max_window_layers")
        if f.optional("use_sliding_window") and isinstance(start, int):
            return ["sliding_attention" if i >= start else "full_attention" for i in range(n)]
        return ["sliding_attention"] * n
    if f.optional("attention_chunk_size") is not None:
        return ["chunked_attention"] * n
    return ["full_attention"] * n


#: Fields a hybrid's configuration class derives its ``layer_types`` from (read in this order).
_PATTERN_FIELDS = (
    "hybrid_override_pattern",
    "full_attention_interval",
    "layer_group_size",
    "attn_layer_period",
    "attn_layer_offset",
    "attn_layer_indices",
    "full_attn_idxs",
)
#: Model types whose every layer is one kind (no pattern field).
_EVERY_LAYER = {"mamba": "mamba", "mamba2": "mamba", "falcon_mamba": "mamba", "falcon_h1": "hybrid"}
#: Nemotron-H's ``hybrid_override_pattern`` letters.
_PATTERN_LETTERS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


def _hybrid_pattern(f: Fields, n: int) -> list[str] | None:
    """The layer pattern a raw config describes, derived as its transformers config class does
    (a config read through transformers already carries the derived ``layer_types``)."""
    if f.model_type in _EVERY_LAYER:
        return [_EVERY_LAYER[f.model_type]] * n
    pattern = f.optional("hybrid_override_pattern")
    if isinstance(pattern, str):
        return [_PATTERN_LETTERS.get(letter, letter) for letter in pattern]
    interval = f.optional("full_attention_interval", "layer_group_size")
    if isinstance(interval, int) and interval > 0:  # Qwen3-Next, Qwen3.5, Ling hybrids
        return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    period, offset = f.optional("attn_layer_period"), f.optional("attn_layer_offset")
    if isinstance(period, int) and isinstance(offset, int) and period > 0:
        if f.model_type == "zamba":  # two Mamba layers and a shared-attention one lead
            rest = ["hybrid" if i % period == offset else "mamba" for i in range(n - 3)]
            return ["mamba", "mamba", "hybrid", *rest][:n]
        return ["attention" if i % period == offset else "mamba" for i in range(n)]  # Jamba
    for key, listed, other in (
        ("attn_layer_indices", "attention", "mamba"),  # Bamba
        ("full_attn_idxs", "full_attention", "conv"),  # LFM2
    ):
        indices = f.optional(key)
        if isinstance(indices, list):
            return [listed if i in indices else other for i in range(n)]
    return None


def _apply_kv_sharing(f: Fields, types: list[str]) -> list[str]:
    modes = f.optional("kv_sharing_modes")
    if isinstance(modes, list) and len(modes) == len(types):
        return ["dummy" if m == "reuse" else t for t, m in zip(types, modes, strict=True)]
    shared = f.optional("num_kv_shared_layers")
    if isinstance(shared, int) and 0 < shared < len(types):
        return types[: len(types) - shared] + ["dummy"] * shared
    return types


# --- sizing rules, one per layer kind --------------------------------------------------------


@dataclass(frozen=True)
class Classified:
    """Every layer sized, the notes for the user, and each value derived rather than read."""

    layers: list[LayerSpec]
    notes: list[str]
    derived: dict[str, str]


def classify_layers(
    resolved: ResolvedConfig, dtypes: Dtypes, invalid: dict[str, str] | None = None
) -> Classified:
    """Every layer's kind and exact tensors at the given dtypes, plus notes for the user.

    ``invalid`` holds the problems :func:`screen_values` found in the file; they are named
    with every other problem and missing field, in one error.
    """
    f = Fields(resolved.text, resolved.model_type, resolved, problems=dict(invalid or {}))
    types = _layer_types(f)
    layers = [_size_layer(f, i, name, dtypes) for i, name in enumerate(types)]
    f.check()
    return Classified(layers, _notes(f, layers, types, dtypes), dict(f.derived))


def _size_layer(f: Fields, index: int, name: str, dt: Dtypes) -> LayerSpec:
    if name in _NO_CACHE:
        why = "shares the KV of an earlier layer" if name == "dummy" else "no attention"
        return LayerSpec(index, "none", mixer="none", detail=f"no cache ({why})")
    if name in _ATTENTION:
        return _attention_layer(f, index, dt)
    if name == "indexed_attention":
        return _indexed_layer(f, index, dt)
    if name in _SLIDING:
        return _sliding_layer(f, index, name, dt)
    mixer, states, detail = _state_mixer(f, name, dt)
    if name != "hybrid":
        return LayerSpec(index, "linear", states=states, mixer=mixer, detail=detail)
    tokens, attn = _kv_tokens(f, dt)
    return LayerSpec(
        index, "hybrid", tokens=tokens, states=states, mixer=mixer, detail=f"{attn} + {detail}"
    )


def attention_head_dim(f: Fields) -> int:
    """``head_dim`` when the file sets it (or ``attention_head_dim``), else hidden / heads where
    the configuration class derives it so (not where a class default such as Gemma 3's 256
    would stand in)."""
    if f.in_file("head_dim") or f.in_file("attention_head_dim"):
        return f.int("head_dim", "attention_head_dim")
    f.read.update(("head_dim", "attention_head_dim"))
    hidden, heads = f.int("hidden_size"), f.int("num_attention_heads")
    theirs = f.marker("head_dim", "attention_head_dim")
    if {"hidden_size", "num_attention_heads"} & {*f.problems, *f.missing}:
        # name head_dim now too when the class's value is no quotient of its own sizes
        size, count = f.cfg.get("hidden_size"), f.cfg.get("num_attention_heads")
        quotient = size // count if is_positive_int(size) and is_positive_int(count) else None
        if None not in (theirs, quotient) and theirs != quotient:
            f.need("head_dim")
        return 1
    dim, rest = divmod(hidden, heads)
    if rest or (f.resolved is not None and theirs is not None and theirs != dim):
        f.need("head_dim")
        return 1
    return int(f.derive("head_dim", dim, "hidden_size / num_attention_heads"))


def kv_head_count(f: Fields) -> int:
    """``num_key_value_heads`` from the file; equal to ``num_attention_heads`` only for a
    configuration class that has no such field (multi-head attention by construction). The
    head count is read too: without it the pair cannot be checked (:func:`screen_values`)."""
    heads = f.int("num_attention_heads")
    lib = f.resolved if f.resolved and f.resolved.library else None
    if f.in_file("num_key_value_heads") or lib is None or "num_key_value_heads" in f.cfg:
        return f.int("num_key_value_heads")
    return int(f.derive("num_key_value_heads", heads, f"{lib.class_name} has no GQA field: MHA"))


def _kv_tokens(f: Fields, dt: Dtypes) -> tuple[tuple[TokenTensor, ...], str]:
    heads = kv_head_count(f)
    dim = attention_head_dim(f)
    keys = TokenTensor("keys", heads * dim, dt.kv)
    return (keys, TokenTensor("values", heads * dim, dt.kv)), f"K+V {heads}x{dim}"


def _attention_layer(f: Fields, index: int, dt: Dtypes) -> LayerSpec:
    if f.marker("kv_lora_rank") is not None:
        tokens, detail = _mla_tokens(f, dt)
        return LayerSpec(index, "mla", tokens=tokens, mixer="mla", detail=detail)
    tokens, detail = _kv_tokens(f, dt)
    return LayerSpec(index, "full", tokens=tokens, detail=detail)


def _mla_tokens(f: Fields, dt: Dtypes) -> tuple[tuple[TokenTensor, ...], str]:
    """One compressed latent per token: ``kv_lora_rank`` "keys" + ``qk_rope_head_dim`` "values"."""
    rank, rope = f.int("kv_lora_rank"), f.int("qk_rope_head_dim")
    tokens = (TokenTensor("keys", rank, dt.kv), TokenTensor("values", rope, dt.kv))
    return tokens, f"latent {rank}+{rope}"


def _indexed_layer(f: Fields, index: int, dt: Dtypes) -> LayerSpec:
    tokens, detail = _mla_tokens(f, dt)
    dim = f.int("index_head_dim")
    indexer = TokenTensor("indexer_keys", dim, dt.model)
    return LayerSpec(
        index, "mla", tokens=(*tokens, indexer), mixer="mla+indexer",
        detail=f"{detail} + indexer key {dim}",
    )  # fmt: skip


def _sliding_layer(f: Fields, index: int, name: str, dt: Dtypes) -> LayerSpec:
    tokens, detail = _kv_tokens(f, dt)
    key = "attention_chunk_size" if name == "chunked_attention" else "sliding_window"
    window = f.int(key)
    what = "chunk" if name == "chunked_attention" else "window"
    return LayerSpec(
        index, "sliding", tokens=tokens, window_tokens=window - 1, window=window,
        mixer="chunked" if name == "chunked_attention" else "sliding",
        detail=f"{detail}, {what} {window}",
    )  # fmt: skip


#: (mixer name, test on the config, sizing rule); the first whose test passes sizes the layer.
_StateRule = Callable[["Fields", "Dtypes"], tuple[tuple[StateTensor, ...], str]]


def _state_mixer(f: Fields, name: str, dt: Dtypes) -> tuple[str, tuple[StateTensor, ...], str]:
    for mixer, applies, rule in _MIXERS:
        if applies(f, name):
            states, detail = rule(f, dt)
            return mixer, states, detail
    f.problem(
        "layer_types", f"got {name!r} layers, expected a state mixer with a sizing rule (no sizing "
        "rule for this model's state mixer; known: short conv, Mamba-1, Mamba-2, Gated DeltaNet, "
        "KDA, lightning attention)",
    )  # fmt: skip
    return "unknown", (), "unknown mixer"


def _short_conv(f: Fields, dt: Dtypes) -> tuple[tuple[StateTensor, ...], str]:
    dim, kernel = f.int("conv_dim", "hidden_size"), f.int("conv_L_cache")
    return (StateTensor("conv", (dim, kernel), dt.model),), f"short conv {dim}x{kernel}"


def _gated_deltanet(f: Fields, dt: Dtypes) -> tuple[tuple[StateTensor, ...], str]:
    nk, nv = f.int("linear_num_key_heads"), f.int("linear_num_value_heads")
    dk, dv = f.int("linear_key_head_dim"), f.int("linear_value_head_dim")
    kernel = f.int("linear_conv_kernel_dim")
    conv_dim = 2 * nk * dk + nv * dv
    states = (
        StateTensor("conv", (conv_dim, kernel), dt.model),
        StateTensor("recurrent", (nv, dk, dv), dt.recurrent("gated_deltanet", f)),
    )
    return states, f"GatedDeltaNet conv {conv_dim}x{kernel} + state {nv}x{dk}x{dv}"


def _kda(f: Fields, dt: Dtypes) -> tuple[tuple[StateTensor, ...], str]:
    heads, dim = f.int("linear_num_heads"), f.int("linear_head_dim")
    kernel = f.int("linear_conv_kernel_dim", "short_conv_kernel_size")
    conv_dim = 3 * heads * dim  # q, k and v each pass a short convolution
    states = (
        StateTensor("conv", (conv_dim, kernel), dt.model),
        StateTensor("recurrent", (heads, dim, dim), dt.recurrent("kda", f)),
    )
    return states, f"KDA conv {conv_dim}x{kernel} + state {heads}x{dim}x{dim}"


def _lightning(f: Fields, dt: Dtypes) -> tuple[tuple[StateTensor, ...], str]:
    heads, dim = f.int("num_attention_heads"), attention_head_dim(f)
    state = StateTensor("recurrent", (heads, dim, dim), dt.recurrent("lightning", f))
    return (state,), f"lightning attention state {heads}x{dim}x{dim}"


def _mamba2_head_keys(f: Fields) -> tuple[str, ...]:
    keys = ("mamba_n_heads", "mamba_num_heads", "n_mamba_heads")
    return (*keys, "num_heads") if f.model_type == "mamba2" else keys


_MAMBA2_HEAD_DIM = ("mamba_d_head", "mamba_head_dim", "mamba_headdim")
_MAMBA2_GROUPS = ("mamba_n_groups", "n_groups", "mamba_ngroups", "mamba_num_groups")


def _is_mamba2(f: Fields) -> bool:
    """Mamba heads; not Zamba's, which split Mamba-1 channels (no head size, no groups)."""
    if f.model_type != "zamba":
        return f.marker(*_mamba2_head_keys(f)) is not None
    return f.marker(*_MAMBA2_HEAD_DIM, *_MAMBA2_GROUPS) is not None


def _mamba2(f: Fields, dt: Dtypes) -> tuple[tuple[StateTensor, ...], str]:
    heads = f.int(*_mamba2_head_keys(f))
    head = f.int("head_dim") if f.model_type == "mamba2" else f.int(*_MAMBA2_HEAD_DIM)
    d_state = f.int("mamba_d_state", "ssm_state_size", "state_size")
    groups = f.int(*_MAMBA2_GROUPS)
    kernel = f.int("mamba_d_conv", "conv_kernel")
    conv_dim = heads * head + 2 * groups * d_state
    states = (
        StateTensor("conv", (conv_dim, kernel), dt.model),
        StateTensor("recurrent", (heads, head, d_state), dt.recurrent("mamba2", f)),
    )
    return states, f"Mamba-2 conv {conv_dim}x{kernel} + ssm {heads}x{head}x{d_state}"


def _mamba1(f: Fields, dt: Dtypes) -> tuple[tuple[StateTensor, ...], str]:
    expand = f.optional("mamba_expand", "expand")
    hidden = f.int("hidden_size") if expand is not None else 0
    inner = int(expand * hidden) if expand is not None else f.int("intermediate_size")
    d_state = f.int("mamba_d_state", "state_size", "ssm_state_size")
    kernel = f.int("mamba_d_conv", "conv_kernel")
    heads = f.optional("n_mamba_heads")  # Zamba: one scan per head over inner / heads channels
    ssm = (inner, d_state) if heads is None else (heads, inner // f.int("n_mamba_heads"), d_state)
    states = (
        StateTensor("conv", (inner, kernel), dt.model),
        StateTensor("recurrent", ssm, dt.recurrent("mamba1", f)),
    )
    return states, f"Mamba conv {inner}x{kernel} + ssm {'x'.join(map(str, ssm))}"


_MIXERS: tuple[tuple[str, Callable[[Fields, str], bool], _StateRule], ...] = (
    ("short_conv", lambda f, n: n == "conv" or f.marker("conv_L_cache") is not None, _short_conv),
    ("gated_deltanet", lambda f, n: f.marker("linear_num_value_heads") is not None,
     _gated_deltanet),
    ("kda", lambda f, n: f.marker("linear_num_heads") is not None, _kda),
    ("lightning", lambda f, n: f.marker("linear_attn_alpha_factor") is not None, _lightning),
    ("mamba2", lambda f, n: _is_mamba2(f), _mamba2),
    ("mamba1", lambda f, n: f.marker("mamba_d_state", "state_size") is not None, _mamba1),
)  # fmt: skip


def _notes(f: Fields, layers: list[LayerSpec], types: list[str], dt: Dtypes) -> list[str]:
    notes: list[str] = []
    if any(la.mixer == "sliding" for la in layers):
        notes.append(
            "sliding layers keep sliding_window - 1 tokens in transformers (the next token's "
            "own K/V completes the window)"
        )
    if any(la.mixer == "chunked" for la in layers):
        notes.append(
            "chunked-attention layers are kept as transformers keeps them: the last "
            "attention_chunk_size - 1 tokens"
        )
    if any(la.kind == "mla" for la in layers):
        notes.append("MLA: one latent (kv_lora_rank + qk_rope_head_dim) per token per layer")
    if "dummy" in types:
        notes.append(f"{types.count('dummy')} layers reuse another layer's KV and hold none")
    if any(la.states for la in layers) and dt.state == "auto":
        notes.append(_state_note(layers, dt))
    resolved = f.resolved
    if resolved is not None:
        notes.extend(resolved.notes)
        notes.extend(f.notes())
        for key, why in sorted(resolved.dropped.items()):
            if key not in f.read:
                notes.append(f"field {key!r} ignored: the sizing does not read it and "
                             f"transformers rejects it ({one_line(why, 120)})")  # fmt: skip
    return notes


def _state_note(layers: list[LayerSpec], dt: Dtypes) -> str:
    seen = sorted({(s.name, s.dtype) for la in layers for s in la.states})
    parts = ", ".join(f"{name} {dtype}" for name, dtype in seen)
    return f"fixed states sized per tensor as {dt.engine} keeps them: {parts}"


def kind_of(layer_type: str) -> LayerKind:
    """The pdx layer kind a transformers layer-type name maps to (MLA not distinguished)."""
    if layer_type in _NO_CACHE:
        return "none"
    if layer_type in _SLIDING:
        return "sliding"
    if layer_type == "hybrid":
        return "hybrid"
    if layer_type in _STATEFUL:
        return "linear"
    return "full"


def head_dim(cfg: dict[str, Any], model_type: str) -> int:
    """``head_dim`` when the config sets it, else hidden_size / num_attention_heads."""
    f = Fields(cfg, model_type)
    dim = attention_head_dim(f)
    f.check()
    return dim
