"""Prefix caches of the simulated instances, for traces that say which prompts share blocks.

Each prefill instance and each decode (or colocated) instance keeps the blocks of the requests
it served, at most ``cache_blocks`` of them, least recently used evicted. A request finds the
leading run of its hash ids its instance holds: a prefill computes only the rest (at least
one token), and in a split only what the *decode* instance lacks crosses the link (as vLLM's
NIXL connector pulls only the blocks decode has not computed itself).
"""

from __future__ import annotations

from collections import OrderedDict


class BlockLRU:
    """Block ids, least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def leading(self, ids: tuple[int, ...]) -> int:
        """How many of ``ids``, from the first, this cache holds."""
        n = 0
        for h in ids:
            if h not in self.blocks:
                break
            n += 1
        return n

    def add(self, ids: tuple[int, ...]) -> None:
        """The request's blocks are now the newest; the oldest go past the capacity."""
        for h in ids:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


class PrefixCaches:
    """One :class:`BlockLRU` per prefill and per decode instance (none: every lookup 0)."""

    def __init__(
        self,
        hash_ids: list[tuple[int, ...]] | None,
        block_size: int,
        cache_blocks: int | None,
        prefill_instances: int,
        decode_instances: int,
    ) -> None:
        self.on = bool(hash_ids) and bool(cache_blocks) and block_size > 0
        self.hash_ids = hash_ids or []
        self.block = block_size
        size = cache_blocks or 0
        self.prefill = [BlockLRU(size) for _ in range(prefill_instances if self.on else 0)]
        self.decode = [BlockLRU(size) for _ in range(decode_instances if self.on else 0)]

    def hit(self, caches: list[BlockLRU], idx: int, rid: int, prompt: int) -> int:
        """Tokens of request ``rid``'s prompt instance ``idx`` holds (0 without caches)."""
        if not self.on:
            return 0
        return min(prompt, caches[idx].leading(self.hash_ids[rid]) * self.block)

    def store(self, caches: list[BlockLRU], idx: int, rid: int) -> None:
        """Instance ``idx`` now holds request ``rid``'s blocks."""
        if self.on:
            caches[idx].add(self.hash_ids[rid])
