"""The router's view of each vLLM decode's prefix cache, from vLLM's KV events.

vLLM started with ``--kv-events-config`` (publisher ``zmq``) sends every batch of cache events
as one ZeroMQ multipart message: the topic, an 8-byte big-endian sequence number, and a
msgpack payload ``[ts, [event, ...], dp_rank]``. Each event is a map with its ``type``:
``BlockStored`` (vLLM's hashes of the blocks, their parent's, the blocks' token ids, the block
size, LoRA, per block its extra keys: the cache salt on a chain's first block),
``BlockRemoved`` (hashes) or ``AllBlocksCleared``. llm-d's and Dynamo's routers follow the same
stream.

vLLM's hashes depend on its hash function and seed (``--prefix-caching-hash-algo``,
``PYTHONHASHSEED``), which the gateway cannot reproduce. So every stored block is hashed again
with pdx's own chain (:func:`pdx.serving.prefix_cache.chain_hashes`) from its token ids and its
parent's pdx hash, and the router compares requests with those hashes as it does for pdx's own
engines; a vLLM → pdx hash map turns removals into pdx hashes.

What is not known is not taken as cached: a block whose parent the gateway never saw (it
started after the decode, or events were lost), a block of a LoRA adapter or with multimodal or
prompt-embedding keys (pdx's requests carry none), or one in another tier or cache group is
left out. A gap in the sequence numbers (the publisher dropped messages at its high-water mark),
a sequence that starts again (the decode restarted) or a message that does not parse empties
the view. Hand-written because it is pdx's routing state; the wire format is vLLM's
(``vllm/distributed/kv_events.py``), read with pyzmq and msgpack.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from pdx.serving.prefix_cache import chain_hashes
from pdx.serving.router import DecodeInstance

log = logging.getLogger("pdx.gateway")
#: The largest event message taken (ZeroMQ drops the connection of a peer that sends more):
#: a batch of a 128k-token prompt's blocks is about 1.2 MB.
MAX_MESSAGE_BYTES = 64 * 2**20
#: vLLM blocks followed per decode, at most (beyond it new blocks are not recorded: a prefix
#: that is not recorded only counts as uncached).
MAX_BLOCKS = 4_000_000


class EventError(ValueError):
    """A message that is not a vLLM KV event batch."""


class VLLMCacheView:
    """One decode's cache as its events tell it, kept in ``decode.cached_blocks``."""

    def __init__(self, decode: DecodeInstance, max_blocks: int = MAX_BLOCKS) -> None:
        self.decode = decode
        self.max_blocks = max_blocks
        self.ours: dict[Any, int] = {}  # vLLM's hash (bytes or int) → pdx's hash
        self.refs: Counter[int] = Counter()  # pdx hash → vLLM hashes naming it
        self.seq: int | None = None
        self.skipped = 0  # blocks stored that are not recorded (see the module's docstring)

    def clear(self) -> None:
        """Nothing known: nothing taken as cached."""
        self.ours.clear()
        self.refs.clear()
        self.decode.cached_blocks.clear()

    def message(self, frames: list[bytes]) -> None:
        """One multipart message of the publisher; EventError when it is not one (the view
        is emptied first: what came before it may be incomplete)."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.clear()
            self.seq = None
            raise EventError(f"expected (topic, 8-byte seq, payload), got {len(frames)} frames")
        seq = int.from_bytes(frames[1], "big")
        if self.seq is not None and seq != self.seq + 1:
            self.clear()  # lost messages, or a restarted publisher
        self.seq = seq
        try:
            batch = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
            events = batch[1]
            if not isinstance(events, list):
                raise TypeError(f"events: expected a list, got {type(events).__name__}")
            for event in events:
                self.event(event)
        except (ValueError, TypeError, KeyError, IndexError, msgpack.UnpackException) as exc:
            self.clear()
            self.seq = None
            raise EventError(f"seq {seq}: {exc}") from exc

    def event(self, event: dict[str, Any]) -> None:
        """One event onto the view."""
        kind = event["type"]
        if kind == "BlockStored":
            self.stored(event)
        elif kind == "BlockRemoved":
            for h in event["block_hashes"]:
                self._drop(h)
        elif kind == "AllBlocksCleared":
            self.clear()

    def stored(self, event: dict[str, Any]) -> None:
        """Blocks stored: hashed again with pdx's chain, from their parent's pdx hash."""
        hashes, ids, size = event["block_hashes"], event["token_ids"], int(event["block_size"])
        keys = event.get("extra_keys") or [None] * len(hashes)
        parent = event.get("parent_block_hash")
        start = None if parent is None else self.ours.get(parent)
        salt = _salt(keys[0]) if parent is None and keys else ""
        if (
            size <= 0
            or len(ids) != size * len(hashes)
            or len(keys) != len(hashes)
            or event.get("lora_name") or event.get("lora_id")
            or event.get("medium") not in (None, "GPU")
            or event.get("group_idx") not in (None, 0)
            or (parent is not None and start is None)
            or salt is None
            or any(keys[1:])
            or (parent is not None and keys[0])
        ):  # fmt: skip
            self.skipped += len(hashes)
            return
        d = self.decode
        if d.block_tokens and d.block_tokens != size:
            self.clear()  # another block size: a decode restarted with another --block-size
        d.block_tokens = size
        for theirs, ours in zip(hashes, chain_hashes(ids, size, salt, start), strict=True):
            if theirs in self.ours:
                continue  # reported again (vLLM reports reused blocks too)
            if len(self.ours) >= self.max_blocks:
                self.skipped += 1
                continue
            self.ours[theirs] = ours
            self.refs[ours] += 1
            d.cached_blocks.add(ours)

    def _drop(self, theirs: Any) -> None:
        ours = self.ours.pop(theirs, None)
        if ours is None:
            return
        self.refs[ours] -= 1
        if self.refs[ours] <= 0:
            del self.refs[ours]
            self.decode.cached_blocks.discard(ours)


def _salt(keys: list[Any] | None) -> str | None:
    """The cache salt of a chain's first block from its extra keys ("" none, None: keys pdx's
    requests never carry, such as multimodal ones)."""
    if not keys:
        return ""
    if len(keys) == 1 and isinstance(keys[0], str):
        return keys[0]
    return None


async def follow_vllm_events(
    decode: DecodeInstance,
    endpoint: str,
    changed: Callable[[DecodeInstance], None] = lambda d: None,
) -> None:
    """Follow ``decode``'s KV events at ``endpoint`` until cancelled (ZeroMQ reconnects by
    itself when the decode restarts); ``changed`` after every message. Every topic is taken:
    the socket is this decode's alone."""
    sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    view = VLLMCacheView(decode)
    try:
        sock.connect(endpoint)
        while True:
            frames = await sock.recv_multipart()
            try:
                view.message(frames)
            except EventError as exc:
                log.warning("KV events of %s: %s (view emptied)", decode.name, exc)
            changed(decode)
    finally:
        sock.close(linger=0)
        view.clear()
