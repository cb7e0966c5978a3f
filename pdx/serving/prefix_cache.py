"""Prefix caches for pdx's own engines: finished prompts' KV kept as hashed blocks.

A prompt is cut into blocks of ``block_tokens`` token ids; block *i*'s hash covers block *i*'s
ids and block *i-1*'s hash (a chain), so equal hashes mean equal prefixes. The gateway hashes
a prompt the same way and compares the chain with the hashes each decode reports
(:meth:`PrefixCache.subscribe`), as llm-d's and Dynamo's routers do with vLLM's KV events.

Blocks live under the instance's memory budget, least recently used first out, never while
pinned (a request is copying them). A block is touched from the tail of its chain back to its
root, so a chain's tail goes before its root: the root of a shared prefix is what stays.

Hand-written because it is pdx's own engine state: vLLM's block manager is not importable
without vLLM, and the slicing follows each backend's tensor layout.
"""

from __future__ import annotations

import asyncio
import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: What a subscriber may fall behind by (event batches) before it is dropped; it resubscribes
#: and gets a fresh snapshot.
EVENT_QUEUE_MAX = 4096
#: Hashes per snapshot message (9 bytes each on the wire: well under gRPC's 4 MiB).
SNAPSHOT_BATCH = 65536
_ROOT = b"pdx-prefix-v1"


def block_hashes(token_ids: Sequence[int], block_tokens: int, salt: str = "") -> list[int]:
    """The chained hash (unsigned 64-bit) of every whole block of ``token_ids``; a request's
    ``cache_salt`` starts its chain elsewhere, so prompts with other salts share no block."""
    return chain_hashes(token_ids, block_tokens, salt)


def chain_hashes(
    token_ids: Sequence[int], block_tokens: int, salt: str = "", parent: int | None = None
) -> list[int]:
    """:func:`block_hashes` of blocks that follow the block whose hash is ``parent`` (None:
    blocks from the prompt's start, whose chain begins at the ``salt``'s root)."""
    hashes: list[int] = []
    if parent is not None:
        prev = parent.to_bytes(8, "little")
    else:
        prev = _ROOT + block_tokens.to_bytes(4, "little")
        if salt:
            prev = hashlib.blake2b(prev + salt.encode(), digest_size=8).digest()
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        block = array("q", token_ids[start : start + block_tokens]).tobytes()
        digest = hashlib.blake2b(prev + block, digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "little"))
        prev = digest
    return hashes


def reusable_blocks(prompt_tokens: int, block_tokens: int) -> int:
    """Most whole blocks of a prompt that a cache may supply: at least one token of it is
    computed, for its logits (vLLM does the same on a full hit)."""
    return max(0, prompt_tokens - 1) // block_tokens


def leading_matches(hashes: Sequence[int], held: Callable[[int], bool]) -> int:
    """How many of ``hashes``, from the first, ``held`` says are present."""
    n = 0
    for h in hashes:
        if not held(h):
            break
        n += 1
    return n


def token_slice(tensors: list[torch.Tensor], axes: list[int], start: int, end: int) -> list[Any]:
    """Views of tokens ``[start, end)`` of each tensor along its token axis."""
    return [t.narrow(axis, start, end - start) for t, axis in zip(tensors, axes, strict=True)]


def token_join(parts: list[list[torch.Tensor]], axes: list[int]) -> list[Any]:
    """Each tensor's parts joined along its token axis, in order (one copy)."""
    import torch

    if len(parts) == 1:
        return list(parts[0])
    return [torch.cat([p[i] for p in parts], dim=axis) for i, axis in enumerate(axes)]


@dataclass
class Block:
    """One cached block: a slice of every KV tensor, ``block_tokens`` tokens long."""

    hash: int
    tensors: list[Any]
    nbytes: int
    pins: int = 0


@dataclass
class CacheEvents:
    """One batch for a subscriber: blocks stored, blocks removed, or everything cleared."""

    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    cleared: bool = False


