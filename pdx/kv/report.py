"""``measure-kv`` as one library call: spec → requests → (empirical) → (codecs) → budget.

Only the analytic parts are imported at module level; torch and transformers are imported
when an empirical run or codec measurement is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdx.kv.budget import Budget, LinkParams, compute_budget
from pdx.kv.engines import VLLM_RULES, vllm_block_size, vllm_kv_bytes
from pdx.kv.source import ModelSource
from pdx.kv.spec import (
    KVSpec,
    build_spec,
    check_engine,
    check_seq,
    dtype_bytes,
    resolve_state_dtype,
)

TRANSFORMERS_RULES = (
    "transformers cache (DynamicCache): every tensor as the PyTorch model code holds it"
)

DEFAULT_SEQS = (1024, 8192, 32768)


@dataclass(frozen=True)
class MeasureOptions:
    """Everything ``measure-kv`` can be asked to do, already validated by the caller."""

    dtype: str = "bf16"
    state_dtype: str = "auto"
    seqs: tuple[int, ...] = DEFAULT_SEQS
    codecs: tuple[str, ...] = ()
    codec_seq: int = 256
    decode_tokens: int = 8
    empirical: bool = False
    empirical_seq: int = 64
    active_params: int | None = None
    link: LinkParams = field(default_factory=lambda: LinkParams(1.0, 100.0, 400.0))
    engine: str = "transformers"
    block_size: int | None = None
    device: str = "gpu"

    def __post_init__(self) -> None:
        dtype_bytes(self.dtype)
        resolve_state_dtype(self.state_dtype, self.dtype)
        check_engine(self.engine)
        vllm_block_size(self.block_size, self.device)
        for seq in self.seqs:
            check_seq(seq)


@dataclass(frozen=True)
class MeasureKVReport:
    """The ``measure-kv`` result; its JSON form is a public contract (see docs)."""

    model: str
    model_type: str
    dtype: str
    state_dtype: str
    kv_bytes_per_token: int
    sliding_bytes_per_token: int
    state_bytes_per_request: int
    params_total: int | None
    params_active: int | None
    layer_counts: dict[str, int]
    layers: list[dict[str, Any]]
    requests: list[dict[str, Any]]
    empirical: list[dict[str, Any]] | None
    codec_sample: dict[str, Any] | None
    codecs: list[dict[str, Any]]
    budget: Budget
    notes: list[str]
    engine: str = "transformers"
    engine_rules: str = ""
    block_size: int | None = None
    config_source: str | None = None
    state_dtypes: dict[str, str] = field(default_factory=dict)
    derived: dict[str, str] = field(default_factory=dict)
    overrides: dict[str, Any] = field(default_factory=dict)


def layer_rows(spec: KVSpec) -> list[dict[str, Any]]:
    """One JSON row per layer: kind and exact bytes."""
    return [
        {
            "index": la.index,
            "kind": la.kind,
            "bytes_per_token": la.bytes_per_token,
            "window_tokens": la.window_tokens,
            "state_bytes": la.state_bytes,
            "detail": la.detail,
            "mixer": la.mixer,
            "window": la.window,
            "tensors": [
                {"name": t.name, "elems_per_token": t.elems, "dtype": t.dtype} for t in la.tokens
            ],
            "states": [
                {"name": st.name, "shape": list(st.shape), "dtype": st.dtype, "bytes": st.nbytes}
                for st in la.states
            ],
        }
        for la in spec.layers
    ]


def request_rows(
    spec: KVSpec, seqs: tuple[int, ...], opts: MeasureOptions | None = None
) -> list[dict[str, Any]]:
    """Exact per-request bytes for each length, split by what holds them, for the engine."""
    rows: list[dict[str, Any]] = []
    for seq in seqs:
        check_seq(seq)
        if spec.engine == "vllm":
            rows.append(_vllm_row(spec, seq, opts or MeasureOptions(engine="vllm")))
            continue
        growing = sum(
            la.bytes_for(seq) - la.state_bytes
            for la in spec.layers
            if la.tokens and la.kind != "sliding"
        )
        sliding = sum(la.bytes_for(seq) for la in spec.layers if la.kind == "sliding")
        rows.append(
            {
                "seq": seq,
                "kv_bytes": spec.kv_bytes(seq),
                "growing_bytes": growing,
                "sliding_bytes": sliding,
                "state_bytes": spec.state_bytes_per_request,
            }
        )
    return rows


def _vllm_row(spec: KVSpec, seq: int, opts: MeasureOptions) -> dict[str, Any]:
    sizing = vllm_kv_bytes(spec, seq, opts.block_size, device=opts.device)
    return {
        "seq": seq,
        "kv_bytes": sizing.total_bytes,
        "growing_bytes": sizing.growing_bytes,
        "sliding_bytes": sizing.sliding_bytes,
        "state_bytes": sizing.state_bytes,
        "block_size": sizing.block_size,
        "attention_block_size": sizing.attention_block_size,
        "blocks": sum(la.blocks for la in sizing.layers),
        "state_page_bytes": sizing.state_page_bytes,
        "unpadded_state_bytes": sizing.unpadded_state_bytes,
    }


def engine_bytes(spec: KVSpec, opts: MeasureOptions) -> Any:
    """``seq -> bytes`` the chosen engine holds for one request."""
    if spec.engine != "vllm":
        return spec.kv_bytes
    return lambda seq: vllm_kv_bytes(spec, seq, opts.block_size, device=opts.device).total_bytes


def _empirical_rows(source: ModelSource, opts: MeasureOptions) -> list[dict[str, Any]]:
    from pdx.kv.empirical import empirical_row, measure_empirical

    lengths = sorted({min(seq, opts.empirical_seq) for seq in opts.seqs})
    rows = []
    for seq in lengths:
        result = measure_empirical(
            source.config,
            name=source.name,
            seq=seq,
            dtype=opts.dtype,
            state_dtype=opts.state_dtype,
            model_dir=source.model_dir,
        )
        rows.append(empirical_row(result))
    return rows


def _codec_rows(
    source: ModelSource, opts: MeasureOptions
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    if not opts.codecs:
        return None, []
    from pdx.kv.codec_eval import codec_rows, measure_codecs

    report = measure_codecs(
        source.config,
        names=list(opts.codecs),
        seq=opts.codec_seq,
        dtype=opts.dtype,
        decode_tokens=opts.decode_tokens,
        model_dir=source.model_dir,
    )
    return codec_rows(report)


def check_codecs(names: tuple[str, ...]) -> None:
    """Fail on unknown codec names before any model is built (loads the codec registry)."""
    if names and names != ("all",):
        from pdx.kv.codecs import get_codec

        for name in names:
            get_codec(name)


def measure_kv(source: ModelSource, opts: MeasureOptions) -> MeasureKVReport:
    """Run every part of ``measure-kv`` that ``opts`` asks for."""
    spec = build_spec(
        source.config,
        name=source.name,
        dtype=opts.dtype,
        state_dtype=opts.state_dtype,
        active_params=opts.active_params,
        engine=opts.engine,
        allow_torch=bool(opts.codecs) or opts.empirical,
    )
    requests = request_rows(spec, opts.seqs, opts)
    notes = list(spec.notes)
    if source.overrides:
        values = ", ".join(f"{k}={v!r}" for k, v in source.overrides.items())
        notes.insert(0, f"set with --set (not from the config file): {values}")
    block = None
    if spec.engine == "vllm":
        sizing = vllm_kv_bytes(spec, opts.seqs[0], opts.block_size, device=opts.device)
        block = sizing.block_size
        notes.extend(sizing.notes)
    empirical = _empirical_rows(source, opts) if opts.empirical else None
    sample, codecs = _codec_rows(source, opts)
    ratios = {row["name"]: row["ratio"] for row in codecs if row["name"] != "raw"}
    return MeasureKVReport(
        model=source.name,
        model_type=spec.model_type,
        dtype=spec.dtype,
        state_dtype=spec.state_dtype,
        kv_bytes_per_token=spec.kv_bytes_per_token,
        sliding_bytes_per_token=spec.sliding_bytes_per_token,
        state_bytes_per_request=spec.state_bytes_per_request,
        params_total=spec.params_total or None,
        params_active=spec.params_active or None,
        layer_counts=spec.kind_counts(),
        layers=layer_rows(spec),
        requests=requests,
        empirical=empirical,
        codec_sample=sample,
        codecs=codecs,
        budget=compute_budget(spec, list(opts.seqs), ratios, opts.link, engine_bytes(spec, opts)),
        notes=notes,
        engine=spec.engine,
        engine_rules=VLLM_RULES if spec.engine == "vllm" else TRANSFORMERS_RULES,
        block_size=block,
        config_source=spec.config_source,
        state_dtypes=spec.state_dtypes(),
        derived=spec.derived,
        overrides=dict(source.overrides),
    )
