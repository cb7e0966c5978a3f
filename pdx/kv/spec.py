"""KV spec: what each layer of a model keeps per request, in bytes, computed from its config.

This module (and everything it imports) must stay free of torch/transformers: the analytic
path answers in milliseconds and runs on machines without a model runtime.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdx.errors import InputError
from pdx.kv.layers import DTYPE_BYTES, GROWING_KINDS, STATE_DTYPES, LayerKind, LayerSpec

if TYPE_CHECKING:
    from pdx.kv.hfconfig import ResolvedConfig

__all__ = ["DTYPE_BYTES", "STATE_DTYPES", "KVSpec", "LayerKind", "LayerSpec", "build_spec"]


@dataclass(frozen=True)
class KVSpec:
    """Per-layer KV description of one model at one KV dtype, as one engine keeps it."""

    model: str
    model_type: str
    dtype: str
    state_dtype: str
    layers: list[LayerSpec]
    params_total: int  # 0 when the config lacks a field the count needs (see notes)
    params_active: int
    notes: list[str] = field(default_factory=list)
    engine: str = "transformers"
    model_dtype: str = "bf16"
    config_source: str | None = None  # "transformers X.Y" or None (raw config fields)
    derived: dict[str, str] = field(default_factory=dict)  # field -> how it was derived

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes per token of the layers whose cache grows without bound (full, MLA, hybrid)."""
        return sum(la.bytes_per_token for la in self.layers if la.kind in GROWING_KINDS)

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

    def state_dtypes(self) -> dict[str, str]:
        """Element type of each kind of state tensor (``mixed`` when layers differ)."""
        seen: dict[str, set[str]] = {}
        for la in self.layers:
            for st in la.states:
                seen.setdefault(st.name, set()).add(st.dtype)
        return {k: v.pop() if len(v) == 1 else "mixed" for k, v in sorted(seen.items())}


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
    """``auto`` follows the model dtype (the KV dtype; bf16 for fp8 KV), else the given one."""
    if state_dtype not in STATE_DTYPES:
        raise InputError("--state-dtype", state_dtype, f"one of {', '.join(STATE_DTYPES)}")
    if state_dtype != "auto":
        return state_dtype
    return model_dtype_for(kv_dtype)


def model_dtype_for(kv_dtype: str) -> str:
    """The activation dtype a model runs in for a KV dtype (fp8 KV: the model runs in bf16)."""
    return "bf16" if kv_dtype == "fp8" else kv_dtype


def check_engine(engine: str) -> str:
    """``--engine``: transformers or vllm."""
    from pdx.kv.families import ENGINES

    if engine not in ENGINES:
        raise InputError("--engine", engine, f"one of {', '.join(ENGINES)}")
    return engine


def build_spec(
    config: dict[str, Any],
    *,
    name: str,
    dtype: str = "bf16",
    state_dtype: str = "auto",
    active_params: int | None = None,
    engine: str = "transformers",
    allow_torch: bool = False,
) -> KVSpec:
    """The KV spec of a model from its Hugging Face ``config.json`` contents.

    The config is read through transformers' configuration classes
    (:func:`pdx.kv.hfconfig.resolve_config`; ``allow_torch`` lets that happen in this process).
    ``state_dtype`` ``auto`` sizes each state tensor in the dtype ``engine`` keeps it in;
    any other value overrides the recurrent / SSM states (conv states stay in the model
    dtype). ``active_params`` overrides the per-token parameter count estimated from the config.
    """
    from pdx.errors import UnsupportedModelError
    from pdx.kv.families import Dtypes, classify_layers
    from pdx.kv.fields import FieldProblems
    from pdx.kv.params import count_params

    dtype_bytes(dtype)
    if state_dtype not in STATE_DTYPES:
        raise InputError("--state-dtype", state_dtype, f"one of {', '.join(STATE_DTYPES)}")
    check_engine(engine)
    model_dtype = model_dtype_for(dtype)
    resolved, invalid = read_config(config, allow_torch=allow_torch)
    dtypes = Dtypes(kv=dtype, model=model_dtype, state=state_dtype, engine=engine)
    try:
        classified = classify_layers(resolved, dtypes, invalid)
    except FieldProblems as exc:  # name the count's bad values too, in the same line
        extra = {k: v for k, v in param_problems(resolved).items() if k not in exc.problems}
        if not extra:
            raise
        raise FieldProblems({**exc.problems, **extra}, exc.missing, exc.needed_for) from None
    layers, notes = classified.layers, classified.notes
    try:
        total, active = count_params(resolved.text, resolved.model_type, resolved)
    except FieldProblems as exc:
        if exc.problems:  # a bad value is an error wherever it is read
            raise
        total = active = 0
        notes.append(f"parameter count unknown: {exc}; --active-params-b gives recompute times")
    except UnsupportedModelError as exc:  # KV sizes do not need it; recompute times do
        total = active = 0
        notes.append(f"parameter count unknown: {exc}; --active-params-b gives recompute times")
    if active_params is not None:
        active = active_params
        notes.append(f"active parameters set to {active_params:,} (--active-params-b)")
    spec = KVSpec(
        model=name,
        model_type=resolved.model_type,
        dtype=dtype,
        state_dtype=state_dtype,
        layers=layers,
        params_total=total,
        params_active=active,
        notes=notes,
        engine=engine,
        model_dtype=model_dtype,
        config_source=resolved.library,
        derived=classified.derived,
    )
    recurrent = spec.state_dtypes().get("recurrent")
    shown = recurrent or (model_dtype if state_dtype == "auto" else state_dtype)
    return dataclasses.replace(spec, state_dtype=shown)


def param_problems(resolved: ResolvedConfig) -> dict[str, str]:
    """Bad values among the fields the parameter count reads (best effort, for one error)."""
    from pdx.errors import PdxError
    from pdx.kv.fields import FieldProblems
    from pdx.kv.params import count_params

    try:
        count_params(resolved.text, resolved.model_type, resolved)
    except FieldProblems as exc:
        return exc.problems
    except (PdxError, TypeError, ValueError):
        pass
    return {}


def read_config(
    config: dict[str, Any], *, allow_torch: bool = False
) -> tuple[ResolvedConfig, dict[str, str]]:
    """The config as its configuration class reads it, and the bad values pdx found first.

    Integer fields the file sets are checked before transformers sees the file (a bad value
    is named once, in pdx's words, instead of being dropped or failing deep in the class);
    the class then reads the file without them, and ``raw_text`` keeps the file as written.
    """
    from pdx.kv.fields import screen_values
    from pdx.kv.hfconfig import (
        RejectedConfig,
        ResolvedConfig,
        blame,
        raw_text_config,
        resolve_config,
    )

    text, model_type = raw_text_config(config)
    invalid = screen_values(text)
    clean = copy.deepcopy(config)
    inner, _ = raw_text_config(clean)
    for key in invalid:
        inner.pop(key, None)
    try:
        resolved = resolve_config(clean, allow_torch=allow_torch)
    except RejectedConfig as exc:
        # Name the fields the class's message is about, in pdx's form, and read the file's
        # own fields for the rest, so the one error still names every missing field.
        suspects = [k for k in blame(text, exc.reason) if k not in invalid]
        got = ", ".join(repr(text[k]) for k in suspects)
        key = ", ".join(suspects) or "config"
        what = f"got {got}" if suspects else "got a file"
        invalid[key] = (
            f"{what}, expected what transformers accepts for model_type {exc.model_type!r} "
            f"({exc.reason})"
        )
        resolved = ResolvedConfig(model_type, dict(text), None, text)
    return dataclasses.replace(resolved, raw_text=text), invalid


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
