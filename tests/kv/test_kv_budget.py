"""Bandwidth budget: demand, the 70 % rule, transfer vs recompute and its break-even."""

from __future__ import annotations

import pytest

from pdx.errors import InputError
from pdx.kv.budget import LinkParams, break_even_seq, compute_budget, recompute_s, transfer_s
from pdx.kv.source import load_preset
from pdx.kv.spec import build_spec


def spec_of(name: str):
    return build_spec(load_preset(name).config, name=name)


def test_llama_70b_demand_and_times() -> None:
    spec = spec_of("llama-3.1-70b")
    link = LinkParams(qps=20, link_gbps=100, prefill_tflops=400)
    budget = compute_budget(spec, [1024, 8192], {"fp8-e4m3": 2.0}, link)
    raw_1k, fp8_1k = budget.sequences[0].per_codec
    assert raw_1k.kv_bytes == 327680 * 1024
    assert raw_1k.demand_gbps == pytest.approx(327680 * 1024 * 20 * 8 / 1e9)
    assert raw_1k.utilisation == pytest.approx(0.5369, abs=1e-4) and raw_1k.within_70pct
    assert not budget.sequences[1].per_codec[0].within_70pct
    assert fp8_1k.demand_gbps == pytest.approx(raw_1k.demand_gbps / 2)
    assert raw_1k.transfer_s == pytest.approx(327680 * 1024 * 8 / 100e9)
    assert budget.sequences[0].recompute_s == pytest.approx(2 * 1024 * spec.params_active / 400e12)


def _brute_force(spec, ratio: float, link: LinkParams, limit: int) -> int | None:
    for seq in range(1, limit):
        if transfer_s(spec.kv_bytes(seq) / ratio, link) < recompute_s(
            seq, spec.params_active, link
        ):
            return seq
    return None


@pytest.mark.parametrize(
    ("name", "link"),
    [
        ("llama-3.1-70b", LinkParams(1, 100, 400, transfer_overhead_ms=5)),
        ("gemma-3-27b", LinkParams(1, 10, 400, transfer_overhead_ms=2)),
        ("qwen3-next-80b-a3b", LinkParams(1, 25, 400)),
        ("jamba-v0.1", LinkParams(1, 10, 1000, transfer_overhead_ms=1)),
        ("mistral-7b-v0.1", LinkParams(1, 100, 400, transfer_overhead_ms=3)),
    ],
)
def test_break_even_matches_brute_force(name: str, link: LinkParams) -> None:
    spec = spec_of(name)
    found = break_even_seq(spec, 1.0, link)
    assert found is not None
    assert found == _brute_force(spec, 1.0, link, found + 2)
    assert found > 1


def test_break_even_never_on_a_slow_link() -> None:
    # 1 Gbit/s moves 70B-model KV slower per token than 400 TFLOP/s recomputes it.
    assert break_even_seq(spec_of("llama-3.1-70b"), 1.0, LinkParams(1, 1, 400)) is None


def test_compression_lowers_the_break_even() -> None:
    spec, link = spec_of("qwen3-next-80b-a3b"), LinkParams(1, 25, 400)
    raw, packed = break_even_seq(spec, 1.0, link), break_even_seq(spec, 3.0, link)
    assert raw is not None and packed is not None and packed < raw


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"qps": 0, "link_gbps": 100, "prefill_tflops": 400}, "--qps"),
        ({"qps": 1, "link_gbps": -1, "prefill_tflops": 400}, "--link-gbps"),
        ({"qps": 1, "link_gbps": 1, "prefill_tflops": 0}, "--prefill-tflops"),
        ({"qps": 1, "link_gbps": 1, "prefill_tflops": 1, "transfer_overhead_ms": -1}, "--transfer"),
    ],
)
def test_bad_link_params(kwargs, field: str) -> None:
    with pytest.raises(InputError, match=field):
        LinkParams(**kwargs)


def test_unknown_parameter_count_keeps_kv_sizes_and_drops_recompute() -> None:
    # A model type transformers does not know is read from its own fields: no vocab default.
    cfg = {**load_preset("llama-3.1-8b").config, "model_type": "in_house_llama"}
    del cfg["vocab_size"]
    spec = build_spec(cfg, name="x")
    assert spec.kv_bytes_per_token == 131072 and spec.params_active == 0
    assert any("vocab_size" in note for note in spec.notes)
    budget = compute_budget(spec, [1024], {}, LinkParams(1, 100, 400))
    assert budget.sequences[0].recompute_s is None and budget.break_even[0].seq is None
    given = build_spec(cfg, name="x", active_params=8_000_000_000)
    assert break_even_seq(given, 1.0, LinkParams(1, 100, 400, transfer_overhead_ms=1)) is not None
