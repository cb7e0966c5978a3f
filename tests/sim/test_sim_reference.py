"""The engine against the published figures, a per-step reference model, and closed forms."""

from __future__ import annotations

import math
import random

import pytest

from pdx.sim.config import PUBLISHED_ILLUSTRATION, SimConfig
from pdx.sim.engine import run_mode
from pdx.sim.runner import simulate
from pdx.sim.workload import Workload, poisson_workload

PUBLISHED = {
    "colocated": (4.43, 13.20, 0.434),
    "disaggregated": (4.46, 13.28, 0.160),
}


def illustration(**changes: object) -> SimConfig:
    return SimConfig.model_validate({**PUBLISHED_ILLUSTRATION, **changes})


def close(got: float, want: float, rel: float) -> bool:
    return abs(got - want) <= rel * abs(want)


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_published_figures_reproduced_within_2_percent(mode: str) -> None:
    result = getattr(simulate(illustration(compat="published")), mode)
    p50, p95, itl = PUBLISHED[mode]
    assert close(result.ttft_p50_s, p50, 0.02), result.ttft_p50_s
    assert close(result.ttft_p95_s, p95, 0.02), result.ttft_p95_s
    assert close(result.itl_mean_s, itl, 0.02), result.itl_mean_s


def test_correct_model_keeps_ttft_and_lowers_disaggregated_itl() -> None:
    correct, published = simulate(illustration()), simulate(illustration(compat="published"))
    for mode in ("colocated", "disaggregated"):
        a, b = getattr(correct, mode), getattr(published, mode)
        assert a.ttft_p50_s == b.ttft_p50_s and a.ttft_p95_s == b.ttft_p95_s
    assert close(correct.disaggregated.itl_mean_s, 0.127, 0.02)
    assert close(correct.disaggregated.itl_p95_s, 0.40, 0.02)
    assert close(correct.colocated.itl_mean_s, 0.434, 0.02)
    assert published.disaggregated.itl_mean_s > 1.2 * correct.disaggregated.itl_mean_s


# -- an independent, per-step reading of the reference semantics (one prefill, one decode) --


def reference(cfg: SimConfig, wl: Workload, mode: str) -> dict[str, list[float]]:
    """Literal per-token loop of the reference semantics; slow, for small workloads."""
    arr, prompt, out = wl.arrival_s, wl.prompt_tokens, wl.output_tokens
    n, free, pf_end = len(arr), 0.0, []
    for a, p in zip(arr, prompt, strict=True):
        free = max(a, free) + 2 * p * cfg.model_params / cfg.prefill_flops
        pf_end.append(free)
    link = cfg.kv_bytes_per_token / cfg.link_bytes_per_s if mode == "disaggregated" else 0.0
    ready = [e + p * link for e, p in zip(pf_end, prompt, strict=True)]
    enter = arr if cfg.compat == "published" else ready
    order = sorted(range(n), key=lambda i: enter[i])
    t, j, left, steps, finish = 0.0, 0, {}, [], [math.nan] * n
    while j < n or left:
        if not left and enter[order[j]] > t:
            t = max(t, ready[order[j]])
        while j < n and enter[order[j]] <= t:
            left[order[j]] = out[order[j]]
            j += 1
        biggest = max(prompt[i] for i in left)
        d = len(left) * (cfg.weight_bytes + biggest * cfg.kv_bytes_per_token)
        d /= cfg.decode_hbm_bytes_per_s
        if mode == "colocated":
            busy = [pf_end[k] for k in range(n) if arr[k] <= t < pf_end[k]]
            if busy:
                d = max(d, max(busy) - t)
        steps.append(d)
        t += d
        for i in list(left):
            left[i] -= 1
            if left[i] == 0:
                del left[i]
                finish[i] = t
    return {"ready": ready, "finish": finish, "steps": steps}


def random_workload(seed: int, n: int) -> Workload:
    rng = random.Random(seed)
    t, arr, prompt, out = 0.0, [], [], []
    for _ in range(n):
        t += rng.expovariate(rng.choice([0.3, 1.0, 3.0]))
        arr.append(t)
        prompt.append(rng.randint(200, 70000))
        out.append(rng.randint(1, 300))
    return Workload(arr, prompt, out, f"random seed {seed}")


