"""The interface of a streamed object's writer, over gRPC or into a store in this process.

:class:`pdx.transfer.client.StreamWriter` and :class:`pdx.transfer.local.LocalWriter`
implement it.
"""

from __future__ import annotations

from typing import Protocol

from pdx._proto import kv_transfer_pb2 as pb
from pdx.transfer.contract import KVLayout


class KVWriter(Protocol):
    """Writes one streamed object: ``write`` bytes in order, then ``close`` (or ``abort``)."""

    @property
    def kv_id(self) -> str:
        """The object's id, known from the start."""
        ...

    @property
    def written(self) -> int:
        """Bytes handed to :meth:`write` so far."""
        ...

    @property
    def sent(self) -> int:
        """Bytes that left the writer so far (sent, or stored)."""
        ...

    @property
    def overlap(self) -> tuple[int, float] | None:
        """``(bytes sent, ms since open)`` when :meth:`mark_overlap` was called."""
        ...

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append bytes; every full chunk leaves at once."""
        ...

    def mark_overlap(self) -> None:
        """The producer finished computing: record what had left by now."""
        ...

    async def close(self, layout: KVLayout | None = None, tail: bytes = b"") -> pb.ObjectInfo:
        """Finish the object (final size, layout, tail, digest); its info."""
        ...

    def abort(self) -> None:
        """Stop writing: the store ends the object (readers get KV_INCOMPLETE)."""
        ...
