"""Empirical KV size: run the real model code (transformers) and count the cache it returns.

Configs of up to 50 M parameters run as they are (random weights); larger ones are scaled
down to a tiny random-weight model of the same family and layer pattern (fewer layers,
narrow hidden size, smaller sliding windows);
the analytic figure is computed for exactly the configuration that ran, so the two must
agree to the byte. With a checkpoint directory the real weights are loaded and nothing is
scaled.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pdx.errors import MeasurementError
from pdx.kv.families import layer_types, text_config
from pdx.kv.hfconfig import resolve_config
from pdx.kv.spec import KVSpec, LayerSpec, build_spec

RunDtype = Literal["fp32", "bf16", "fp16"]
_TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
MAX_TINY_LAYERS = 12

_MOE_COUNTS = ("n_routed_experts", "num_experts", "num_local_experts")
_DROP = ("quantization_config", "auto_map", "architectures", "_name_or_path", "use_mamba_kernels")


@dataclass(frozen=True)
class TensorCount:
    """One tensor of the returned cache next to the analytic tensor it should be."""

    name: str
    shape: list[int]
    dtype: str
    nbytes: int
    analytic_shape: list[int]
    analytic_dtype: str
    analytic_bytes: int

    @property
    def match(self) -> bool:
        """Same element type and the same bytes (and, for states, the same shape)."""
        return (
            self.dtype == self.analytic_dtype
            and self.nbytes == self.analytic_bytes
            and self.shape == self.analytic_shape
        )


@dataclass(frozen=True)
class LayerCount:
    """What one layer of the returned cache holds, next to the analytic figure."""

    index: int
    kind: str
    cache_layer: str
    tokens_held: int
    kv_bytes: int
    conv_bytes: int
    recurrent_bytes: int
    dtypes: list[str]
    analytic_bytes: int
    tensors: list[TensorCount] = field(default_factory=list)
    other_bytes: int = 0
    counter_bytes: int = 0

    @property
    def bytes(self) -> int:
        """All bytes this layer's cache holds for the request (position counters aside)."""
        return self.kv_bytes + self.conv_bytes + self.recurrent_bytes + self.other_bytes

    @property
    def match(self) -> bool:
        """Every tensor matches its analytic counterpart, none is missing or extra."""
        return self.bytes == self.analytic_bytes and all(t.match for t in self.tensors)


@dataclass(frozen=True)
class EmpiricalResult:
    """Analytic vs empirical bytes of one prefill of ``seq`` tokens."""

    seq: int
    model_run: str
    run_dtype: str
    cache_class: str
    scaled: dict[str, list[Any]]
    layers: list[LayerCount]
    empirical_bytes: int
    analytic_bytes: int
    match: bool
    run_spec: KVSpec
    notes: list[str] = field(default_factory=list)


def _first_all_kinds(kinds: list[str]) -> int:
    """Smallest layer-prefix length that contains every kind present (at least 2)."""
    wanted, seen = set(kinds), set()
    for i, kind in enumerate(kinds):
        seen.add(kind)
        if seen == wanted:
            return max(i + 1, min(2, len(kinds)))
    return len(kinds)


#: Configs up to this many parameters run as they are; larger ones are scaled down.
RUN_AS_IS_MAX_PARAMS = 50_000_000


def fits_as_is(config: dict[str, Any]) -> bool:
    """Whether a random-weight model of ``config`` is small enough to build here unchanged."""
    from pdx.errors import UnsupportedModelError
    from pdx.kv.params import count_params

    resolved = resolve_config(config, allow_torch=True)
    cfg = resolved.text
    try:
        total = count_params(cfg, resolved.model_type)[0]
    except UnsupportedModelError:  # a family without a parameter formula: a rough bound
        hidden = int(cfg.get("hidden_size") or 0)
        layers = int(cfg.get("num_hidden_layers") or 0)
        total = 12 * hidden * hidden * layers + 2 * int(cfg.get("vocab_size") or 0) * hidden
    return total <= RUN_AS_IS_MAX_PARAMS


