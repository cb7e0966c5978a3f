"""Prompts that reuse what the trace says they reuse.

The tokens of a block are a deterministic function of its hash id and a run salt, so two
requests that share their first k hash ids share exactly their first k blocks of tokens, and
any prefix cache (vLLM's, pdx's) sees the reuse the trace describes; the last block is cut to
the request's length. A request without hash ids gets tokens of its own (from its line).

``length_scale`` multiplies every length *and* the block size (1/32 maps Mooncake's 512-token
blocks onto 16-token ones), so a CPU-sized replay keeps the trace's reuse structure; an engine's
cache sees all of it where its own block size divides the scaled one.
Text prompts (for engines that want text) map each token id to one fixed word, so a shared
block is a shared run of words.
"""

from __future__ import annotations

import math
import random
from functools import lru_cache

from pdx.traces.formats import TraceRequest

_WORDS = 4096  # distinct words of text prompts


def scaled(n: int, length_scale: float) -> int:
    """A length (or block size) times ``length_scale``, at least 1."""
    return max(1, round(n * length_scale))


@lru_cache(maxsize=65536)
def block_tokens(hash_id: int, salt: int, size: int, token_id_max: int) -> tuple[int, ...]:
    """The ``size`` token ids of the block ``hash_id`` (ids in 1..token_id_max)."""
    rng = random.Random(hash((salt, hash_id, size, token_id_max)))
    return tuple(rng.randint(1, token_id_max) for _ in range(size))


def prompt_ids(
    req: TraceRequest,
    block_size: int,
    *,
    length_scale: float = 1.0,
    salt: int = 0,
    token_id_max: int = 250,
) -> list[int]:
    """The request's prompt: its blocks' tokens in order, cut to its (scaled) length."""
    n = scaled(req.input_tokens, length_scale)
    size = scaled(block_size, length_scale)
    ids = list(req.hash_ids)
    need = math.ceil(n / size)
    # a request with no ids (or a length that scales to more blocks than it has ids) gets
    # blocks of its own for the rest: never shared with another request
    ids += [-(req.line * 1_000_003 + i + 1) for i in range(need - len(ids))]
    out: list[int] = []
    for h in ids[:need]:
        out.extend(block_tokens(h, salt, size, token_id_max))
    return out[:n]


def words(ids: list[int]) -> str:
    """A text prompt with one fixed word per token id (a shared block is a shared run)."""
    return " ".join(_word(i % _WORDS) for i in ids)


@lru_cache(maxsize=_WORDS)
def _word(i: int) -> str:
    letters = "etaoinshrdlucmfw"
    out = ""
    i += _WORDS  # every word at least 4 letters
    while i:
        i, r = divmod(i, len(letters))
        out += letters[r]
    return out
