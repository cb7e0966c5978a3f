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
from pdx.kv.families import MLA, layer_types, text_config
from pdx.kv.spec import KVSpec, LayerSpec, build_spec

RunDtype = Literal["fp32", "bf16", "fp16"]
_TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_ELEM = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
MAX_TINY_LAYERS = 12

_MOE_COUNTS = ("n_routed_experts", "num_experts", "num_local_experts")
_DROP = ("quantization_config", "auto_map", "architectures", "_name_or_path", "use_mamba_kernels")


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

    @property
    def bytes(self) -> int:
        """All bytes this layer's cache holds."""
        return self.kv_bytes + self.conv_bytes + self.recurrent_bytes


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
    from pdx.kv.params import count_params

    cfg, model_type = text_config(config)
    return count_params(cfg, model_type)[0] <= RUN_AS_IS_MAX_PARAMS


def tiny_config(
    config: dict[str, Any], *, head_dim: int | None = 16
) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """A tiny config of the same family and layer pattern, and what changed ``{key: [old, new]}``.

    ``head_dim=None`` keeps the model's own head size (realistic K/V rows for codec tests).
    """
    cfg, model_type = text_config(config)
    kinds = layer_types(cfg, model_type)
    n = min(_first_all_kinds(kinds), MAX_TINY_LAYERS)
    new = {k: v for k, v in cfg.items() if k not in _DROP}
    new["model_type"] = model_type
    heads = 4
    dim = head_dim or _own_head_dim(cfg)
    updates: dict[str, Any] = {
        "num_hidden_layers": n,
        "num_attention_heads": heads,
        "hidden_size": heads * dim if head_dim is None else 64,
        "intermediate_size": 128,
        "vocab_size": 512,
        "num_key_value_heads": _tiny_kv_heads(cfg, heads),
    }
    if model_type in MLA:  # MLA sizes come from its own fields; head_dim is derived there
        updates["hidden_size"] = heads * 16 if head_dim else heads * 64
    elif cfg.get("head_dim") is not None or head_dim is None:
        updates["head_dim"] = dim
    updates.update(_family_updates(cfg, n, narrow=head_dim is not None))
    if "sliding" not in {_kind_of(k) for k in kinds[:n]}:
        updates.pop("sliding_window", None)
        updates.pop("attention_chunk_size", None)
    changed: dict[str, list[Any]] = {}
    for key, value in updates.items():
        if key in cfg or key in ("num_key_value_heads", "head_dim"):
            if cfg.get(key) != value:
                changed[key] = [_short(cfg.get(key)), _short(value)]
            new[key] = value
    return new, changed


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
    up.update({"mamba_d_state": 8, "mamba_dt_rank": 8, "query_pre_attn_scalar": 16})
    if isinstance(cfg.get("layer_types"), list):
        up["layer_types"] = cfg["layer_types"][:n]
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
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = AutoConfig.for_model(config["model_type"], **fields)
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


def cache_tensors(layer: Any) -> dict[str, list[Any]]:
    """The tensors one cache layer holds, by category: kv, conv, recurrent."""
    out: dict[str, list[Any]] = {"kv": [], "conv": [], "recurrent": []}
    for name in ("keys", "values"):
        tensor = getattr(layer, name, None)
        if tensor is not None and hasattr(tensor, "numel"):
            out["kv"].append(tensor)
    for name, cat in (("conv_states", "conv"), ("recurrent_states", "recurrent")):
        states = getattr(layer, name, None)
        if isinstance(states, dict):
            out[cat].extend(t for t in states.values() if t is not None)
    return out


def _nbytes(tensors: list[Any]) -> int:
    return sum(int(t.numel()) * int(t.element_size()) for t in tensors)


def _dtype(tensors: list[Any]) -> str | None:
    return str(tensors[0].dtype).removeprefix("torch.") if tensors else None


