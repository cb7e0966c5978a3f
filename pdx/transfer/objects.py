"""KV objects on the client side: encoding tensors into a payload, assembling and verifying
a fetched object from chunks that arrive over one or more streams.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import xxhash

from pdx._proto import kv_transfer_pb2 as pb
from pdx.transfer.contract import KVError, KVErrorCode, KVLayout
from pdx.transfer.dataplane.framing import BUFFERS
from pdx.transfer.wire import digest64, parse_chunk

if TYPE_CHECKING:
    import torch


class KVObject:
    """A fetched, verified object: its description and its chunks (no copy on receipt).

    ``chunks`` are views into the received messages; ``data`` joins them into one
    buffer on first use; ``tensors()`` decodes with the codec the layout records.
    """

    def __init__(
        self, info: pb.ObjectInfo, chunks: list[memoryview], data: memoryview | None = None
    ) -> None:
        self.info = info
        self.chunks = chunks
        self._data: bytes | memoryview | None = data

    @property
    def kv_id(self) -> str:
        """The object's id."""
        return self.info.kv_id

    @property
    def layout(self) -> KVLayout:
        """How the bytes map to tensors."""
        return KVLayout.from_proto(self.info.layout)

    @property
    def data(self) -> bytes | memoryview:
        """The whole object as one buffer (joined once, then cached; the data plane
        receives into one buffer, so there is nothing to join)."""
        if self._data is None:
            self._data = b"".join(self.chunks)
        return self._data

    def __len__(self) -> int:
        return int(self.info.size_bytes)

    def tensors(self) -> list[torch.Tensor]:
        """Decode every tensor with the codec the layout records."""
        from pdx.kv.codecs import get_codec

        layout = self.layout
        codec = get_codec(layout.codec)
        view = memoryview(self.data)
        out, pos = [], 0
        for n in layout.tensor_bytes:
            out.append(codec.decode(view[pos : pos + n]))
            pos += n
        return out


def encode_tensors(
    tensors: Sequence[torch.Tensor], codec: str = "raw", roles: Sequence[str] | None = None
) -> tuple[bytes, KVLayout]:
    """Encode tensors with a registered codec into one payload and the layout describing it."""
    from pdx.kv.codecs import get_codec
    from pdx.kv.codecs.base import dtype_name

    c = get_codec(codec)
    if roles is None:
        roles = ["key" if i % 2 == 0 else "value" for i in range(len(tensors))]
    parts = [c.encode(t, role) for t, role in zip(tensors, roles, strict=True)]  # type: ignore[arg-type]
    layout = KVLayout(
        codec=codec,
        dtype=dtype_name(tensors[0].dtype) if tensors else "",
        num_layers=len(tensors) // 2,
        shapes=[list(t.shape) for t in tensors],
        tensor_bytes=[len(p) for p in parts],
        roles=list(roles),
    )
    return b"".join(parts), layout


class Assembly:
    """Chunks of one object arriving over one or more streams, each verified on receipt."""

    def __init__(self, kv_id: str) -> None:
        self.kv_id = kv_id
        self.info: pb.ObjectInfo | None = None
        self.chunks: list[memoryview | None] = []
        self.whole = xxhash.xxh3_64()
        self.hashed = 0
        # Data plane: every chunk lands in this one buffer, filled by worker threads.
        self.buffer: memoryview | None = None
        self.in_buffer = 0  # chunks that arrived there (the rest came over gRPC)
        self.lock = threading.Lock()

    def accept_info(self, info: pb.ObjectInfo) -> None:
        """Check the object description (and that it did not change between streams)."""
        with self.lock:
            self._accept_info(info)

    def _accept_info(self, info: pb.ObjectInfo) -> None:
        known = self.info
        if known is not None and (
            known.object_digest != info.object_digest or known.size_bytes != info.size_bytes
        ):
            raise self.corrupt(None, "object changed between reads")
        if info.kv_id != self.kv_id or len(info.chunk_digests) != info.num_chunks:
            raise self.corrupt(None, "malformed object info")
        if known is None:
            self.info = info
            self.chunks = [None] * info.num_chunks

    def add(self, index: int, raw: bytes) -> None:
        """Verify chunk ``index`` (index, length, digest vs message and vs info) and keep it."""
        info = self.info
        if info is None:
            raise self.corrupt(index, "chunk before object info")
        try:
            chunk = parse_chunk(raw)
        except ValueError as exc:
            raise self.corrupt(index, str(exc)) from None
        expected_len = min(info.chunk_size_bytes, info.size_bytes - index * info.chunk_size_bytes)
        if chunk.index != index or index >= info.num_chunks or len(chunk.data) != expected_len:
            raise self.corrupt(index, f"got chunk {chunk.index} of {len(chunk.data)} bytes")
        if chunk.digest != info.chunk_digests[index] or digest64(chunk.data) != chunk.digest:
            raise self.corrupt(index, "digest mismatch")
        self.chunks[index] = chunk.data
        self._hash_prefix()

    def slot(self, index: int, digest: int, length: int) -> memoryview:
        """(data plane) Check a chunk header against the object info; where its bytes go."""
        info = self.info
        if info is None:
            raise self.corrupt(index, "chunk before object info")
        size = info.chunk_size_bytes
        expected_len = min(size, info.size_bytes - index * size)
        if index >= info.num_chunks or length != expected_len:
            raise self.corrupt(index, f"got {length} bytes, expected {expected_len}")
        if digest != info.chunk_digests[index]:
            raise self.corrupt(index, "digest differs from the object info")
        with self.lock:
            if self.buffer is None:
                self.buffer = BUFFERS.get(info.size_bytes)
        return self.buffer[index * size : index * size + length]

    def add_view(self, index: int, digest: int, view: memoryview) -> None:
        """(data plane) Verify the bytes that arrived in :meth:`slot`'s view and keep them."""
        if digest64(view) != digest:
            raise self.corrupt(index, "digest mismatch")
        with self.lock:
            if self.chunks[index] is None:
                self.in_buffer += 1
            self.chunks[index] = view
            self._hash_prefix()

    def received_bytes(self) -> int:
        """Bytes of the chunks verified so far (what a timed-out Get did move)."""
        info = self.info
        if info is None:
            return 0
        size, total = info.chunk_size_bytes, info.size_bytes
        return sum(min(size, total - k * size) for k, c in enumerate(self.chunks) if c is not None)

    def _hash_prefix(self) -> None:
        while self.hashed < len(self.chunks) and self.chunks[self.hashed] is not None:
            self.whole.update(self.chunks[self.hashed])  # type: ignore[arg-type]
            self.hashed += 1

    def finish(self) -> KVObject:
        """Check the whole-object digest (grown in chunk order as chunks arrived)."""
        info = self.info
        with self.lock:
            self._hash_prefix()
        if info is None or self.hashed != len(self.chunks):
            raise self.corrupt(0, "object incomplete")
        got = self.whole.intdigest()
        if got != info.object_digest:
            raise self.corrupt(0, f"object digest {got:016x} != {info.object_digest:016x}")
        joined = self.buffer if self.in_buffer == len(self.chunks) else None
        return KVObject(info, self.chunks, joined)  # type: ignore[arg-type]

    def corrupt(self, index: int | None, why: str) -> KVError:
        """A KV_CORRUPT error resuming at ``index``."""
        where = f"chunk {index}: " if index is not None else ""
        return KVError(KVErrorCode.KV_CORRUPT, where + why, kv_id=self.kv_id, resume_chunk=index)