def _resolved_types(config: dict[str, Any]) -> tuple[list[str], dict[str, Any], str]:
    """Layer types, the filled-in text config, and the model_type transformers runs it as."""
    resolved = resolve_config(config, allow_torch=True)
    run_type = resolved.model_type if resolved.library else text_config(config)[1]
    return layer_types(resolved.text, resolved.model_type), resolved.text, run_type


def tiny_config(
    config: dict[str, Any], *, head_dim: int | None = 16
) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """A tiny config of the same family and layer pattern, and what changed ``{key: [old, new]}``.

    ``head_dim=None`` keeps the model's own head size (realistic K/V rows for codec tests).
    """
    cfg = text_config(config)[0]
    kinds, full, model_type = _resolved_types(config)  # e.g. Kimi K2's text runs as deepseek_v3
    n, shared = _tiny_layer_count(kinds)
    new = {k: v for k, v in cfg.items() if k not in _DROP}
    new["model_type"] = model_type
    heads = 4
    dim = head_dim or _own_head_dim(full)
    mla = full.get("kv_lora_rank") is not None
    updates: dict[str, Any] = {
        "num_hidden_layers": n,
        "num_attention_heads": heads,
        "hidden_size": heads * dim if head_dim is None else 64,
        "intermediate_size": 128,
        "vocab_size": 512,
        "num_key_value_heads": _tiny_kv_heads(full, heads),
    }
    if mla:  # MLA sizes come from its own fields; head_dim is derived there
        updates["hidden_size"] = heads * 16 if head_dim else heads * 64
    elif cfg.get("head_dim") is not None or head_dim is None:
        updates["head_dim"] = dim
    updates.update(_family_updates(cfg, n, narrow=head_dim is not None))
    updates.update(_state_updates(cfg, updates["hidden_size"]))
    updates.update(_per_layer_updates(cfg, n, int(full.get("num_hidden_layers") or n)))
    if shared:
        updates["num_kv_shared_layers"] = shared
    if "sliding" not in {_kind_of(k) for k in kinds[:n]}:
        updates.pop("sliding_window", None)
        updates.pop("attention_chunk_size", None)
    if isinstance(cfg.get("pad_token_id"), int) and cfg["pad_token_id"] >= updates["vocab_size"]:
        updates["pad_token_id"] = 0
    changed: dict[str, list[Any]] = {}
    for key, value in updates.items():
        # fields the config sets, and those transformers fills in that shape the model
        filled = key in full and key in _SCALED_DEFAULTS
        if key in cfg or filled or key in ("num_key_value_heads", "head_dim"):
            if cfg.get(key) != value:
                changed[key] = [_short(cfg.get(key)), _short(value)]
            new[key] = value
    return new, changed


#: Class defaults that are scaled down too when the config leaves them out.
_SCALED_DEFAULTS = (
    "vocab_size",
    "intermediate_size",
    "moe_intermediate_size",
    "n_routed_experts",
    "num_attention_heads",
    "first_k_dense_replace",
)


def _tiny_layer_count(kinds: list[str]) -> tuple[int, int]:
    """Layers of the tiny model and how many of them reuse another layer's KV."""
    own = [k for k in kinds if k != "dummy"]
    n = min(_first_all_kinds(own), MAX_TINY_LAYERS)
    if len(own) == len(kinds):
        return n, 0
    return n + 2, 2  # a KV-sharing model keeps two sharing layers at the end