def count_layer(layer: Any, spec: LayerSpec, seq: int) -> LayerCount:
    """Bytes one cache layer holds, with the analytic bytes at the dtypes it actually holds."""
    parts = cache_tensors(layer)
    kv_t, conv_t, rec_t = parts["kv"], parts["conv"], parts["recurrent"]
    dtypes = {"kv": _dtype(kv_t), "conv": _dtype(conv_t), "recurrent": _dtype(rec_t)}

    def elem(cat: str, fallback: int) -> int:
        name = dtypes[cat]
        return _ELEM.get(name, fallback) if name else fallback

    analytic = (
        spec.tokens_kept(seq) * spec.kv_elems_per_token * elem("kv", spec.kv_elem_bytes)
        + spec.conv_elems * elem("conv", spec.state_elem_bytes)
        + spec.recurrent_elems * elem("recurrent", spec.state_elem_bytes)
    )
    tokens = int(kv_t[0].shape[-2]) if kv_t and kv_t[0].dim() >= 2 else 0
    return LayerCount(
        index=spec.index,
        kind=spec.kind,
        cache_layer=type(layer).__name__,
        tokens_held=tokens,
        kv_bytes=_nbytes(kv_t),
        conv_bytes=_nbytes(conv_t),
        recurrent_bytes=_nbytes(rec_t),
        dtypes=sorted({f"{k}:{v}" for k, v in dtypes.items() if v}),
        analytic_bytes=analytic,
    )


def count_cache(cache: Any, spec: KVSpec, seq: int) -> list[LayerCount]:
    """Per-layer counts of a transformers cache object against ``spec``."""
    layers = list(getattr(cache, "layers", []))
    if len(layers) != len(spec.layers):
        raise MeasurementError(
            f"the cache has {len(layers)} layers but the config describes {len(spec.layers)}"
        )
    return [count_layer(layer, ls, seq) for layer, ls in zip(layers, spec.layers, strict=True)]


def measure_empirical(
    config: dict[str, Any],
    *,
    name: str,
    seq: int,
    dtype: str = "bf16",
    state_dtype: str = "auto",
    model_dir: Path | None = None,
) -> EmpiricalResult:
    """Prefill ``seq`` tokens through the model code; compare its cache with the analytic spec."""
    quiet_transformers()
    run_dtype = dtype if dtype in _TORCH_DTYPES else "bf16"
    scaled: dict[str, list[Any]] = {}
    if model_dir is not None:
        run_cfg = text_config(config)[0]
        model = load_checkpoint(model_dir, run_dtype)
        how = f"checkpoint weights from {model_dir}"
    elif fits_as_is(config):
        run_cfg = dict(text_config(config)[0])
        run_cfg["model_type"] = text_config(config)[1]
        model = build_model(run_cfg, run_dtype)
        how = "random-weight model of exactly this config (small enough to run as is)"
    else:
        run_cfg, scaled = tiny_config(config)
        model = build_model(run_cfg, run_dtype)
        how = "tiny random-weight model of the same family and layer pattern (scaled down)"
    spec = build_spec(run_cfg, name=name, dtype=run_dtype, state_dtype=state_dtype)
    with torch_threads(1):
        cache, _ = prefill(model, seq)
    layers = count_cache(cache, spec, seq)
    empirical = sum(la.bytes for la in layers)
    analytic = sum(la.analytic_bytes for la in layers)
    notes = _dtype_notes(layers, spec, dtype, run_dtype)
    return EmpiricalResult(
        seq=seq,
        model_run=how,
        run_dtype=run_dtype,
        cache_class=type(cache).__name__,
        scaled=scaled,
        layers=layers,
        empirical_bytes=empirical,
        analytic_bytes=analytic,
        match=empirical == analytic and all(la.bytes == la.analytic_bytes for la in layers),
        run_spec=spec,
        notes=notes,
    )


def _dtype_notes(layers: list[LayerCount], spec: KVSpec, dtype: str, run_dtype: str) -> list[str]:
    notes = []
    if dtype != run_dtype:
        notes.append(f"{dtype} KV cannot run through the model code; ran in {run_dtype}")
    seen = sorted({d for la in layers for d in la.dtypes})
    if any(d.startswith("recurrent:float32") for d in seen) and spec.state_dtype != "fp32":
        notes.append(
            "the transformers PyTorch path keeps recurrent states in float32; analytic bytes use "
            f"the dtypes the cache holds ({', '.join(seen)}); --state-dtype fp32 sizes that"
        )
    return notes


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
                "dtypes": la.dtypes,
                "empirical_bytes": la.bytes,
                "analytic_bytes": la.analytic_bytes,
            }
            for la in result.layers
        ],
        "notes": result.notes,
    }
