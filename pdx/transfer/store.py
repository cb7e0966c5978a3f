"""The KV store held by the prefill side: byte budget, TTL + lease, release, LRU eviction.

Objects are kept as the encoded chunk messages that arrived (see ``kv_wire``), so a
Get sends the very bytes that were verified on Put. Every chunk is checked against
its XXH3-64 digest on arrival and the whole object against its digest before it becomes
readable. Deletions (release, expiry, eviction, abandoned uploads) are audited with
their reason and the object digest.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import xxhash

from pdx._proto import kv_transfer_pb2 as pb
from pdx.transfer.audit import AuditLog, digest_hex
from pdx.transfer.contract import (
    CHUNK_MIN_KB,
    TAIL_MAX_BYTES,
    TTL_MAX_S,
    TTL_MIN_S,
    Clock,
    KVError,
    KVErrorCode,
    KVStoreConfig,
    SystemClock,
    check_model_version,
    new_kv_id,
    parse_kv_id,
)
from pdx.transfer.metrics import KVMetrics
from pdx.transfer.wire import ChunkView, digest64, encode_chunk
from pdx.units import KIB

_TOMBSTONES = 100_000  # remembered deleted ids, so a late Get says why (expired/released)
_MAX_CHUNKS = 1 << 20


@dataclass
class StoredObject:
    """One object, complete or still uploading."""

    kv_id: str
    model_version: str
    created_at_ms: int
    created_s: float
    ttl_s: int
    layout: pb.Layout
    size_bytes: int
    chunk_size_bytes: int
    num_chunks: int
    object_digest: int
    upload_token: bytes
    owner: str
    messages: list[bytes | None] = field(default_factory=list)
    data: list[memoryview | None] = field(default_factory=list)
    digests: list[int] = field(default_factory=list)
    complete: bool = False
    lease_until_s: float = 0.0
    readers: int = 0
    hasher: Any = field(default_factory=xxhash.xxh3_64)
    hashed: int = 0  # chunks [0, hashed) are in ``hasher``: the object digest grows in order
    digest_pending: bool = False  # object_digest still to come in a PutTrailer
    buffer: memoryview | None = None  # the whole object, when it arrives over the data plane
    abandoned_s: float | None = None  # an upload that failed part-way, waiting for a retry
    abandon_reason: str = ""
    # The data plane's receiving thread may grow the digest too (see hash_verified).
    hash_lock: threading.Lock = field(default_factory=threading.Lock)
    # Streamed objects (rpc Open): readable while written. ``writing`` until the trailer
    # closes it; ``ended`` says why the writer ended it without closing it.
    writing: bool = False
    ended: str = ""
    final_chunks: int | None = None  # a short chunk arrived: the object ends there
    progress_s: float = 0.0  # last time the writer stored a chunk (or opened it)
    stored: int = 0  # chunks stored
    tail: bytes = b""
    open_reserved: int = 0  # counted in its owner's open bytes (KVStore._open_bytes)
    _changed: asyncio.Event | None = None

    def changed(self) -> asyncio.Event:
        """(readers) An event set at the next stored chunk, close or end."""
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def wake(self) -> None:
        """(store) Wake every reader waiting for this object to change."""
        event, self._changed = self._changed, None
        if event is not None:
            event.set()

    def hash_prefix(self) -> None:
        """Feed every newly contiguous chunk into the running object digest."""
        with self.hash_lock:
            while self.hashed < self.num_chunks and self.data[self.hashed] is not None:
                self.hasher.update(self.data[self.hashed])
                self.hashed += 1

    def hash_verified(self, index: int, data: memoryview) -> None:
        """(any thread) Grow the object digest by a verified chunk if it is the next one.

        The data plane checks chunks in its own thread and hands them to the store in
        one batch at the end; growing the digest there as they arrive keeps that pass off
        the store's loop. A chunk hashed here is always kept (``put_verified``).
        """
        with self.hash_lock:
            if self.hashed == index:
                self.hasher.update(data)
                self.hashed += 1

    def chunk_len(self, index: int) -> int:
        """Payload length of chunk ``index`` (the last one may be short)."""
        start = index * self.chunk_size_bytes
        return min(self.chunk_size_bytes, self.size_bytes - start)

    def expires_at_s(self) -> float:
        """TTL from creation, extended by a lease, never past the contract's maximum."""
        base = max(self.created_s + self.ttl_s, self.lease_until_s)
        return min(base, self.created_s + TTL_MAX_S)

    def missing(self) -> int:
        """Chunks not received yet."""
        return sum(1 for d in self.data if d is None)

    def chunk_message(self, index: int) -> bytes | None:
        """Chunk ``index`` as a gRPC chunk message.

        A chunk that came over the data plane has no message: one is built for each
        gRPC Get and not kept, so the object never takes twice its size in memory.
        """
        message = self.messages[index]
        if message is None:
            data = self.data[index]
            if data is None:
                return None
            return encode_chunk(index, data, self.digests[index])
        return message


