"""Writing a streamed object into a store held by this very process (prefill's own store).

:class:`LocalWriter` follows the rules of ``Open`` + ``Put`` (the reservation taken up front,
every chunk checked against its digest, the object digest at close, the stall sweep, the
audit) but hands chunks to the store directly instead of serializing them through a
loopback gRPC stream: in one Python process that stream costs as much CPU as the transfer
itself. Readers see no difference: they Get the object over the contract as always.
"""

from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING

import xxhash

from pdx._proto import kv_transfer_pb2 as pb
from pdx.transfer.contract import KVError, KVErrorCode, KVLayout
from pdx.transfer.wire import ChunkView, digest64, rechunk
from pdx.transfer.writer import KVWriter

if TYPE_CHECKING:
    from pdx.transfer.service import KVService


class LocalWriter:
    """A :class:`~pdx.transfer.writer.KVWriter` like :class:`pdx.transfer.client.StreamWriter`,
    in-process."""

    def __init__(
        self,
        service: KVService,
        reserve_bytes: int,
        layout: KVLayout,
        *,
        chunk_size_bytes: int,
        model_version: str,
        ttl_s: int,
        who: str,
    ) -> None:
        self.service, self.store, self.who = service, service.store, who
        header = pb.PutHeader(
            model_version=model_version, ttl_s=ttl_s, layout=layout.to_proto(),
            size_bytes=reserve_bytes, chunk_size_bytes=chunk_size_bytes,
            upload_token=secrets.token_bytes(16), digest_in_trailer=True,
        )  # fmt: skip
        self.header = header
        t0 = time.perf_counter()
        try:
            self.obj = self.store.open(header, who, peer_cap=False)
        except KVError as exc:
            self._audit("open", "", reserve_bytes, exc.code.value, t0, reason=exc.message)
            raise
        self.kv_id = self.obj.kv_id
        self._audit("open", self.kv_id, reserve_bytes, "ok", t0)
        self.chunk = chunk_size_bytes
        self.reserve = reserve_bytes
        self._buf = bytearray()
        self._index = 0
        self._hash = xxhash.xxh3_64()
        self.written = 0
        self.sent = 0  # bytes stored (readable) so far
        self.opened_s = t0
        self.overlap: tuple[int, float] | None = None
        self._closed = False

    def _audit(self, event: str, kv_id: str, nbytes: int, outcome: str, t0: float,
               **extra: object) -> None:  # fmt: skip
        ms = round((time.perf_counter() - t0) * 1000, 3)
        self.service.audit.record(event, who=self.who, peer="local", kv_id=kv_id or None,
                                  bytes=nbytes, outcome=outcome, ms=ms, transport="local",
                                  **extra)  # fmt: skip

    def _store(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        self._hash.update(view)
        digest = digest64(view)
        try:
            self.store.put_chunk(self.obj, ChunkView(self._index, digest, view), None)  # type: ignore[arg-type]
        except KVError:
            self.abort()
            raise
        self._index += 1
        self.sent += len(view)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append bytes; every full chunk is stored (and readable) at once."""
        if self._closed or self.obj.ended:
            why = self.obj.ended or "write after close"
            raise KVError(KVErrorCode.KV_INCOMPLETE, why, kv_id=self.kv_id)
        view = memoryview(data).cast("B")
        if self.written + len(view) > self.reserve:
            self.abort()
            raise KVError(
                KVErrorCode.KV_INVALID,
                f"{self.written + len(view)} bytes written, {self.reserve} reserved",
                kv_id=self.kv_id,
            )
        self.written += len(view)
        rechunk(self._buf, view, self.chunk, self._store)

    def mark_overlap(self) -> None:
        """The producer finished computing: what was stored by now overlapped it."""
        self.overlap = (self.sent, (time.perf_counter() - self.opened_s) * 1e3)

    async def close(self, layout: KVLayout | None = None, tail: bytes = b"") -> pb.ObjectInfo:
        """Store the last chunk, then close the object (final size, layout, tail, digest)."""
        self._closed = True
        if self._buf or not self.written:
            self._store(bytes(self._buf))
            self._buf.clear()
        trailer = pb.PutTrailer(object_digest=self._hash.intdigest(), size_bytes=self.written,
                                tail=tail)  # fmt: skip
        if layout is not None:
            trailer.layout.CopyFrom(layout.to_proto())
        try:
            self.store.close_streamed(self.obj, trailer)
            missing = self.store.finish_put(self.obj)
            if missing:
                raise KVError(KVErrorCode.KV_INTERNAL, f"{missing} chunks missing at close",
                              kv_id=self.kv_id)  # fmt: skip
        except KVError as exc:
            self.abort()
            self._audit("put", self.kv_id, self.written, exc.code.value, self.opened_s,
                        reason=exc.message, streamed=True)  # fmt: skip
            raise
        self.service.metrics.bytes.labels(op="put", side="store").inc(self.written)
        self._audit("put", self.kv_id, self.written, "ok", self.opened_s, streamed=True)
        return self.store.info(self.obj)

    def abort(self) -> None:
        """Stop writing: the store ends the object (readers get KV_INCOMPLETE)."""
        if not self.obj.complete:
            self.store.end_writing(self.obj, "the writer stopped before closing it")


_writer: type[KVWriter] = LocalWriter  # mypy checks that it implements KVWriter
