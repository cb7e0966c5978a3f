"""Accuracy cost: decode from a reconstructed cache and compare with the uncompressed run."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from pdx.kv.codec_eval import (
    agreement_and_kl,
    decode_logits,
    greedy_reference,
    measure_codecs,
    roundtrip_cache,
)
from pdx.kv.codecs import KVCodec, Role
from pdx.kv.codecs.raw import RawCodec
from pdx.kv.empirical import build_model, prefill, tiny_config
from pdx.kv.source import load_preset


class ZeroValues(KVCodec):
    """A deliberately broken codec (test only): values come back as zeros."""

    name = "test-zero-values"
    lossless = False

    def __init__(self) -> None:
        self._raw = RawCodec()
        self._role: list[Role] = []

    def encode(self, x: torch.Tensor, role: Role = "value") -> bytes:
        self._role.append(role)
        return self._raw.encode(x, role)

    def decode(self, data: bytes | memoryview) -> torch.Tensor:
        x = self._raw.decode(data)
        return torch.zeros_like(x) if self._role.pop(0) == "value" else x


@pytest.fixture(scope="module")
def tiny_llama() -> tuple[Any, Any, Any]:
    small, _ = tiny_config(load_preset("llama-3.1-8b").config)
    model = build_model(small, "fp32")
    cache, logits = prefill(model, 32)
    return model, cache, logits


def test_lossless_codec_reproduces_the_run_exactly(tiny_llama) -> None:
    model, cache, logits = tiny_llama
    tokens, ref = greedy_reference(model, cache, logits, 6)
    got = decode_logits(model, roundtrip_cache(cache, RawCodec()), tokens)
    agree, kl = agreement_and_kl(ref, got)
    assert agree == 1.0 and kl == pytest.approx(0.0, abs=1e-9)


def test_broken_cache_is_detected(tiny_llama) -> None:
    model, cache, logits = tiny_llama
    tokens, ref = greedy_reference(model, cache, logits, 6)
    got = decode_logits(model, roundtrip_cache(cache, ZeroValues()), tokens)
    _, kl = agreement_and_kl(ref, got)
    assert kl > 1e-4


def test_reference_run_leaves_the_prefill_cache_untouched(tiny_llama) -> None:
    model, cache, logits = tiny_llama
    before = cache.get_seq_length()
    greedy_reference(model, cache, logits, 3)
    assert cache.get_seq_length() == before == 32


def test_measure_codecs_reports_every_metric() -> None:
    names = ["raw", "fp8-e4m3", "int4-g32", "zstd-planes"]
    report = measure_codecs(load_preset("qwen3-32b").config, names=names, seq=48, decode_tokens=4)
    by_name = {c.name: c for c in report.codecs}
    assert list(by_name) == names
    assert (
        report.sample_bytes == 2 * 48 * 2 * 2 * 128 * 2
    )  # 2 layers, K+V, 2 kv heads, head_dim 128
    assert by_name["raw"].exact and by_name["zstd-planes"].exact
    assert by_name["raw"].kl == 0.0 and by_name["raw"].token_agreement == 1.0
    assert by_name["int4-g32"].rel_error > by_name["fp8-e4m3"].rel_error > 0
    for c in report.codecs:
        assert c.encode_gbps > 0 and c.decode_gbps > 0 and math.isfinite(c.kl or 0.0)


def test_hybrid_model_states_go_through_the_codec_too() -> None:
    report = measure_codecs(
        load_preset("jamba-v0.1").config, names=["fp8-e5m2", "lz4"], seq=24, decode_tokens=3
    )
    lossy, lossless = report.codecs
    assert lossless.exact and lossless.kl == pytest.approx(0.0, abs=1e-9)
    assert not lossy.exact and lossy.kl is not None and lossy.kl >= 0
