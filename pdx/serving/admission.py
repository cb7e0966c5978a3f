"""Decode's KV budget, held by requests before their KV exists.

Each admitted request reserves the bytes its KV will occupy at its longest (prompt plus
``max_tokens``, at the model's bytes per token) before decode fetches or computes any of it,
and gives them back when it ends. Resident KV then never passes ``kv_budget_bytes``: a request
that does not fit waits, first come first served, until enough is given back; one larger than
the whole budget is refused up front (it would wait for ever). The router reads the same
figures (free bytes, bytes per token) to send a request where it fits now.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable


class KVReservations:
    """Bytes reserved against one budget, with a first-come-first-served queue for room."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.reserved_bytes = 0
        self._waiting: deque[tuple[int, asyncio.Event]] = deque()

    @property
    def free_bytes(self) -> int:
        """What a new request may still reserve without waiting."""
        return max(0, self.budget_bytes - self.reserved_bytes)

    @property
    def waiting(self) -> int:
        """Requests queued for room."""
        return len(self._waiting)

    def fits_ever(self, need_bytes: int) -> bool:
        """Whether ``need_bytes`` fits the whole budget (else no amount of waiting helps)."""
        return need_bytes <= self.budget_bytes

    async def take(
        self,
        need_bytes: int,
        *,
        while_waiting: Callable[[], Awaitable[None]] | None = None,
        every_s: float = 5.0,
    ) -> None:
        """Reserve ``need_bytes``, waiting (behind earlier waiters) until they fit.

        ``while_waiting`` runs every ``every_s`` seconds of waiting (decode renews the KV
        object's lease there, so a request held for room does not lose its KV).
        """
        if not self.fits_ever(need_bytes):
            raise ValueError(f"{need_bytes} bytes exceed the whole budget of {self.budget_bytes}")
        if not self._waiting and self.reserved_bytes + need_bytes <= self.budget_bytes:
            self.reserved_bytes += need_bytes
            return
        entry = (need_bytes, asyncio.Event())
        self._waiting.append(entry)
        try:
            while not (self._waiting[0] is entry and self._fits(need_bytes)):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(entry[1].wait(), every_s)
                    entry[1].clear()
                    continue
                if while_waiting is not None:
                    await while_waiting()
            self.reserved_bytes += need_bytes
        finally:
            self._waiting.remove(entry)
            self._wake_first()

    def give_back(self, nbytes: int) -> None:
        """Return a reservation; the first waiter is woken to try again."""
        self.reserved_bytes = max(0, self.reserved_bytes - nbytes)
        self._wake_first()

    def _fits(self, need_bytes: int) -> bool:
        return self.reserved_bytes + need_bytes <= self.budget_bytes

    def _wake_first(self) -> None:
        if self._waiting:
            self._waiting[0][1].set()
