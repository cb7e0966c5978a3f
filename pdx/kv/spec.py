"""KV spec: what each layer of a model keeps per request, in bytes, computed from its config.

This module (and everything it imports) must stay free of torch/transformers: the analytic
path answers in milliseconds and runs on machines without a model runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdx.errors import InputError
from pdx.kv.layers import DTYPE_BYTES, STATE_DTYPES, LayerKind, LayerSpec

__all__ = ["DTYPE_BYTES", "STATE_DTYPES", "KVSpec", "LayerKind", "LayerSpec", "build_spec"]


@dataclass(frozen=True)
class KVSpec:
    """Per-layer KV description of one model at one KV dtype."""

    model: str
    model_type: str
    dtype: str
    state_dtype: str
    layers: list[LayerSpec]
    params_total: int  # 0 when the config lacks a field the count needs (see notes)
    params_active: int
    notes: list[str] = field(default_factory=list)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes per token of the layers whose cache grows without bound (full attention, MLA)."""
        return sum(la.bytes_per_token for la in self.layers if la.kind in ("full", "mla"))

    @property
    def sliding_bytes_per_token(self) -> int:
        """Bytes per token of sliding-window layers while the sequence is shorter than a window."""
        return sum(la.bytes_per_token for la in self.layers if la.kind == "sliding")

    @property
    def state_bytes_per_request(self) -> int:
        """Fixed-size state (linear attention / SSM) per request, independent of length."""
        return sum(la.state_bytes for la in self.layers)

    def kv_bytes(self, seq: int) -> int:
        """Exact bytes one request of ``seq`` tokens holds: growing + capped sliding + states."""
        check_seq(seq)
        return sum(la.bytes_for(seq) for la in self.layers)

    def kind_counts(self) -> dict[str, int]:
        """How many layers of each kind (only kinds present)."""
        counts: dict[str, int] = {}
        for la in self.layers:
            counts[la.kind] = counts.get(la.kind, 0) + 1
        return counts


def check_seq(seq: int) -> int:
    """Validate one sequence length (a positive integer)."""
    if isinstance(seq, bool) or not isinstance(seq, int) or seq <= 0:
        raise InputError("seq", seq, "a positive integer number of tokens")
    return seq


def parse_seq_list(text: str) -> list[int]:
    """``"1024,8192"`` → ``[1024, 8192]``; accepts ``k`` suffixes (``32k`` = 32768)."""
    out: list[int] = []
    for part in text.split(","):
        token = part.strip().lower()
        try:
            value = int(token[:-1]) * 1024 if token.endswith("k") else int(token)
        except ValueError:
            raise InputError("--seq", part.strip(), "comma-separated positive integers") from None
        if value <= 0:
            raise InputError("--seq", part.strip(), "comma-separated positive integers")
        out.append(value)
    if not out:
        raise InputError("--seq", text, "at least one sequence length")
    return out


def dtype_bytes(dtype: str, field_name: str = "--dtype") -> int:
    """Bytes per element of a KV dtype name; unknown names are an InputError."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise InputError(field_name, dtype, f"one of {', '.join(DTYPE_BYTES)}") from None


def resolve_state_dtype(state_dtype: str, kv_dtype: str) -> str:
    """``auto`` follows the KV dtype, except that fp8 KV keeps states in bf16."""
    if state_dtype not in STATE_DTYPES:
        raise InputError("--state-dtype", state_dtype, f"one of {', '.join(STATE_DTYPES)}")
    if state_dtype != "auto":
        return state_dtype
    return "bf16" if kv_dtype == "fp8" else kv_dtype


def build_spec(
    config: dict[str, Any],
    *,
    name: str,
    dtype: str = "bf16",
    state_dtype: str = "auto",
    active_params: int | None = None,
) -> KVSpec:
    """The KV spec of a model from its Hugging Face ``config.json`` contents.

    ``active_params`` overrides the per-token parameter count estimated from the config.
    """
    from pdx.errors import UnsupportedModelError
    from pdx.kv.families import classify_layers, text_config
    from pdx.kv.params import count_params

    kv_bytes = dtype_bytes(dtype)
    state = resolve_state_dtype(state_dtype, dtype)
    cfg, model_type = text_config(config)
    layers, notes = classify_layers(cfg, model_type, kv_bytes, DTYPE_BYTES[state])
    try:
        total, active = count_params(cfg, model_type)
    except UnsupportedModelError as exc:  # KV sizes do not need it; recompute times do
        total = active = 0
        notes.append(f"parameter count unknown ({exc}); --active-params-b gives recompute times")
    if active_params is not None:
        active = active_params
        notes.append(f"active parameters set to {active_params:,} (--active-params-b)")
    return KVSpec(
        model=name,
        model_type=model_type,
        dtype=dtype,
        state_dtype=state,
        layers=layers,
        params_total=total,
        params_active=active,
        notes=notes,
    )


def check_positive(field_name: str, value: int, *, allow_zero: bool = False) -> int:
    """An integer option that must be > 0 (or >= 0)."""
    low_ok = value >= 0 if allow_zero else value > 0
    if isinstance(value, bool) or not isinstance(value, int) or not low_ok:
        expected = "an integer >= 0" if allow_zero else "a positive integer"
        raise InputError(field_name, value, expected)
    return value


def parse_codec_list(text: str) -> list[str]:
    """``all`` → ``["all"]`` (expanded by the codec registry), ``none`` → ``[]``, else names."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise InputError("--codecs", text, "'all', 'none' or comma-separated codec names")
    if names == ["none"]:
        return []
    if ("all" in names or "none" in names) and names != ["all"]:
        raise InputError("--codecs", text, "'all' or 'none' alone, or codec names")
    return names


def billions(field_name: str, value: float | None) -> int | None:
    """A positive count given in billions (``--active-params-b 37``) → an int, or None."""
    if value is None:
        return None
    if not value > 0:
        raise InputError(field_name, value, "a positive number of billions")
    return round(value * 1e9)