@pytest.mark.parametrize("compat", ["none", "published"])
@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
@pytest.mark.parametrize("seed", range(6))
def test_engine_matches_per_step_reference(seed: int, mode: str, compat: str) -> None:
    link = [2e9, 20e9, 0.5e9][seed % 3]  # slow links reorder ready times
    cfg = illustration(compat=compat, link_sharing="none", link_bytes_per_s=link)
    wl = random_workload(seed, 40)
    want = reference(cfg, wl, mode)
    got = run_mode(cfg, wl, mode)
    steps = [d for d, k in zip(got.step_s, got.step_count, strict=True) for _ in range(k)]
    assert len(steps) == len(want["steps"])
    assert steps == pytest.approx(want["steps"], rel=1e-9)
    assert got.ready_s == pytest.approx(want["ready"], rel=1e-12)
    assert got.finish_s == pytest.approx(want["finish"], rel=1e-9)


def test_fifo_link_equals_reference_when_transfers_do_not_overlap() -> None:
    fifo, free = simulate(illustration()), simulate(illustration(link_sharing="none"))
    assert fifo.disaggregated == free.disaggregated
    assert fifo.disaggregated.link_queue_max == 0


# -- closed forms --


def one_request(prompt: int, out: int) -> Workload:
    return Workload([1.0], [prompt], [out], "one request")


@pytest.mark.parametrize("prompt", [4000, 64000])
def test_one_request_ttft_is_prefill_plus_transfer_and_itl_is_step_time(prompt: int) -> None:
    cfg = illustration(link_rtt_s=0.01)
    prefill_s = 2 * prompt * 70e9 / 2.0e15
    transfer_s = prompt * 65536 / 20e9 + 0.01
    step_s = (140e9 + prompt * 65536) / 26.8e12
    rep = simulate(cfg, one_request(prompt, 100))
    dis, col = rep.disaggregated, rep.colocated
    assert dis.ttft_p50_s == pytest.approx(prefill_s + transfer_s, rel=1e-12)
    assert col.ttft_p50_s == pytest.approx(prefill_s, rel=1e-12)
    for r in (dis, col):
        assert r.itl_mean_s == pytest.approx(step_s, rel=1e-12)
        assert r.itl_p95_s == pytest.approx(step_s, rel=1e-12)
        assert r.tpot_mean_s == pytest.approx(step_s, rel=1e-9)
        assert r.decode_steps == 100


def test_saturated_prefill_queue_matches_md1_waiting_time() -> None:
    """Poisson arrivals, fixed prompts: mean wait W = rho / (2 mu (1 - rho)) (M/D/1)."""
    service_s, rho = 2.0, 0.9
    cfg = illustration(
        model_params=1e9,
        prefill_flops=1e12,  # 2 * 1000 * 1e9 / 1e12 = 2 s per prefill
        modes=["disaggregated"],
        workload={
            "requests": 200_000,
            "rate_per_s": rho / service_s,
            "seed": 11,
            "prompt_tokens": [1000],
            "prompt_weights": [1],
            "output_tokens": 1,
        },
    )
    got = simulate(cfg).disaggregated
    want = rho * service_s / (2 * (1 - rho))
    assert got.prefill_wait_mean_s == pytest.approx(want, rel=0.04)
    assert got.prefill_utilisation == pytest.approx(rho, rel=0.02)


def test_illustration_workload_is_the_published_draw() -> None:
    wl = poisson_workload(illustration().workload)
    rng = random.Random(7)
    first_gap = rng.expovariate(0.5)
    first_prompt = rng.choices([4000, 16000, 32000, 64000], weights=[3, 4, 2, 1])[0]
    assert (wl.arrival_s[0], wl.prompt_tokens[0]) == (first_gap, first_prompt)
    assert len(wl) == 150 and set(wl.output_tokens) == {512}
