"""Invariants of the engine over random pool, link and batch configurations."""

from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from pdx.sim.config import PUBLISHED_ILLUSTRATION, SimConfig
from pdx.sim.engine import run_mode
from pdx.sim.workload import Workload

configs = st.fixed_dictionaries(
    {
        "prefill_instances": st.integers(1, 3),
        "decode_instances": st.integers(1, 3),
        "colocated_instances": st.integers(1, 3),
        "local_prefill_max_tokens": st.sampled_from([0, 4000, 20000]),
        "max_decode_batch": st.sampled_from([None, 1, 3]),
        "chunked_prefill_tokens": st.sampled_from([None, 512, 8192]),
        "link_bytes_per_s": st.sampled_from([0.5e9, 20e9]),
        "link_rtt_s": st.sampled_from([0.0, 0.03]),
        "link_loss": st.sampled_from([0.0, 1e-5]),
        "link_jitter_s": st.sampled_from([0.0, 0.05]),
        "decode_weight_reads": st.sampled_from(["per_request", "per_step"]),
        "decode_kv_budget_bytes": st.sampled_from([None, 3 * 40000 * 65536]),
    }
)


def workload(seed: int, n: int = 30) -> Workload:
    rng = random.Random(seed)
    t, arr, prompt, out = 0.0, [], [], []
    for _ in range(n):
        t += rng.expovariate(rng.choice([0.5, 4.0]))
        arr.append(t)
        prompt.append(rng.randint(100, 30000))
        out.append(rng.randint(1, 200))
    return Workload(arr, prompt, out, "random")


@settings(max_examples=40, deadline=None)
@given(configs, st.integers(0, 10_000), st.sampled_from(["colocated", "disaggregated"]))
def test_every_request_finishes_in_order_and_every_token_is_stepped(
    changes: dict[str, object], seed: int, mode: str
) -> None:
    cfg = SimConfig.model_validate({**PUBLISHED_ILLUSTRATION, **changes})
    wl = workload(seed)
    tr = run_mode(cfg, wl, mode)  # type: ignore[arg-type]
    for i in range(len(wl)):
        assert tr.arrival_s[i] <= tr.prefill_start_s[i] <= tr.prefill_end_s[i] <= tr.ready_s[i]
        assert tr.ready_s[i] <= tr.join_s[i] < tr.finish_s[i]
        assert not math.isnan(tr.finish_s[i])
    # each step advances every batch member by one token: tokens == sum(batch * steps)
    stepped = sum(b * k for b, k in zip(tr.step_batch, tr.step_count, strict=True))
    assert stepped == sum(wl.output_tokens)
    if cfg.max_decode_batch:
        assert max(tr.step_batch) <= cfg.max_decode_batch
    if mode == "disaggregated":
        local = [p <= cfg.local_prefill_max_tokens for p in wl.prompt_tokens]
        assert list(map(bool, tr.local_prefill)) == local
