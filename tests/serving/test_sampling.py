"""The sampler's processors and filters, each against its definition."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdx.serving.backends.sampling import Sampling, choose, pick_token, process_logits

LOGITS = torch.tensor([2.0, 1.0, 0.5, -1.0, 3.0, 0.0])  # best: 4, then 0, 1, 2, 5, 3


def test_greedy_and_bias_and_min_tokens() -> None:
    assert choose(LOGITS, Sampling(), prompt=[], output=[]).token == 4
    biased = Sampling(logit_bias={3: 100.0})
    assert choose(LOGITS, biased, prompt=[], output=[]).token == 3
    # EOS (4 here) is masked until min_tokens outputs exist, then allowed again.
    held = Sampling(min_tokens=2)
    assert choose(LOGITS, held, prompt=[], output=[7], eos_token_id=4).token == 0
    assert choose(LOGITS, held, prompt=[], output=[7, 7], eos_token_id=4).token == 4


def test_penalties_follow_their_definitions() -> None:
    out = process_logits(LOGITS, Sampling(frequency_penalty=0.5, presence_penalty=0.25),
                         prompt=[1], output=[4, 4, 0], eos_token_id=None)  # fmt: skip
    want = LOGITS.clone()
    want[4] -= 0.5 * 2 + 0.25  # OpenAI: count in the output, presence once
    want[0] -= 0.5 * 1 + 0.25
    assert torch.equal(out, want)  # the prompt token (1) is untouched
    rep = process_logits(LOGITS, Sampling(repetition_penalty=2.0), prompt=[1, 3], output=[],
                         eos_token_id=None)  # fmt: skip
    assert rep[1] == 0.5 and rep[3] == -2.0 and rep[0] == 2.0  # positive /p, negative *p


def test_filters_keep_only_their_tokens() -> None:
    probs = torch.softmax(LOGITS, -1)
    order = torch.argsort(probs, descending=True).tolist()
    for seed in range(40):
        k = choose(LOGITS, Sampling(temperature=1.0, seed=seed, top_k=2), prompt=[], output=[])
        assert k.token in order[:2]
        # top_p 0.7: the smallest set whose mass reaches 0.7 is the best two tokens here.
        assert float(probs[order[0]]) < 0.7 <= float(probs[order[:2]].sum())
        p = choose(LOGITS, Sampling(temperature=1.0, seed=seed, top_p=0.7), prompt=[], output=[])
        assert p.token in order[:2]
        m = choose(LOGITS, Sampling(temperature=1.0, seed=seed, min_p=0.5), prompt=[], output=[])
        assert probs[m.token] >= 0.5 * probs.max()


def test_seeded_sampling_repeats_and_tiny_temperatures_stay_finite() -> None:
    a = [choose(LOGITS, Sampling(temperature=1.0, seed=s), prompt=[], output=[]).token
         for s in range(30)]  # fmt: skip
    b = [pick_token(LOGITS, 1.0, s, 0) for s in range(30)]
    assert a == b and len(set(a)) > 1
    assert (
        choose(LOGITS * 1e30, Sampling(temperature=1e-5, seed=1), prompt=[], output=[]).token == 4
    )


def test_logprobs_are_the_model_distribution() -> None:
    picked = choose(LOGITS, Sampling(temperature=1.5, seed=2, want_logprobs=True, top_logprobs=3,
                                     frequency_penalty=2.0), prompt=[], output=[4])  # fmt: skip
    lps = torch.log_softmax(LOGITS, -1)
    assert picked.logprob == float(lps[picked.token])
    assert [t for t, _ in picked.top] == [4, 0, 1]
    assert all(math.isclose(v, float(lps[t]), rel_tol=1e-6) for t, v in picked.top)


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.floats(-30, 30), min_size=2, max_size=40),
    temperature=st.floats(1e-5, 2.0),
    top_p=st.floats(0.01, 1.0),
    top_k=st.integers(0, 40),
    min_p=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**63 - 1),
)
def test_a_sampled_token_always_has_probability(
    logits: list[float], temperature: float, top_p: float, top_k: int, min_p: float, seed: int
) -> None:
    t = torch.tensor(logits)
    sp = Sampling(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
    token = choose(t, sp, prompt=[], output=[]).token
    assert 0 <= token < len(logits)
    if top_k:
        assert t[token] >= torch.topk(t, min(top_k, len(logits))).values[-1]
