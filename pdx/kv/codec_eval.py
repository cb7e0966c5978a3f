"""Measure each codec on real KV: size ratio, encode/decode speed, reconstruction error and the
accuracy cost of decoding from the reconstructed cache.

The KV comes from a forward pass of the model code: a checkpoint's weights when one is given,
else a small random-weight model of the same family that keeps the model's own head size.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdx.kv.codecs import KVCodec, Role, codec_names, get_codec
from pdx.kv.empirical import (
    build_model,
    cache_tensors,
    fits_as_is,
    load_checkpoint,
    prefill,
    quiet_transformers,
    tiny_config,
    torch_dtype,
    torch_threads,
)
from pdx.kv.families import text_config
from pdx.units import bytes_per_s_to_gbps


@dataclass(frozen=True)
class CodecResult:
    """One codec measured on one KV sample (throughput in Gbit/s of raw KV)."""

    name: str
    lossless: bool
    ratio: float
    encode_gbps: float
    decode_gbps: float
    max_error: float
    rel_error: float
    exact: bool
    token_agreement: float | None = None
    kl: float | None = None


@dataclass(frozen=True)
class CodecReport:
    """All codecs on one KV sample, and how that sample was produced."""

    kv_source: str
    run_dtype: str
    seq: int
    sample_bytes: int
    decode_tokens: int
    codecs: list[CodecResult] = field(default_factory=list)
    scaled: dict[str, list[Any]] = field(default_factory=dict)


def kv_sample(cache: Any, state_dtype: Any = None) -> list[tuple[Any, Role]]:
    """Every tensor of a cache with the role a codec should treat it as.

    ``state_dtype`` casts conv/recurrent states (transformers keeps recurrent states in
    float32) to the dtype they are sized and shipped in, so ratios match the budget's bytes.
    """
    out: list[tuple[Any, Role]] = []
    for layer in getattr(cache, "layers", []):
        parts = cache_tensors(layer)
        roles: tuple[Role, Role] = ("key", "value")
        out.extend(zip(parts["kv"], roles, strict=False))
        for t in parts["conv"] + parts["recurrent"]:
            out.append((t if state_dtype is None else t.to(state_dtype), "other"))
    return out


def _timed(fn: Any, repeats: int) -> tuple[Any, float]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return result, statistics.median(times)


def codec_stats(codec: KVCodec, sample: list[tuple[Any, Role]], repeats: int = 3) -> CodecResult:
    """Ratio, median encode/decode throughput and reconstruction error of one codec."""
    import torch

    raw = sum(int(t.numel()) * t.element_size() for t, _ in sample)
    blobs, enc_s = _timed(lambda: [codec.encode(t, role) for t, role in sample], repeats)
    outs, dec_s = _timed(lambda: [codec.decode(b) for b in blobs], repeats)
    err_sq = ref_sq = 0.0
    max_err = 0.0
    exact = True
    for (orig, _), back in zip(sample, outs, strict=True):
        exact = exact and bool(torch.equal(orig, back))
        diff = back.float() - orig.float()
        max_err = max(max_err, float(diff.abs().max()) if diff.numel() else 0.0)
        err_sq += float(diff.pow(2).sum())
        ref_sq += float(orig.float().pow(2).sum())
    return CodecResult(
        name=codec.name,
        lossless=codec.lossless,
        ratio=raw / max(sum(len(b) for b in blobs), 1),
        encode_gbps=bytes_per_s_to_gbps(raw / max(enc_s, 1e-9)),
        decode_gbps=bytes_per_s_to_gbps(raw / max(dec_s, 1e-9)),
        max_error=max_err,
        rel_error=(err_sq**0.5) / max(ref_sq**0.5, 1e-30),
        exact=exact,
    )


def roundtrip_cache(cache: Any, codec: KVCodec) -> Any:
    """A deep copy of ``cache`` whose every tensor went through ``codec`` and back."""
    clone = copy.deepcopy(cache)
    for layer in clone.layers:
        pairs: tuple[tuple[str, Role], ...] = (("keys", "key"), ("values", "value"))
        for name, role in pairs:
            tensor = getattr(layer, name, None)
            if tensor is not None and hasattr(tensor, "numel"):
                setattr(layer, name, codec.decode(codec.encode(tensor, role)))
        for name in ("conv_states", "recurrent_states"):
            states = getattr(layer, name, None)
            if isinstance(states, dict):
                for idx, tensor in states.items():
                    if tensor is not None:
                        states[idx] = codec.decode(codec.encode(tensor, "other"))
    return clone


def decode_logits(model: Any, cache: Any, tokens: list[int]) -> list[Any]:
    """Feed ``tokens`` one at a time after the prefill in ``cache``; next-token logits per step."""
    import torch

    steps = []
    with torch.inference_mode(), torch_threads(1):
        for tok in tokens:
            out = model(input_ids=torch.tensor([[tok]]), cache=cache, use_cache=True)
            steps.append(out.logits[0, -1].float())
    return steps


def greedy_reference(
    model: Any, cache: Any, first_logits: Any, n: int
) -> tuple[list[int], list[Any]]:
    """Greedy-decode ``n`` tokens from an uncompressed copy of ``cache``: (inputs, logits)."""
    import torch

    work = copy.deepcopy(cache)
    tokens = [int(first_logits[0, -1].argmax())]
    logits: list[Any] = []
    with torch.inference_mode(), torch_threads(1):
        for _ in range(n):
            out = model(input_ids=torch.tensor([[tokens[-1]]]), cache=work, use_cache=True)
            logits.append(out.logits[0, -1].float())
            tokens.append(int(logits[-1].argmax()))
    return tokens[:n], logits


def agreement_and_kl(ref: list[Any], got: list[Any]) -> tuple[float, float]:
    """Top-1 agreement and mean KL(ref || got) of next-token distributions."""
    import torch

    agree = sum(int(a.argmax() == b.argmax()) for a, b in zip(ref, got, strict=True))
    kls = []
    for a, b in zip(ref, got, strict=True):
        log_p, log_q = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
        kls.append(float((log_p.exp() * (log_p - log_q)).sum()))
    return agree / len(ref), statistics.fmean(kls)


def measure_codecs(
    config: dict[str, Any],
    *,
    names: list[str],
    seq: int = 512,
    dtype: str = "bf16",
    decode_tokens: int = 16,
    model_dir: Path | None = None,
    repeats: int = 3,
) -> CodecReport:
    """Every codec in ``names`` on the KV of one prefill, with its decode accuracy cost."""
    if names == ["all"]:
        names = codec_names()
    codecs = [get_codec(n) for n in names]  # unknown names fail before any model is built
    quiet_transformers()
    run_dtype = dtype if dtype in ("fp32", "bf16", "fp16") else "bf16"
    scaled: dict[str, list[Any]] = {}
    if model_dir is not None:
        model, source = load_checkpoint(model_dir, run_dtype), f"checkpoint {model_dir}"
    elif fits_as_is(config):
        cfg, model_type = text_config(config)
        model = build_model({**cfg, "model_type": model_type}, run_dtype)
        source = "random-weight model of exactly this config"
    else:
        small, scaled = tiny_config(config, head_dim=None)
        model = build_model(small, run_dtype)
        source = "random-weight model of the same family (own head_dim, scaled down)"
    with torch_threads(1):
        cache, logits = prefill(model, seq)
        sample = kv_sample(cache, state_dtype=torch_dtype(run_dtype))
        tokens, ref = greedy_reference(model, cache, logits, decode_tokens)
        results = []
        for codec in codecs:
            stats = codec_stats(codec, sample, repeats)
            if decode_tokens:
                got = decode_logits(model, roundtrip_cache(cache, codec), tokens)
                agree, kl = agreement_and_kl(ref, got)
                stats = _with_accuracy(stats, agree, kl)
            results.append(stats)
    return CodecReport(
        kv_source=source,
        run_dtype=run_dtype,
        seq=seq,
        sample_bytes=sum(int(t.numel()) * t.element_size() for t, _ in sample),
        decode_tokens=decode_tokens,
        codecs=results,
        scaled=scaled,
    )


def _with_accuracy(stats: CodecResult, agree: float, kl: float) -> CodecResult:
    from dataclasses import replace

    return replace(stats, token_agreement=agree, kl=kl)


def codec_rows(report: CodecReport) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(sample description, one JSON row per codec)."""
    sample = {
        "kv_source": report.kv_source,
        "run_dtype": report.run_dtype,
        "seq": report.seq,
        "sample_bytes": report.sample_bytes,
        "decode_tokens": report.decode_tokens,
        "scaled": report.scaled,
        "throughput_unit": "Gbit/s of raw KV, median of 3 passes, one CPU thread",
    }
    rows = [
        {
            "name": c.name,
            "lossless": c.lossless,
            "ratio": c.ratio,
            "encode_gbps": c.encode_gbps,
            "decode_gbps": c.decode_gbps,
            "max_error": c.max_error,
            "rel_error": c.rel_error,
            "exact": c.exact,
            "token_agreement": c.token_agreement,
            "kl": c.kl,
        }
        for c in report.codecs
    ]
    return sample, rows
