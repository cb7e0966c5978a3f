"""The router's view of each decode's prefix cache, from the decode's own cache events.

As llm-d's and Dynamo's routers follow vLLM's KV events: a snapshot, then blocks stored and
removed. A lost stream empties the view (nothing is taken as cached that is not known to be)
until the decode is heard from again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from pdx._proto import serving_pb2
from pdx.serving.router import DecodeInstance

log = logging.getLogger("pdx.gateway")
#: Block hashes held per decode, at most: beyond it new blocks are not recorded (a prefix
#: that is not recorded only counts as uncached).
MAX_BLOCKS_PER_DECODE = 4_000_000


def apply_event(d: DecodeInstance, event: serving_pb2.CacheEvent) -> None:
    """One batch of a decode's cache events onto its view."""
    if event.cleared:
        d.cached_blocks.clear()
    d.block_tokens = event.block_tokens
    d.cached_blocks.difference_update(event.removed)
    room = MAX_BLOCKS_PER_DECODE - len(d.cached_blocks)
    d.cached_blocks.update(event.stored[: max(0, room)])


async def watch_cache(
    d: DecodeInstance,
    changed: Callable[[DecodeInstance], None] = lambda d: None,
    first_delay_s: float = 0.2,
    most_delay_s: float = 5.0,
) -> None:
    """Follow ``d``'s cache events until cancelled, reconnecting with backoff; ``changed``
    after every batch and every loss of the stream."""
    delay = first_delay_s
    while True:
        call = d.stub.CacheEvents(serving_pb2.CacheEventsRequest())
        try:
            async for event in call:
                apply_event(d, event)
                changed(d)
                delay = first_delay_s
        except grpc.aio.AioRpcError as exc:
            log.debug("cache events of %s: %s", d.name, exc.code())
        finally:
            call.cancel()
        d.cached_blocks.clear()
        changed(d)
        await asyncio.sleep(delay)
        delay = min(most_delay_s, delay * 2)