def _state_updates(cfg: dict[str, Any], hidden: int) -> dict[str, Any]:
    """Narrow SSM / convolution fields consistently (heads x head size = expand x hidden)."""
    up: dict[str, Any] = {}
    heads = 4
    head = 2 * hidden // heads
    for key in ("mamba_n_heads", "mamba_num_heads", "n_mamba_heads"):
        up[key] = heads
    for key in ("mamba_d_head", "mamba_head_dim", "mamba_headdim"):
        up[key] = head
    up["mamba_d_ssm"] = heads * head
    for key in ("mamba_d_state", "ssm_state_size", "state_size"):
        up[key] = 8
    for key in ("mamba_n_groups", "n_groups", "mamba_ngroups", "mamba_num_groups"):
        up[key] = 1 if cfg.get(key) == 1 else 2
    for key in ("mamba_chunk_size", "chunk_size"):
        up[key] = 16
    up.update({"attention_hidden_size": 2 * hidden, "attention_head_dim": 2 * hidden // heads})
    up.update({"conv_dim": hidden, "conv_dim_out": hidden, "block_dim": hidden})
    up.update({"block_ff_dim": 128, "intermediate_size_mlp": 128})
    up.update({"linear_num_heads": 4, "linear_head_dim": 16})
    up.update({"index_head_dim": 16, "index_n_heads": 2, "index_topk": 8})
    up.update({"laurel_rank": 4, "hidden_size_per_layer_input": 8})
    up["vocab_size_per_layer_input"] = 512
    return up


_INDEX_LISTS = ("full_attn_idxs", "attn_layer_indices", "hybrid_layer_ids", "moe_layers")


def _per_layer_updates(cfg: dict[str, Any], n: int, n_full: int) -> dict[str, Any]:
    """Per-layer lists cut to the first ``n`` layers; layer-index lists keep indices below n."""
    up: dict[str, Any] = {}
    for key, value in cfg.items():
        if key in _INDEX_LISTS and isinstance(value, list):
            up[key] = [i for i in value if isinstance(i, int) and i < n]
        elif isinstance(value, list) and len(value) == n_full and n_full > 1:
            cut = value[:n]
            up[key] = [128] * n if key == "intermediate_size" else cut
        elif key == "hybrid_override_pattern" and isinstance(value, str):
            up[key] = value[:n]
    return up


def _kind_of(layer_type: str) -> str:
    return "sliding" if layer_type in ("sliding_attention", "chunked_attention") else layer_type


def _short(value: Any) -> Any:
    return f"{len(value)} entries" if isinstance(value, list) else value


def _own_head_dim(cfg: dict[str, Any]) -> int:
    if cfg.get("head_dim"):
        return int(cfg["head_dim"])
    return int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])


def _tiny_kv_heads(cfg: dict[str, Any], heads: int) -> int:
    kv = cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    if kv == cfg.get("num_attention_heads"):
        return heads  # MHA stays MHA (MLA checks this too)
    return 1 if kv == 1 else 2