class KVStore:
    """In-memory object store with the contract's lifetime rules. Not thread-safe: one loop."""

    def __init__(
        self,
        cfg: KVStoreConfig,
        *,
        clock: Clock | None = None,
        audit: AuditLog | None = None,
        metrics: KVMetrics | None = None,
    ) -> None:
        self.cfg = cfg
        self.clock = clock or SystemClock()
        self.audit = audit or AuditLog()
        self.metrics = metrics or KVMetrics()
        self._objects: OrderedDict[str, StoredObject] = OrderedDict()  # LRU order
        self._uploads: dict[bytes, StoredObject] = {}
        self._writing: dict[str, StoredObject] = {}  # streamed objects not closed yet, by id
        self._open_bytes: dict[str, int] = {}  # bytes reserved by each peer's open objects
        self._tombstones: OrderedDict[str, str] = OrderedDict()
        self.used_bytes = 0

    # --- put --------------------------------------------------------------------------

    def begin_put(self, header: pb.PutHeader, owner: str) -> StoredObject:
        """Start (or rejoin, by upload token) an upload; reserves its bytes in the budget."""
        pending = self._uploads.get(header.upload_token) if header.upload_token else None
        if pending is not None and pending.writing:
            self._check_writer(pending, header)
            return pending
        if pending is not None:
            self._check_rejoin(pending, header)
            pending.abandoned_s = None  # a retry came back for it
            return pending
        self._check_header(header)
        self._make_room(header.size_bytes)
        now_ms = self.clock.wall_ms()
        n = -(-header.size_bytes // header.chunk_size_bytes)
        obj = StoredObject(
            kv_id=new_kv_id(header.model_version, now_ms),
            model_version=header.model_version,
            created_at_ms=now_ms,
            created_s=self.clock.now_s(),
            ttl_s=header.ttl_s or self.cfg.kv_ttl_seconds,
            layout=header.layout,
            size_bytes=header.size_bytes,
            chunk_size_bytes=header.chunk_size_bytes,
            num_chunks=n,
            object_digest=header.object_digest,
            upload_token=header.upload_token,
            owner=owner,
            digest_pending=header.digest_in_trailer,
            messages=[None] * n,
            data=[None] * n,
            digests=[0] * n,
        )
        self.used_bytes += obj.size_bytes
        if header.upload_token:
            self._uploads[header.upload_token] = obj
        self._gauges()
        return obj

    def open(self, header: pb.PutHeader, owner: str, *, peer_cap: bool = True) -> StoredObject:
        """Create a streamed object (rpc Open): readable at once, written by one Put stream.

        ``header.size_bytes`` is an upper bound of the final size and is reserved in the
        budget now; TTL and lease run from now. ``peer_cap``: the bytes one peer may hold in
        objects it is still writing are capped (``max_open_bytes_per_peer``); the store's own
        process (prefill writing in-process) is not a peer.
        """
        problems = []
        if len(header.upload_token) != 16:
            problems.append("Open needs a 16-byte upload_token")
        if not header.digest_in_trailer or header.start_chunk:
            problems.append("Open needs digest_in_trailer and start_chunk 0")
        if header.upload_token in self._uploads:
            problems.append("upload_token already in use")
        if problems:
            raise KVError(KVErrorCode.KV_INVALID, "; ".join(problems))
        self._check_header(header)  # a malformed header is KV_INVALID before any budget check
        held, cap = self._open_bytes.get(owner, 0), self.cfg.open_bytes_per_peer
        if peer_cap and held + header.size_bytes > cap:
            raise KVError(
                KVErrorCode.KV_STORE_FULL,
                f"{owner} holds {held} bytes in objects it is still writing; "
                f"{header.size_bytes} more would pass its {cap} (max_open_bytes_per_peer)",
            )
        obj = self.begin_put(header, owner)
        self._open_bytes[owner] = held + obj.size_bytes
        obj.open_reserved = obj.size_bytes
        obj.writing = True
        obj.progress_s = obj.created_s
        self._writing[obj.kv_id] = obj
        return obj

    def _check_writer(self, obj: StoredObject, h: pb.PutHeader) -> None:
        """The Put stream of a streamed object: same size and chunk size, from chunk 0."""
        same = h.size_bytes == obj.size_bytes and h.chunk_size_bytes == obj.chunk_size_bytes
        if not same or h.start_chunk or not h.digest_in_trailer or obj.stored:
            raise KVError(
                KVErrorCode.KV_INVALID,
                "a streamed object is written by one Put stream from chunk 0 with "
                "digest_in_trailer, with its Open's size and chunk size",
                kv_id=obj.kv_id,
            )

    def close_streamed(self, obj: StoredObject, trailer: pb.PutTrailer) -> None:
        """The writer's trailer: final size, layout and tail; frees the unused reservation."""
        size = trailer.size_bytes or obj.size_bytes
        n = -(-size // obj.chunk_size_bytes)
        problems = []
        if size > obj.size_bytes:
            problems.append(f"final size {size} above the {obj.size_bytes} bytes reserved")
        elif obj.stored != n or any(d is None for d in obj.data[:n]):
            problems.append(f"closed with {obj.stored} chunks stored, {n} expected")
        elif n and len(obj.data[n - 1] or b"") != size - (n - 1) * obj.chunk_size_bytes:
            problems.append(f"final size {size} does not match the chunks stored")
        if len(trailer.tail) > TAIL_MAX_BYTES:
            problems.append(f"tail of {len(trailer.tail)} bytes (at most {TAIL_MAX_BYTES})")
        if problems:
            raise KVError(KVErrorCode.KV_INVALID, "; ".join(problems), kv_id=obj.kv_id)
        self.set_object_digest(obj, trailer.object_digest)
        self.used_bytes -= obj.size_bytes - size
        obj.size_bytes, obj.num_chunks = size, n
        del obj.messages[n:], obj.data[n:], obj.digests[n:]
        if trailer.HasField("layout"):
            obj.layout = trailer.layout
        obj.tail = bytes(trailer.tail)

    def lookup_any(self, kv_id: str) -> StoredObject:
        """A live object, complete or still being written (see :meth:`lookup`)."""
        obj = self._writing.get(kv_id)
        if obj is None:
            return self.lookup(kv_id)
        if self.clock.now_s() >= obj.expires_at_s():
            self._drop_upload(obj, "TTL passed while it was written")
            raise KVError(KVErrorCode.KV_EXPIRED, "TTL passed; object deleted", kv_id=kv_id)
        return obj

    def end_writing(self, obj: StoredObject, reason: str) -> None:
        """End a streamed object that will never be closed: readers get KV_INCOMPLETE."""
        if obj.writing and not obj.ended:
            self._drop_upload(obj, reason)

    def _check_header(self, h: pb.PutHeader) -> None:
        check_model_version(h.model_version)
        problems = []
        if h.ttl_s and not TTL_MIN_S <= h.ttl_s <= TTL_MAX_S:
            problems.append(f"ttl_s {h.ttl_s}: expected {TTL_MIN_S}-{TTL_MAX_S}")
        max_chunk = self.cfg.chunk_size_kb_max * KIB
        if not CHUNK_MIN_KB * KIB <= h.chunk_size_bytes <= max_chunk:
            problems.append(
                f"chunk_size_bytes {h.chunk_size_bytes}: expected {CHUNK_MIN_KB * KIB}-{max_chunk}"
            )
        elif -(-h.size_bytes // h.chunk_size_bytes) > _MAX_CHUNKS:
            problems.append(f"size_bytes {h.size_bytes}: more than {_MAX_CHUNKS} chunks")
        if h.size_bytes > self.cfg.budget_bytes:
            problems.append(f"size_bytes {h.size_bytes}: above budget {self.cfg.budget_bytes}")
        if h.start_chunk and not h.upload_token:
            problems.append("start_chunk > 0 needs an upload_token")
        if h.upload_token and len(h.upload_token) != 16:
            problems.append(f"upload_token: {len(h.upload_token)} bytes, expected 16")
        if h.digest_in_trailer and (h.start_chunk or h.object_digest):
            problems.append("digest_in_trailer needs start_chunk 0 and object_digest 0")
        if problems:
            raise KVError(KVErrorCode.KV_INVALID, "; ".join(problems))

    def _check_rejoin(self, obj: StoredObject, h: pb.PutHeader) -> None:
        same = (
            h.size_bytes == obj.size_bytes
            and h.chunk_size_bytes == obj.chunk_size_bytes
            and not h.digest_in_trailer  # a rejoining stream names the digest up front
            and (obj.digest_pending or h.object_digest == obj.object_digest)
        )
        if not same or h.start_chunk > obj.num_chunks:
            raise KVError(KVErrorCode.KV_INVALID, "upload_token reused for a different object")
        if obj.digest_pending:  # the first stream meant to send it last, and did not get there
            self.set_object_digest(obj, h.object_digest)

    def set_object_digest(self, obj: StoredObject, digest: int) -> None:
        """The object digest from a trailer (or a resumed stream's header)."""
        if obj.digest_pending:
            obj.object_digest = digest
            obj.digest_pending = False
        elif digest != obj.object_digest:
            raise KVError(
                KVErrorCode.KV_CORRUPT,
                f"object digest {digest:016x} != header {obj.object_digest:016x}",
                kv_id=obj.kv_id,
                resume_chunk=0,
            )

    def put_chunk(self, obj: StoredObject, chunk: ChunkView, message: bytes) -> None:
        """Verify one chunk (index, length, digest) and keep its message."""
        i = chunk.index
        if obj.writing:
            self._check_streamed_chunk(obj, i, len(chunk.data))
        elif i >= obj.num_chunks or len(chunk.data) != obj.chunk_len(i):
            raise KVError(
                KVErrorCode.KV_CORRUPT,
                f"chunk {i}: bad index or length {len(chunk.data)}",
                kv_id=obj.kv_id,
                resume_chunk=i,
            )
        if digest64(chunk.data) != chunk.digest:
            self.metrics.corrupt.labels(side="store").inc()
            raise KVError(
                KVErrorCode.KV_CORRUPT,
                f"chunk {i}: digest mismatch",
                kv_id=obj.kv_id,
                resume_chunk=i,
            )
        obj.messages[i] = message
        obj.data[i] = chunk.data
        obj.digests[i] = chunk.digest
        obj.hash_prefix()
        if obj.writing:
            obj.stored += 1
            obj.progress_s = self.clock.now_s()
            obj.wake()

    def _check_streamed_chunk(self, obj: StoredObject, i: int, n: int) -> None:
        """A streamed object's chunks are full-size, but for a last, shorter one."""
        bad = ""
        if i >= obj.num_chunks or obj.data[i] is not None:
            bad = "outside the reservation or sent twice"
        elif obj.final_chunks is not None and i >= obj.final_chunks:
            bad = "after the object's last (short) chunk"
        elif not 0 < n <= obj.chunk_len(i):
            bad = f"length {n}"
        if bad:
            raise KVError(KVErrorCode.KV_CORRUPT, f"chunk {i}: {bad}", kv_id=obj.kv_id,
                          resume_chunk=i)  # fmt: skip
        if n < obj.chunk_size_bytes:
            obj.final_chunks = i + 1

    def put_verified(
        self, obj: StoredObject, first: int, chunks: list[tuple[int, memoryview]]
    ) -> None:
        """Keep chunks ``first, first+1, ...`` that the data plane already checked.

        The data plane receives each chunk into its own buffer and verifies its length
        and digest in the receiving thread; here they only join the object, in the
        store's one thread.
        """
        for i, (digest, data) in enumerate(chunks, start=first):
            if i >= obj.num_chunks or len(data) != obj.chunk_len(i):
                raise KVError(
                    KVErrorCode.KV_INTERNAL, f"chunk {i}: unchecked chunk", kv_id=obj.kv_id
                )
            obj.data[i] = data
            obj.digests[i] = digest
        obj.hash_prefix()

    def finish_put(self, obj: StoredObject) -> int:
        """Complete the object if every chunk is in (after checking its digest); return missing."""
        if obj.complete:
            return 0
        missing = obj.missing()
        if missing:
            return missing
        if obj.digest_pending:
            self._drop_upload(obj, "no trailer")
            raise KVError(
                KVErrorCode.KV_INVALID,
                "Put stream ended without the trailer its header announced",
                kv_id=obj.kv_id,
            )
        obj.hash_prefix()
        h = obj.hasher.intdigest()
        if h != obj.object_digest:
            self._drop_upload(obj, "corrupt")
            raise KVError(
                KVErrorCode.KV_CORRUPT,
                f"object digest {h:016x} != header {obj.object_digest:016x}",
                kv_id=obj.kv_id,
                resume_chunk=0,
            )
        obj.complete = True
        self._uploads.pop(obj.upload_token, None)
        self._objects[obj.kv_id] = obj
        if obj.writing:
            obj.writing = False
            self._writing.pop(obj.kv_id, None)
            self._unreserve(obj)
            obj.wake()
        self._gauges()
        return 0

    def _unreserve(self, obj: StoredObject) -> None:
        """An open object closed or ended: its writer's open reservation is given back."""
        left = self._open_bytes.get(obj.owner, 0) - obj.open_reserved
        obj.open_reserved = 0
        if left > 0:
            self._open_bytes[obj.owner] = left
        else:
            self._open_bytes.pop(obj.owner, None)

    def abandon(self, obj: StoredObject, reason: str) -> None:
        """An upload failed part-way: forget it now, or (with an upload token to rejoin it)
        after ``upload_resume_s``, so its reservation never outlives a retry's window."""
        if obj.complete:
            return
        if obj.writing:  # its readers wait: end it now, no resume window
            self._drop_upload(obj, f"writer failed: {reason}")
        elif not obj.upload_token or self.cfg.upload_resume_s <= 0:
            self._drop_upload(obj, reason)
        else:
            obj.abandoned_s = self.clock.now_s()
            obj.abandon_reason = reason

    def check_reader(self, obj: StoredObject, who: str) -> None:
        """Only the writer and the configured readers may read or release an object."""
        readers = self.cfg.readers
        if who == obj.owner or "*" in readers:
            return
        name = who.split("=", 1)[1] if "=" in who else who
        if name in readers and who.split("=", 1)[0] in ("cn", "client"):
            return
        raise KVError(
            KVErrorCode.KV_UNAUTHENTICATED,
            f"{who} may not read objects written by {obj.owner} (readers: {', '.join(readers)})",
            kv_id=obj.kv_id,
        )

    def _drop_upload(self, obj: StoredObject, reason: str) -> None:
        if self._uploads.get(obj.upload_token) is obj:
            del self._uploads[obj.upload_token]
        if not obj.complete:
            obj.complete = True  # never readable; guards against double accounting
            self.used_bytes -= obj.size_bytes
            if obj.writing:
                obj.ended = reason
                self._writing.pop(obj.kv_id, None)
                self._unreserve(obj)
                self._tombstones[obj.kv_id] = f"incomplete: {reason}"
                obj.wake()
            self._deleted(obj, "abandon", reason, None)

    # --- read / lifetime --------------------------------------------------------------

    def lookup(self, kv_id: str) -> StoredObject:
        """A complete, live object (refreshing its LRU position); else NOT_FOUND/EXPIRED."""
        obj = self._objects.get(kv_id)
        if obj is None:
            why = self._tombstones.get(kv_id)
            parse_kv_id(kv_id)  # malformed ids are KV_INVALID
            if why == "expired":
                raise KVError(KVErrorCode.KV_EXPIRED, "TTL passed; object deleted", kv_id=kv_id)
            if why and why.startswith("incomplete: "):
                raise KVError(KVErrorCode.KV_INCOMPLETE, why, kv_id=kv_id)
            detail = f"{why}" if why else "no such object"
            raise KVError(KVErrorCode.KV_NOT_FOUND, detail, kv_id=kv_id)
        if self.clock.now_s() >= obj.expires_at_s():
            self._delete(obj, "expire", "expired", None)
            raise KVError(KVErrorCode.KV_EXPIRED, "TTL passed; object deleted", kv_id=kv_id)
        self._objects.move_to_end(kv_id)
        return obj

    def release(self, kv_id: str, who: str) -> StoredObject:
        """The consumer's acknowledgement: delete now (ends an object still being written)."""
        obj = self.lookup_any(kv_id)
        if obj.writing:
            self._drop_upload(obj, f"released by {who} while it was written")
            self._tombstones[obj.kv_id] = "released"
            self.metrics.released.inc()
            return obj
        self._delete(obj, "release", "released", who)
        self.metrics.released.inc()
        return obj

    def renew(self, kv_id: str, lease_s: int) -> StoredObject:
        """Extend the lease to now + ``lease_s`` (capped by config and the TTL maximum)."""
        obj = self.lookup_any(kv_id)
        lease = min(lease_s or self.cfg.lease_s, self.cfg.lease_s)
        obj.lease_until_s = max(obj.lease_until_s, self.clock.now_s() + lease)
        return obj

    def sweep(self) -> int:
        """Delete every expired object and abandoned upload; return how many."""
        now = self.clock.now_s()
        due = [o for o in self._objects.values() if now >= o.expires_at_s()]
        for obj in due:
            self._delete(obj, "expire", "expired", None)
        stale = [o for o in self._uploads.values() if now >= o.expires_at_s()]
        for obj in stale:
            self._drop_upload(obj, "upload not finished before TTL")
        stall = self.cfg.stall_timeout_s
        stuck = [o for o in self._writing.values() if now - o.progress_s >= stall]
        for obj in stuck:
            self._drop_upload(obj, f"writer made no progress for {stall:g} s")
        due += stuck
        resume = self.cfg.upload_resume_s
        gone = [o for o in self._uploads.values()
                if o.abandoned_s is not None and now - o.abandoned_s >= resume]  # fmt: skip
        for obj in gone:
            self._drop_upload(obj, f"{obj.abandon_reason}; not resumed within {resume:g} s")
        return len(due) + len(stale) + len(gone)

    def info(self, obj: StoredObject) -> pb.ObjectInfo:
        """The wire description of an object."""
        expires_ms = obj.created_at_ms + int((obj.expires_at_s() - obj.created_s) * 1000)
        return pb.ObjectInfo(
            kv_id=obj.kv_id,
            model_version=obj.model_version,
            created_at_ms=obj.created_at_ms,
            ttl_s=obj.ttl_s,
            layout=obj.layout,
            size_bytes=obj.size_bytes,
            chunk_size_bytes=obj.chunk_size_bytes,
            num_chunks=obj.num_chunks,
            object_digest=obj.object_digest,
            expires_at_ms=expires_ms,
            chunk_digests=obj.digests,
            writing=obj.writing,
            chunks_stored=obj.stored if obj.writing else obj.num_chunks,
            tail=obj.tail,
        )

    def __len__(self) -> int:
        return len(self._objects)

    # --- budget -----------------------------------------------------------------------

    def _make_room(self, size_bytes: int) -> None:
        """LRU-evict unleased, unread objects until ``size_bytes`` fits, else KV_STORE_FULL."""
        budget = self.cfg.budget_bytes
        if self.used_bytes + size_bytes <= budget:
            return
        now = self.clock.now_s()
        for obj in list(self._objects.values()):
            if self.used_bytes + size_bytes <= budget:
                break
            if now >= obj.expires_at_s():
                self._delete(obj, "expire", "expired", None)
            elif obj.lease_until_s <= now and obj.readers == 0:
                self._delete(obj, "evict", "over byte budget (LRU)", None)
                self.metrics.evicted.inc()
        if self.used_bytes + size_bytes > budget:
            raise KVError(
                KVErrorCode.KV_STORE_FULL,
                f"{size_bytes} bytes do not fit: {self.used_bytes} of {budget} held by "
                "leased, in-use or uploading objects",
            )

    def _delete(self, obj: StoredObject, event: str, reason: str, who: str | None) -> None:
        if self._objects.pop(obj.kv_id, None) is None:
            return
        self.used_bytes -= obj.size_bytes
        self._tombstones[obj.kv_id] = reason
        while len(self._tombstones) > _TOMBSTONES:
            self._tombstones.popitem(last=False)
        if event == "expire":
            self.metrics.expired.inc()
        self._deleted(obj, event, reason, who)

    def _deleted(self, obj: StoredObject, event: str, reason: str, who: str | None) -> None:
        self.audit.record(
            event,
            who=who or "store",
            kv_id=obj.kv_id,
            bytes=obj.size_bytes,
            outcome="deleted",
            reason=reason,
            object_digest=digest_hex(obj.object_digest),
        )
        self._gauges()

    def _gauges(self) -> None:
        self.metrics.store_bytes.set(self.used_bytes)
        self.metrics.store_objects.set(len(self._objects))
