"""Choosing the next token from logits: logits processors, greedy or seeded sampling, logprobs.

The order follows vLLM's sampler: logit bias and ``min_tokens`` first, then repetition,
frequency and presence penalties, then (for sampling) temperature, top-k, top-p and min-p.
Sampling is seeded by (seed, position), so a token does not depend on which process
(prefill or decode) or which batch computed it; the gateway draws a fresh seed for every
request that does not give one, so unseeded sampling differs from run to run.

Logprobs are those of the model's own distribution (``log_softmax`` of the raw logits,
before any sampling parameter), as vLLM reports by default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pdx._proto import serving_pb2

GREEDY_BELOW = 1e-5  # temperatures below this (0 included) mean greedy decoding


@dataclass(frozen=True)
class Sampling:
    """The sampling parameters of one sequence (the proto's, with their zero values resolved)."""

    temperature: float = 0.0
    seed: int = 0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    want_logprobs: bool = False
    top_logprobs: int = 0

    @classmethod
    def from_proto(cls, sp: Any) -> Sampling:
        """From a ``SamplingParams`` message (0 means "off" for top_p and repetition_penalty)."""
        return cls(
            temperature=float(sp.temperature),
            seed=int(sp.seed),
            top_p=float(sp.top_p) or 1.0,
            top_k=int(sp.top_k),
            min_p=float(sp.min_p),
            frequency_penalty=float(sp.frequency_penalty),
            presence_penalty=float(sp.presence_penalty),
            repetition_penalty=float(sp.repetition_penalty) or 1.0,
            logit_bias={int(k): float(v) for k, v in sp.logit_bias.items()},
            min_tokens=int(sp.min_tokens),
            want_logprobs=bool(sp.want_logprobs),
            top_logprobs=int(sp.logprobs),
        )

    @property
    def greedy(self) -> bool:
        """Whether the argmax is taken (no randomness)."""
        return self.temperature < GREEDY_BELOW


@dataclass
class Picked:
    """The chosen token and, when asked for, its logprob and the top alternatives."""

    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)

    def message(self) -> serving_pb2.TokenLogprob | None:
        """The ``TokenLogprob`` message (None when no logprob was computed)."""
        if self.logprob is None:
            return None
        return serving_pb2.TokenLogprob(
            token_id=self.token,
            logprob=self.logprob,
            top_ids=[t for t, _ in self.top],
            top_logprobs=[lp for _, lp in self.top],
        )


def process_logits(
    logits: torch.Tensor,
    sp: Sampling,
    prompt: list[int],
    output: list[int],
    eos_token_id: int | None,
) -> torch.Tensor:
    """Logits after bias, min_tokens and the penalties (a new float32 tensor)."""
    out = logits.float().clone()
    if sp.logit_bias:
        ids = torch.tensor(list(sp.logit_bias), dtype=torch.long)
        out[ids] += torch.tensor(list(sp.logit_bias.values()), dtype=torch.float32)
    if eos_token_id is not None and len(output) < sp.min_tokens:
        out[eos_token_id] = float("-inf")
    if sp.repetition_penalty != 1.0 and (prompt or output):
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long)
        vals = out[seen]
        p = sp.repetition_penalty
        out[seen] = torch.where(vals > 0, vals / p, vals * p)
    if (sp.frequency_penalty or sp.presence_penalty) and output:
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=out.numel())
        counts = counts[: out.numel()].float()
        out -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).float()
    return out


def _filtered_probs(logits: torch.Tensor, sp: Sampling) -> torch.Tensor:
    # Subtracting the maximum first keeps tiny temperatures finite (no inf - inf = NaN).
    scaled = (logits - logits.max()) / sp.temperature
    if 0 < sp.top_k < scaled.numel():
        kth = torch.topk(scaled, sp.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if sp.top_p < 1.0:
        ordered, order = torch.sort(probs, descending=True)
        before = torch.cumsum(ordered, dim=-1) - ordered  # mass of the tokens ranked above
        drop = order[before >= sp.top_p]
        probs[drop] = 0.0
    if sp.min_p > 0:
        probs = probs.masked_fill(probs < sp.min_p * probs.max(), 0.0)
    return probs


def choose(
    logits: torch.Tensor,
    sp: Sampling,
    *,
    prompt: list[int],
    output: list[int],
    eos_token_id: int | None = None,
) -> Picked:
    """The next token of a sequence whose prompt and output so far are given."""
    processed = process_logits(logits, sp, prompt, output, eos_token_id)
    position = len(prompt) + len(output)
    if sp.greedy:
        token = int(torch.argmax(processed).item())
    else:
        probs = _filtered_probs(processed, sp)
        gen = torch.Generator().manual_seed((sp.seed * 1_000_003 + position) % (2**63))
        token = int(torch.multinomial(probs, 1, generator=gen).item())
    picked = Picked(token)
    if sp.want_logprobs:
        lps = torch.log_softmax(logits.float(), dim=-1)
        picked.logprob = float(lps[token].item())
        if sp.top_logprobs:
            values, ids = torch.topk(lps, min(sp.top_logprobs, lps.numel()))
            picked.top = [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]
    return picked


def pick_token(logits: torch.Tensor, temperature: float, seed: int, position: int) -> int:
    """Greedy when ``temperature`` is 0; else sample with a generator seeded by (seed, position).

    The plain form of :func:`choose` (no processors), kept for callers that need only a token.
    """
    if temperature < GREEDY_BELOW:
        return int(torch.argmax(logits).item())
    probs = _filtered_probs(logits.float(), Sampling(temperature=temperature, seed=seed))
    gen = torch.Generator().manual_seed((seed * 1_000_003 + position) % (2**63))
    return int(torch.multinomial(probs, 1, generator=gen).item())


def sampling_problem(sp: Any, vocab_size: int) -> str | None:
    """Why a ``SamplingParams`` message cannot be sampled from (a one-line reason), or None.

    The gateway refuses such requests first; prefill and decode check again so that a direct
    gRPC client gets INVALID_ARGUMENT, never a failed batch step.
    """
    checks = (
        ("temperature", sp.temperature, 0.0, 2.0),
        ("top_p", sp.top_p, 0.0, 1.0),
        ("min_p", sp.min_p, 0.0, 1.0),
        ("frequency_penalty", sp.frequency_penalty, -2.0, 2.0),
        ("presence_penalty", sp.presence_penalty, -2.0, 2.0),
        ("repetition_penalty", sp.repetition_penalty, 0.0, 2.0),
    )
    for name, value, low, high in checks:
        if not low <= value <= high:  # False for NaN too
            return f"{name}: got {value}, expected a number in [{low}, {high}]"
    if 0 < sp.temperature < GREEDY_BELOW:
        return f"temperature: got {sp.temperature}, expected 0 (greedy) or >= {GREEDY_BELOW}"
    if sp.top_k < 0 or sp.top_k > vocab_size:
        return f"top_k: got {sp.top_k}, expected 0 (off) to {vocab_size}"
    for token, bias in sp.logit_bias.items():
        if not 0 <= token < vocab_size:
            return f"logit_bias: token id {token} is outside the vocabulary [0, {vocab_size})"
        if not -100 <= bias <= 100:
            return f"logit_bias: got {bias} for token {token}, expected a number in [-100, 100]"
    return None