def _family_updates(cfg: dict[str, Any], n: int, narrow: bool) -> dict[str, Any]:
    up: dict[str, Any] = {"sliding_window": 16, "attention_chunk_size": 16}
    up.update({key: 4 for key in _MOE_COUNTS})
    up.update({"num_experts_per_tok": 2, "experts_per_token": 2, "moe_intermediate_size": 32})
    up.update({"shared_expert_intermediate_size": 32, "n_group": 1, "topk_group": 1})
    up["first_k_dense_replace"] = min(int(cfg.get("first_k_dense_replace", 0)), 1)
    if narrow:  # otherwise MLA keeps its own latent and head sizes
        up.update({"kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8})
        up["v_head_dim"] = 16
    if cfg.get("q_lora_rank"):
        up["q_lora_rank"] = 16
    up.update({"linear_num_key_heads": 2, "linear_num_value_heads": 4})
    up.update({"linear_key_head_dim": 16, "linear_value_head_dim": 16})
    up.update({"mamba_dt_rank": 8, "query_pre_attn_scalar": 16})
    if isinstance(cfg.get("mlp_only_layers"), list):
        up["mlp_only_layers"] = [i for i in cfg["mlp_only_layers"] if i < n]
    if cfg.get("use_sliding_window"):
        up["max_window_layers"] = min(int(cfg.get("max_window_layers", 1)), 1)
    if cfg.get("sliding_window") is None:
        del up["sliding_window"]
    return up


def torch_dtype(dtype: str) -> Any:
    """``"bf16"`` → ``torch.bfloat16`` (fp32 / bf16 / fp16 only)."""
    import torch

    return getattr(torch, _TORCH_DTYPES[dtype])


def build_model(config: dict[str, Any], dtype: str) -> Any:
    """A random-weight causal LM of ``config`` (a text config dict with model_type)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pdx.kv.hfconfig import build_hf_config

    hf_config, _ = build_hf_config(config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=getattr(torch, _TORCH_DTYPES[dtype]))
    return model.eval()


def load_checkpoint(model_dir: Path, dtype: str) -> Any:
    """A local checkpoint's weights (no downloads)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, _TORCH_DTYPES[dtype]), local_files_only=True
        )
    except (OSError, ValueError) as exc:
        raise MeasurementError(f"cannot load checkpoint {model_dir}: {exc}") from None
    return model.eval()


def prefill(model: Any, seq: int, seed: int = 0) -> tuple[Any, Any]:
    """Run one forward pass over ``seq`` random token ids; returns (cache, logits)."""
    import torch

    vocab = int(model.config.get_text_config().vocab_size)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, seq), generator=gen)
    with torch.inference_mode(), torch_threads(1):
        out = model(input_ids=ids, use_cache=True)
    cache = out.get("cache", None) or out.get("past_key_values", None)
    if cache is None:
        raise MeasurementError(f"{type(model).__name__} returned no cache object")
    return cache, out.logits


@contextmanager
def torch_threads(count: int = 1) -> Iterator[None]:
    """Run torch on ``count`` threads: tiny models on a shared, busy CPU run far faster on one."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def quiet_transformers() -> None:
    """Silence transformers' fallback-kernel notices (they go to stderr on every run)."""
    from transformers.utils import logging

    logging.set_verbosity_error()


def cache_tensors(layer: Any, extra_state: Any = None) -> dict[str, list[Any]]:
    """The tensors one cache layer holds, by category: kv, conv, recurrent, counter, other.

    ``kv`` holds every tensor that grows with the sequence (keys, values, indexer keys);
    ``counter`` the position counters; ``other`` any tensor no analytic rule accounts for
    (see :func:`named_tensors`).
    """
    out: dict[str, list[Any]] = {k: [] for k in ("kv", "conv", "recurrent", "counter", "other")}
    for name, tensor in named_tensors(layer, extra_state):
        out[_category(name)].append(tensor)
    return out


#: Cache-layer attributes whose tensors grow with the sequence, by analytic name.
_TOKEN_ATTRS = ("keys", "values", "indexer_keys")
#: Cache-layer attributes holding fixed states, and the analytic name of each.
_STATE_ATTRS = {"conv_states": "conv", "recurrent_states": "recurrent"}
#: Cache-object attributes that keep a per-layer state outside the layers (MiniMax's
#: lightning-attention state), listed by layer index.
_OUTSIDE_LAYERS = ("linear_cache",)
_WALK_DEPTH = 4


def named_tensors(layer: Any, extra_state: Any = None) -> list[tuple[str, Any]]:
    """``(name, tensor)`` for every tensor a cache layer holds, found by walking its attributes.

    Known attributes take their analytic names (``keys``, ``values``, ``indexer_keys``,
    ``conv``, ``recurrent``); a 0-dim integer tensor is a position ``counter`` (one per cache
    layer whatever the batch, not per-request state); any other tensor keeps its attribute
    path, so it shows as unaccounted instead of being skipped. ``extra_state`` is a state the
    cache object keeps outside its layers for this layer (MiniMax's lightning state).
    """
    out, seen = [], set()
    for attr, value in vars(layer).items():
        for path, tensor in walk_tensors(value, attr):
            if id(tensor) not in seen:  # a tensor reachable twice is held once
                seen.add(id(tensor))
                out.append((_tensor_name(attr, path, tensor), tensor))
    for _path, tensor in walk_tensors(extra_state, "linear_cache"):
        out.append(("counter" if _is_counter(tensor) else "recurrent", tensor))
    rank = {name: i for i, name in enumerate((*_TOKEN_ATTRS, "conv", "recurrent"))}
    return sorted(out, key=lambda item: rank.get(item[0], len(rank)))


