"""Choosing the next token from logits: greedy, or seeded sampling that every process repeats."""

from __future__ import annotations

import torch


def pick_token(logits: torch.Tensor, temperature: float, seed: int, position: int) -> int:
    """Greedy when ``temperature`` is 0; else sample with a generator seeded by (seed, position).

    Seeding per position makes a sampled token independent of which process (prefill or
    decode) or which batch computed it.
    """
    if temperature <= 0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + position) % (2**63))
    return int(torch.multinomial(probs, 1, generator=gen).item())