class PrefixCache:
    """Blocks by chained hash, LRU-evicted to stay under ``limit_bytes()``."""

    def __init__(self, block_tokens: int, limit_bytes: Callable[[], int]) -> None:
        self.block_tokens = block_tokens
        self.limit_bytes = limit_bytes
        self.blocks: OrderedDict[int, Block] = OrderedDict()  # first = next to evict
        self.bytes = 0
        self.hits_tokens = 0  # prompt tokens supplied from the cache so far
        self.queried_tokens = 0  # prompt tokens looked up so far
        self.evicted = 0
        self._subscribers: list[asyncio.Queue[CacheEvents | None]] = []

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.blocks

    def hashes(self, token_ids: Sequence[int], salt: str = "") -> list[int]:
        """The prompt's block hashes, at this cache's block size."""
        return block_hashes(token_ids, self.block_tokens, salt)

    def held_blocks(self, hashes: Sequence[int], prompt_tokens: int) -> int:
        """Leading blocks of a prompt held here, at most those a cache may supply."""
        most = reusable_blocks(prompt_tokens, self.block_tokens)
        return leading_matches(hashes[:most], self.__contains__)

    def pin(self, hashes: Sequence[int]) -> list[Block]:
        """Pin and touch the blocks of ``hashes`` (all held): they stay until :meth:`unpin`."""
        blocks = [self.blocks[h] for h in hashes]
        for block in reversed(blocks):
            block.pins += 1
            self.blocks.move_to_end(block.hash)
        return blocks

    def unpin(self, blocks: list[Block]) -> None:
        """Let pinned blocks be evicted again."""
        for block in blocks:
            block.pins = max(0, block.pins - 1)
        self.fit()

    def count(self, prompt_tokens: int, cached_tokens: int) -> None:
        """Account one lookup: ``cached_tokens`` of ``prompt_tokens`` came from here."""
        self.queried_tokens += prompt_tokens
        self.hits_tokens += cached_tokens

    def insert(self, hashes: Sequence[int], tensors: list[Any], axes: list[int]) -> int:
        """Keep blocks ``0..len(hashes)`` of a state (``tensors``, token axes ``axes``); the
        ones already held are only touched. Returns the blocks added."""
        b = self.block_tokens
        added: list[int] = []
        for i, h in enumerate(hashes):
            if h in self.blocks:
                continue
            part = token_slice(tensors, axes, i * b, (i + 1) * b)
            nbytes = sum(t.numel() * t.element_size() for t in part)
            self.blocks[h] = Block(h, part, nbytes)
            self.bytes += nbytes
            added.append(h)
        for h in reversed(hashes):  # the chain's root ends most recent
            self.blocks.move_to_end(h)
        removed = self._evict_to(self.limit_bytes())
        kept = [h for h in added if h in self.blocks]
        self._publish(CacheEvents(stored=kept, removed=[h for h in removed if h not in added]))
        return len(kept)

    def fit(self) -> None:
        """Evict until within the limit (call when the limit has shrunk)."""
        removed = self._evict_to(self.limit_bytes())
        if removed:
            self._publish(CacheEvents(removed=removed))

    def _evict_to(self, limit: int) -> list[int]:
        removed: list[int] = []
        if self.bytes <= limit:
            return removed
        for h in list(self.blocks):
            if self.bytes <= limit:
                break
            block = self.blocks[h]
            if block.pins:
                continue
            del self.blocks[h]
            self.bytes -= block.nbytes
            self.evicted += 1
            removed.append(h)
        return removed

    def clear(self) -> None:
        """Drop every unpinned block."""
        self._evict_to(0)
        self._publish(CacheEvents(stored=list(self.blocks), cleared=True))

    # --- events -----------------------------------------------------------------------

    def subscribe(self) -> asyncio.Queue[CacheEvents | None]:
        """A queue of event batches, starting with a snapshot (``cleared`` + every block);
        ``None`` means the subscriber fell behind and was dropped."""
        queue: asyncio.Queue[CacheEvents | None] = asyncio.Queue()  # the snapshot may be long
        held = list(self.blocks)
        queue.put_nowait(CacheEvents(stored=held[:SNAPSHOT_BATCH], cleared=True))
        for start in range(SNAPSHOT_BATCH, len(held), SNAPSHOT_BATCH):
            queue.put_nowait(CacheEvents(stored=held[start : start + SNAPSHOT_BATCH]))
        self._subscribers.append(queue)
        return queue

    @property
    def subscribers(self) -> int:
        """Queues being sent events."""
        return len(self._subscribers)

    def unsubscribe(self, queue: asyncio.Queue[CacheEvents | None]) -> None:
        """Stop sending to ``queue``."""
        if queue in self._subscribers:
            self._subscribers.remove(queue)

    def _publish(self, events: CacheEvents) -> None:
        if not (events.stored or events.removed or events.cleared):
            return
        for queue in list(self._subscribers):
            if queue.qsize() >= EVENT_QUEUE_MAX:
                self._subscribers.remove(queue)
                queue.put_nowait(None)
            else:
                queue.put_nowait(events)

    def describe(self) -> dict[str, Any]:
        """Counters for status and records."""
        return {
            "block_tokens": self.block_tokens,
            "blocks": len(self.blocks),
            "bytes": self.bytes,
            "hit_tokens": self.hits_tokens,
            "queried_tokens": self.queried_tokens,
            "evicted_blocks": self.evicted,
        }


