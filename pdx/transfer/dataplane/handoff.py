"""The hand-off between the event loop and a data-plane connection thread.

A connection thread receives a request, hands it to the store's service on the loop, and
waits (:meth:`Handoff.wait`) for the object to read into or the chunks to send; once the
bytes have moved it answers with what happened (:class:`PutOutcome`, :class:`GetOutcome`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass, field
from typing import Any

from pdx.transfer.contract import KVError, KVErrorCode


class Handoff:
    """Hands a store object from the loop to a connection thread and the result back.

    The service coroutine calls :meth:`exchange` (on the loop) once it holds the object;
    the connection thread waits for it with :meth:`wait`, moves the bytes, and answers
    with :meth:`deliver`.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.given: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._answer: asyncio.Future[Any] | None = None
        self._abandoned: BaseException | None = None

    async def exchange(self, value: Any) -> Any:
        """(loop) Give ``value`` to the thread; wait for what it delivers."""
        if self._abandoned is not None:  # the thread stopped waiting for us
            raise self._abandoned
        self._answer = self.loop.create_future()
        self.given.set_result(value)
        return await self._answer

    def abandon(self, exc: BaseException) -> None:
        """(thread) Stop waiting: an :meth:`exchange` now or later raises ``exc``.

        Without this, a request whose store side got going only after the connection
        thread gave up would wait for an answer forever, holding its slot.
        """

        def mark() -> None:
            self._abandoned = exc
            if self._answer is not None and not self._answer.done():
                self._answer.set_exception(exc)

        self.loop.call_soon_threadsafe(mark)

    def wait(self, call: concurrent.futures.Future[Any], timeout_s: float) -> Any:
        """(thread) The value given, or the call's own outcome if it ended before giving one."""
        done, _ = concurrent.futures.wait(
            [self.given, call], timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED
        )
        if self.given in done:
            return self.given.result()
        if call in done:
            call.result()  # raises the store's error (e.g. KV_NOT_FOUND)
            raise KVError(KVErrorCode.KV_INTERNAL, "request ended without an answer")
        raise TimeoutError("store did not answer in time")

    def deliver(self, value: Any) -> None:
        """(thread) Send the result back to the waiting coroutine."""

        def put() -> None:
            if self._answer is not None and not self._answer.done():
                self._answer.set_result(value)

        self.loop.call_soon_threadsafe(put)


@dataclass
class PutOutcome:
    """What a connection thread received for one Put stream."""

    chunks: list[tuple[int, memoryview]] = field(default_factory=list)
    nbytes: int = 0
    trailer_digest: int | None = None
    error: KVError | None = None


@dataclass
class GetOutcome:
    """What a connection thread sent for one Get."""

    nbytes: int = 0
    chunks: int = 0
    error: KVError | None = None