class StreamAssembly(Assembly):
    """A Get of a streamed object: chunks verified by their own digest as they arrive, then
    against the closed object's info (every chunk digest and the object digest)."""

    def __init__(
        self, kv_id: str, on_chunk: Callable[[pb.ObjectInfo, memoryview], None] | None = None
    ) -> None:
        super().__init__(kv_id)
        self.on_chunk = on_chunk  # each verified chunk, in order (a consumer rebuilding early)
        self.stored_at_start = 0  # chunks the store held when the Get began
        self.closed: pb.ObjectInfo | None = None
        self.first_s = 0.0  # perf_counter() at the first info and at the closed info
        self.closed_s = 0.0
        self.digests: dict[int, int] = {}  # verified digest of each chunk received

    def _accept_info(self, info: pb.ObjectInfo) -> None:
        if info.kv_id != self.kv_id or len(info.chunk_digests) != info.num_chunks:
            raise self.corrupt(None, "malformed object info")
        if self.info is None:
            self.info = info
            self.chunks = [None] * info.num_chunks
            self.stored_at_start = info.chunks_stored
        elif not info.writing:
            self.close(info)

    def add(self, index: int, raw: bytes) -> None:
        """Verify a chunk of an object that may still be written (its own digest)."""
        info = self.info
        if info is None or not info.writing or self.closed is not None:
            super().add(index, raw)
            if self.on_chunk is not None and info is not None:
                self.on_chunk(info, self.chunks[index])  # type: ignore[arg-type]
            return
        try:
            chunk = parse_chunk(raw)
        except ValueError as exc:
            raise self.corrupt(index, str(exc)) from None
        ok_len = 0 < len(chunk.data) <= info.chunk_size_bytes
        if chunk.index != index or index >= info.num_chunks or not ok_len:
            raise self.corrupt(index, f"got chunk {chunk.index} of {len(chunk.data)} bytes")
        if digest64(chunk.data) != chunk.digest:
            raise self.corrupt(index, "digest mismatch")
        self.chunks[index] = chunk.data
        self.digests[index] = chunk.digest
        self._hash_prefix()
        if self.on_chunk is not None:
            self.on_chunk(info, chunk.data)

    def close(self, info: pb.ObjectInfo) -> None:
        """The closed object's info: its final size, layout and digests."""
        first = self.info
        assert first is not None
        if info.size_bytes > first.size_bytes or info.chunk_size_bytes != first.chunk_size_bytes:
            raise self.corrupt(None, "closed object larger than its reservation")
        n = int(info.num_chunks)
        if any(c is not None for c in self.chunks[n:]):
            raise self.corrupt(n, "chunks past the closed object's end")
        del self.chunks[n:]
        size = info.chunk_size_bytes
        for i, data in enumerate(self.chunks):
            if data is None:
                continue
            if len(data) != min(size, info.size_bytes - i * size):
                raise self.corrupt(i, "length differs from the closed object's")
            # Verified on receipt against its own digest: now against the closed object's.
            if self.digests.get(i, info.chunk_digests[i]) != info.chunk_digests[i]:
                raise self.corrupt(i, "digest differs from the closed object's")
        self.info = self.closed = info