@dataclass
class Reuse:
    """One prompt's look-up: its block hashes and the leading blocks held (pinned)."""

    hashes: list[int]
    blocks: list[Block]
    block_tokens: int

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the held blocks supply."""
        return len(self.blocks) * self.block_tokens


def reuse(
    cache: PrefixCache | None,
    token_ids: Sequence[int],
    most_blocks: int | None = None,
    salt: str = "",
) -> Reuse:
    """Pin the leading blocks of ``token_ids`` (under ``salt``) that ``cache`` holds (at most
    ``most_blocks``); an empty look-up without a cache. Give them back with
    :meth:`PrefixCache.unpin`."""
    if cache is None:
        return Reuse([], [], 1)
    hashes = cache.hashes(token_ids, salt)
    held = cache.held_blocks(hashes, len(token_ids)) if most_blocks != 0 else 0
    held = held if most_blocks is None else min(held, most_blocks)
    return Reuse(hashes, cache.pin(hashes[:held]), cache.block_tokens)


def prefill_with(
    backend: Any, token_ids: list[int], found: Reuse, on_layer: Any = None
) -> tuple[Any, Any]:
    """(model thread) Prefill ``token_ids``, computing only what ``found`` does not supply."""
    from pdx.serving.backends.base import KVState

    if not found.blocks:
        if on_layer is None:
            return backend.prefill(token_ids)  # type: ignore[no-any-return]
        return backend.prefill_layers(token_ids, on_layer)  # type: ignore[no-any-return]
    axes = backend.kv_token_axes(found.blocks[0].tensors)
    prefix = KVState(token_join([b.tensors for b in found.blocks], axes), found.cached_tokens)
    return backend.prefill_after(token_ids, prefix, on_layer)  # type: ignore[no-any-return]


def keep(cache: PrefixCache | None, backend: Any, found: Reuse, state: Any) -> None:
    """After a prompt's KV exists: its whole blocks join the cache, the pins are let go."""
    if cache is None:
        return
    cache.unpin(found.blocks)
    whole = state.length // cache.block_tokens
    if whole:
        axes = backend.kv_token_axes(state.tensors)
        cache.insert(found.hashes[:whole], state.tensors, axes)


def cut_from(backend: Any, tensors: list[Any], start: int) -> list[Any]:
    """The tokens from ``start`` on of each tensor, contiguous (what ships when the reader
    holds the first ``start`` tokens already)."""
    if not start:
        return tensors
    axes = backend.kv_token_axes(tensors)
    return [
        t.narrow(a, start, t.shape[a] - start).contiguous()
        for t, a in zip(tensors, axes, strict=True)
    ]


def cache_supported(backend: Any) -> bool:
    """Whether ``backend``'s KV can be cut at a token (so cached in blocks)."""
    return backend.kv_token_axes([]) is not None