def walk_tensors(value: Any, path: str, depth: int = 0) -> list[tuple[str, Any]]:
    """Every non-empty tensor inside ``value`` (containers and plain objects, a few levels
    deep), with the attribute path that reaches it."""
    if hasattr(value, "element_size") and hasattr(value, "numel"):
        return [(path, value)] if value.numel() else []
    if depth >= _WALK_DEPTH or value is None or isinstance(value, str | int | float | bool):
        return []
    if isinstance(value, dict):
        items = [(f"{path}[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, list | tuple):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    elif hasattr(value, "__dict__") and not _is_config(value):
        items = [(f"{path}.{k}", v) for k, v in vars(value).items()]
    else:
        return []
    return [found for sub, v in items for found in walk_tensors(v, sub, depth + 1)]


def _is_config(value: Any) -> bool:
    """A configuration object a cache layer may keep (it holds no cache tensors)."""
    return hasattr(value, "to_dict") and hasattr(value, "model_type")


def _is_counter(tensor: Any) -> bool:
    return tensor.dim() == 0 and not tensor.is_floating_point()


def _tensor_name(attr: str, path: str, tensor: Any) -> str:
    if attr in _TOKEN_ATTRS and path == attr:
        return attr
    if attr in _STATE_ATTRS:
        return _STATE_ATTRS[attr]
    return "counter" if _is_counter(tensor) else path


def _category(name: str) -> str:
    if name in _TOKEN_ATTRS:
        return "kv"
    return name if name in ("conv", "recurrent", "counter") else "other"


def _nbytes(tensors: list[Any]) -> int:
    return sum(int(t.numel()) * int(t.element_size()) for t in tensors)


def _torch_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _dtype(tensor: Any) -> str:
    name = str(tensor.dtype).removeprefix("torch.")
    return _PDX_DTYPE.get(name, name)


_PDX_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8"}


def _tensor_counts(named: list[tuple[str, Any]], spec: LayerSpec, seq: int) -> list[TensorCount]:
    kept = spec.tokens_kept(seq)
    expected: list[tuple[str, list[int], str, int]] = [
        (t.name, [kept, t.elems], t.dtype, kept * t.bytes_per_token) for t in spec.tokens
    ]
    expected += [(s.name, list(s.shape), s.dtype, s.nbytes) for s in spec.states]
    counts = []
    for name, tensor in named:
        if name == "counter":
            continue
        match = next((e for e in expected if e[0] == name), None)
        if match is not None:
            expected.remove(match)
        shape = _shape_of(name, tensor)
        counts.append(
            TensorCount(
                name=name,
                shape=shape,
                dtype=_dtype(tensor),
                nbytes=int(tensor.numel()) * int(tensor.element_size()),
                analytic_shape=match[1] if match else [],
                analytic_dtype=match[2] if match else "-",
                analytic_bytes=match[3] if match else 0,
            )
        )
    counts += [TensorCount(n, [], "-", 0, shp, dt, nb) for n, shp, dt, nb in expected]
    return counts


def _shape_of(name: str, tensor: Any) -> list[int]:
    """States: the shape without the batch; growing tensors: [tokens, elements per token]."""
    dims = [int(d) for d in tensor.shape]
    if name in ("conv", "recurrent"):
        return dims[1:]
    if name not in _TOKEN_ATTRS:
        return dims
    tokens = dims[-2] if len(dims) >= 2 else 0
    return [tokens, int(tensor.numel()) // max(tokens, 1)]


def count_layer(layer: Any, spec: LayerSpec, seq: int, extra_state: Any = None) -> LayerCount:
    """Bytes one cache layer holds, tensor by tensor, against the analytic layer."""
    named = named_tensors(layer, extra_state)
    parts = cache_tensors(layer, extra_state)
    kv_t = parts["kv"]
    tokens = int(kv_t[0].shape[-2]) if kv_t and kv_t[0].dim() >= 2 else 0
    return LayerCount(
        index=spec.index,
        kind=spec.kind,
        cache_layer=type(layer).__name__,
        tokens_held=tokens,
        kv_bytes=_nbytes(kv_t),
        conv_bytes=_nbytes(parts["conv"]),
        recurrent_bytes=_nbytes(parts["recurrent"]),
        dtypes=sorted({f"{_category(n)}:{_torch_name(t)}" for n, t in named if n != "counter"}),
        analytic_bytes=spec.bytes_for(seq),
        tensors=_tensor_counts(named, spec, seq),
        other_bytes=_nbytes(parts["other"]),
        counter_bytes=_nbytes(parts["counter"]),
    )


def count_cache(cache: Any, spec: KVSpec, seq: int) -> list[LayerCount]:
    """Per-layer counts of a transformers cache object against ``spec``.

    Every tensor the cache object holds is attributed to a layer; one outside its layers
    that is not a position counter is an error naming it.
    """
    layers = list(getattr(cache, "layers", []))
    if len(layers) != len(spec.layers):
        raise MeasurementError(
            f"the cache has {len(layers)} layers but the config describes {len(spec.layers)}"
        )
    loose = [
        path
        for attr, value in vars(cache).items()
        if attr != "layers" and attr not in _OUTSIDE_LAYERS
        for path, tensor in walk_tensors(value, attr)
        if not _is_counter(tensor)
    ]
    if loose:
        raise MeasurementError(
            f"{type(cache).__name__} holds tensors outside its layers: {', '.join(loose[:5])}"
        )
    extra = [v for attr in _OUTSIDE_LAYERS for v in (getattr(cache, attr, None) or [])]
    extra += [None] * (len(layers) - len(extra))
    return [
        count_layer(layer, ls, seq, state)
        for layer, ls, state in zip(layers, spec.layers, extra, strict=True)
    ]


def mismatches(layers: list[LayerCount]) -> list[str]:
    """One line per tensor whose bytes, dtype or shape differ from the analytic figure."""
    out = []
    for la in layers:
        for t in la.tensors:
            if not t.match:
                out.append(
                    f"layer {la.index} {t.name}: cache {t.dtype} {t.shape} {t.nbytes:,} B, "
                    f"analytic {t.analytic_dtype} {t.analytic_shape} {t.analytic_bytes:,} B"
                )
    return out


def measure_empirical(
    config: dict[str, Any],
    *,
    name: str,
    seq: int,
    dtype: str = "bf16",
    state_dtype: str = "auto",
    model_dir: Path | None = None,
) -> EmpiricalResult:
    """Prefill ``seq`` tokens through the model code; compare its cache with the analytic spec.

    The analytic side is the transformers engine's layout at the dtype the model ran in, so
    every tensor must agree to the byte; ``state_dtype`` only adds a note when it differs.
    """
    quiet_transformers()
    run_dtype = dtype if dtype in _TORCH_DTYPES else "bf16"
    scaled: dict[str, list[Any]] = {}
    text, model_type = text_config(config)
    if model_dir is not None:
        run_cfg = {**text, "model_type": model_type}
        model = load_checkpoint(model_dir, run_dtype)
        how = f"checkpoint weights from {model_dir}"
    elif fits_as_is(config):
        run_cfg = {**text, "model_type": model_type}
        model = build_model(run_cfg, run_dtype)
        how = "random-weight model of exactly this config (small enough to run as is)"
    else:
        run_cfg, scaled = tiny_config(config)
        model = build_model(run_cfg, run_dtype)
        how = "tiny random-weight model of the same family and layer pattern (scaled down)"
    spec = build_spec(run_cfg, name=name, dtype=run_dtype, allow_torch=True)
    with torch_threads(1):
        cache, _ = prefill(model, seq)
    layers = count_cache(cache, spec, seq)
    empirical = sum(la.bytes for la in layers)
    analytic = sum(la.analytic_bytes for la in layers)
    notes = _dtype_notes(layers, dtype, run_dtype, state_dtype) + _counter_notes(layers)
    return EmpiricalResult(
        seq=seq,
        model_run=how,
        run_dtype=run_dtype,
        cache_class=type(cache).__name__,
        scaled=scaled,
        layers=layers,
        empirical_bytes=empirical,
        analytic_bytes=analytic,
        match=empirical == analytic and all(la.match for la in layers),
        run_spec=spec,
        notes=notes,
    )


def _dtype_notes(
    layers: list[LayerCount], dtype: str, run_dtype: str, state_dtype: str
) -> list[str]:
    notes = []
    if dtype != run_dtype:
        notes.append(f"{dtype} KV cannot run through the model code; ran in {run_dtype}")
    seen = sorted({d for la in layers for d in la.dtypes if d.split(":")[0] in _STATE_NAMES})
    if seen:
        notes.append(
            f"state tensors as the transformers cache holds them ({', '.join(seen)}), compared "
            "tensor by tensor with the analytic transformers layout"
        )
        if state_dtype != "auto":
            notes.append(f"--state-dtype {state_dtype} applies to the analytic sizing only")
    return notes


_STATE_NAMES = ("conv", "recurrent")


def _counter_notes(layers: list[LayerCount]) -> list[str]:
    counted = [la for la in layers if la.counter_bytes]
    if not counted:
        return []
    total = sum(la.counter_bytes for la in counted)
    return [
        f"{len(counted)} cache layers also keep a position counter (0-dim integer tensors, "
        f"{total:,} B in all): one per layer whatever the batch, bookkeeping rather than "
        "request state, so not counted on either side"
    ]


def empirical_row(result: EmpiricalResult) -> dict[str, Any]:
    """The JSON form of one empirical comparison."""
    return {
        "seq": result.seq,
        "model_run": result.model_run,
        "run_dtype": result.run_dtype,
        "cache_class": result.cache_class,
        "scaled": result.scaled,
        "empirical_bytes": result.empirical_bytes,
        "analytic_bytes": result.analytic_bytes,
        "match": result.match,
        "run_kv_bytes_per_token": result.run_spec.kv_bytes_per_token,
        "run_state_bytes_per_request": result.run_spec.state_bytes_per_request,
        "layers": [
            {
                "index": la.index,
                "kind": la.kind,
                "cache_layer": la.cache_layer,
                "tokens_held": la.tokens_held,
                "kv_bytes": la.kv_bytes,
                "conv_bytes": la.conv_bytes,
                "recurrent_bytes": la.recurrent_bytes,
                "other_bytes": la.other_bytes,
                "counter_bytes": la.counter_bytes,
                "dtypes": la.dtypes,
                "empirical_bytes": la.bytes,
                "analytic_bytes": la.analytic_bytes,
                "match": la.match,
                "tensors": [
                    {
                        "name": t.name,
                        "shape": t.shape,
                        "dtype": t.dtype,
                        "bytes": t.nbytes,
                        "analytic_shape": t.analytic_shape,
                        "analytic_dtype": t.analytic_dtype,
                        "analytic_bytes": t.analytic_bytes,
                        "match": t.match,
                    }
                    for t in la.tensors
                ],
            }
            for la in result.layers
        ],
        "mismatches": mismatches(result.layers),
        "notes": result.notes,
    }
