"""KV state ↔ one byte object plus a layout: the form the KV store holds and ships.

Each tensor is encoded on its own by a measure-kv codec (keys and values get their role, so
lossy codecs group scales the KIVI way) and the encodings are concatenated; the layout
records shapes, dtype, codec and each encoded length so the receiver can split and rebuild.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pdx.errors import InputError
from pdx.kv.codecs import get_codec

if TYPE_CHECKING:
    from pdx.serving.backends.base import KVState, ModelBackend


@dataclass
class EncodedKV:
    """Encoded KV ready for a store ``Put``."""

    payload: bytes
    layout: dict[str, Any] = field(default_factory=dict)
    raw_bytes: int = 0


def encode_kv(state: KVState, codec: str, num_layers: int) -> EncodedKV:
    """Encode every tensor with ``codec`` and describe the result."""
    enc = get_codec(codec)
    roles = state.roles or ["other"] * len(state.tensors)
    blobs = [enc.encode(t, role) for t, role in zip(state.tensors, roles, strict=True)]
    layout = {
        "num_layers": num_layers,
        "dtype": str(state.tensors[0].dtype).removeprefix("torch.") if state.tensors else "",
        "shapes": [list(t.shape) for t in state.tensors],
        "codec": codec,
        "tensor_bytes": [len(b) for b in blobs],
        "roles": list(roles),
    }
    return EncodedKV(payload=b"".join(blobs), layout=layout, raw_bytes=state.nbytes)


def decode_kv(
    payload: bytes | memoryview, layout: dict[str, Any], backend: ModelBackend, length: int
) -> KVState:
    """Split ``payload`` by the layout's encoded lengths, decode each tensor, rebuild the state."""
    dec = get_codec(layout["codec"])
    view = memoryview(payload)
    sizes = list(layout["tensor_bytes"])
    if sum(sizes) != len(view):
        raise InputError("kv payload", f"{len(view)} bytes", f"{sum(sizes)} bytes per its layout")
    tensors, offset = [], 0
    for size, shape in zip(sizes, layout["shapes"], strict=True):
        tensor = dec.decode(view[offset : offset + size])
        if list(tensor.shape) != list(shape):
            raise InputError("kv tensor shape", list(tensor.shape), f"{list(shape)}")
        tensors.append(tensor)
        offset += size
    return backend.kv_from_tensors(tensors, length)


class StreamRebuild:
    """Rebuild a streamed object's tensors while its bytes arrive (decode, kv.streaming).

    With the ``raw`` codec each tensor's encoded length follows from its frame header, so a
    tensor is decoded as soon as its last byte is in: the rebuild overlaps the transfer.
    Other codecs' lengths are known only from the closed object's layout: they are decoded
    at :meth:`finish`. Every byte fed here was checked against its chunk digest; ``finish``
    runs only after the whole object's digest matched, and checks every tensor against the
    closed layout.
    """

    def __init__(self, codec: str) -> None:
        self.codec = codec
        self.early = codec == "raw"
        self.decoder = get_codec(codec)
        self.pending: list[memoryview] = []
        self.pending_len = 0
        self.tensors: list[Any] = []
        self.sizes: list[int] = []
        self.failed: InputError | None = None
        self.decode_s = 0.0  # time spent decoding as bytes arrived

    def feed(self, data: memoryview) -> None:
        """The next bytes of the object, in order."""
        if not self.early or self.failed is not None:
            return
        self.pending.append(data)
        self.pending_len += len(data)
        t0 = time.perf_counter()
        try:
            while (head := self._next_header()) is not None:
                meta, head_len, n = head
                if self.pending_len < n:
                    break
                self.tensors.append(self._take_tensor(meta, head_len, n))
                self.sizes.append(n)
        except InputError as exc:  # judged at finish, against the closed layout
            self.failed = exc
        self.decode_s += time.perf_counter() - t0

    def _peek(self, n: int) -> bytes:
        out = bytearray()
        for piece in self.pending:
            out += piece[: n - len(out)]
            if len(out) >= n:
                break
        return bytes(out)

    def _take_tensor(self, meta: dict[str, Any], head_len: int, n: int) -> torch.Tensor:
        """The next ``n`` bytes (a raw frame) as a tensor: one copy, into its own memory."""
        from pdx.kv.codecs.base import dtype_from_name

        out = bytearray(n - head_len)
        done = 0  # bytes of the frame taken so far
        while done < n:
            piece = self.pending[0]
            use = min(len(piece), n - done)
            lo = max(done, head_len)  # the payload part of frame bytes [done, done + use)
            if done + use > lo:
                out[lo - head_len : done + use - head_len] = piece[lo - done : use]
            done += use
            if use == len(piece):
                self.pending.pop(0)
            else:
                self.pending[0] = piece[use:]
        self.pending_len -= n
        dtype = dtype_from_name(meta["dtype"])
        u8 = torch.uint8
        flat = torch.frombuffer(out, dtype=u8) if out else torch.empty(0, dtype=u8)
        return flat.view(dtype).reshape([int(d) for d in meta["shape"]])

    def _next_header(self) -> tuple[dict[str, Any], int, int] | None:
        """The next raw frame's header, its length and the frame's length (None: not in yet)."""
        from pdx.kv.codecs.base import _HEADER, _MAGIC, dtype_from_name

        if self.pending_len < _HEADER.size:
            return None
        magic, head_len = _HEADER.unpack(self._peek(_HEADER.size))
        if magic != _MAGIC or head_len > 1 << 16:
            raise InputError("kv payload", "bad frame header", "a raw codec frame")
        if self.pending_len < _HEADER.size + head_len:
            return None
        meta = json.loads(self._peek(_HEADER.size + head_len)[_HEADER.size :])
        if not isinstance(meta, dict) or meta.get("codec") != "raw":
            raise InputError("kv payload", "frame header", "a raw codec frame")
        numel = math.prod(int(d) for d in meta["shape"])
        item = torch.empty((), dtype=dtype_from_name(meta["dtype"])).element_size()
        return meta, _HEADER.size + head_len, int(_HEADER.size + head_len + numel * item)

    def finish(
        self, payload: Callable[[], bytes | memoryview], size: int, layout: dict[str, Any],
        backend: ModelBackend, length: int,
    ) -> KVState:  # fmt: skip
        """The state, once the whole object (``size`` bytes; ``payload()`` joins them only
        when something is left to decode) is in and verified."""
        if not self.early or self.failed is not None:
            return decode_kv(payload(), layout, backend, length)
        sizes, shapes = list(layout["tensor_bytes"]), list(layout["shapes"])
        if self.sizes != sizes[: len(self.sizes)] or sum(sizes) != size:
            raise InputError("kv payload", "tensor lengths", "the closed object's layout")
        offset = sum(self.sizes)
        rest = sizes[len(self.sizes) :]
        view = memoryview(payload()) if rest else memoryview(b"")
        for size in rest:  # whatever did not complete early
            self.tensors.append(self.decoder.decode(view[offset : offset + size]))
            offset += size
        for tensor, shape in zip(self.tensors, shapes, strict=True):
            if list(tensor.shape) != list(shape):
                raise InputError("kv tensor shape", list(tensor.shape), f"{list(shape)}")
        return backend.kv_from_tensors(self.tensors, length)
