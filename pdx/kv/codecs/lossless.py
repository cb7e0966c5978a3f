"""Lossless codecs: zstd and lz4, on the raw bytes or on byte planes.

Byte planes: each 2- or 4-byte element has its sign bit rotated to the lowest bit, then
the tensor is split into byte planes (for bf16: a plane of exponents, highly repetitive
in KV, and a plane of sign + mantissa, nearly random), each compressed on its own; a
plane the compressor cannot shrink (probed on its first 64 KiB) is stored as is.
"""

from __future__ import annotations

from typing import Any, ClassVar

import lz4.frame
import numpy as np
import torch
import zstandard

from pdx.kv.codecs.base import (
    KVCodec,
    Role,
    dtype_from_name,
    dtype_name,
    pack,
    payload_errors,
    unpack_for,
)
from pdx.kv.codecs.tensorio import tensor_bytes, tensor_from_bytes

ZSTD_LEVEL = 1  # on KV byte planes level 1 compresses as well as 3, twice as fast
LZ4_LEVEL = 0


_UINT = {2: np.uint16, 4: np.uint32}
#: A plane whose first 64 KiB zstd/lz4 cannot shrink by 3 % is stored as is (mantissa planes).
_PROBE_BYTES = 64 * 1024
_PROBE_MIN_RATIO = 1.03


def to_planes(raw: memoryview, itemsize: int) -> list[bytes]:
    """Little-endian elements → ``itemsize`` byte planes, most significant first.

    The sign bit is first rotated to the lowest bit, so the top plane holds exponent bits
    alone (bf16: all 8) and compresses well; the sign joins the noisy mantissa plane.
    """
    words = np.frombuffer(raw, dtype=_UINT[itemsize])
    bits = 8 * itemsize
    rotated = (words << 1) | (words >> (bits - 1))
    return [(rotated >> (8 * k)).astype(np.uint8).tobytes() for k in reversed(range(itemsize))]


def from_planes(planes: list[bytes], itemsize: int) -> bytes:
    """Inverse of :func:`to_planes`."""
    kind = _UINT[itemsize]
    rotated = np.zeros(len(planes[0]), dtype=kind)
    for k, plane in zip(reversed(range(itemsize)), planes, strict=True):
        rotated |= np.frombuffer(plane, dtype=np.uint8).astype(kind) << kind(8 * k)
    bits = 8 * itemsize
    return ((rotated >> kind(1)) | (rotated << kind(bits - 1))).tobytes()


class _Lossless(KVCodec):
    lossless = True
    planes: ClassVar[bool] = False

    def _compress(self, raw: bytes | memoryview) -> bytes:
        raise NotImplementedError

    def _decompress(self, data: bytes | memoryview, size: int) -> bytes:
        raise NotImplementedError

    def _pack_plane(self, plane: bytes) -> tuple[str, bytes]:
        probe = plane[:_PROBE_BYTES]
        if len(probe) >= 1024 and len(probe) < _PROBE_MIN_RATIO * len(self._compress(probe)):
            return "raw", plane
        return "c", self._compress(plane)

    def encode(self, x: torch.Tensor, role: Role = "value") -> bytes:
        raw = tensor_bytes(x)
        itemsize = x.element_size()
        meta: dict[str, object] = {
            "codec": self.name,
            "dtype": dtype_name(x.dtype),
            "shape": list(x.shape),
            "size": len(raw),
        }
        if not (self.planes and itemsize in _UINT):
            return pack(meta, self._compress(raw))
        packed = [self._pack_plane(plane) for plane in to_planes(raw, itemsize)]
        meta["planes"] = [[mode, len(body)] for mode, body in packed]
        return pack(meta, *(body for _, body in packed))

    def decode(self, data: bytes | memoryview) -> torch.Tensor:
        meta, payload = unpack_for(data, self.name)
        with payload_errors(self.name):
            return self._restore(meta, payload)

    def _restore(self, meta: dict[str, Any], payload: memoryview) -> torch.Tensor:
        dtype = dtype_from_name(meta["dtype"])
        if "planes" not in meta:
            raw = self._decompress(payload, meta["size"])
            return tensor_from_bytes(raw, dtype, meta["shape"])
        itemsize = torch.empty((), dtype=dtype).element_size()
        planes, offset = [], 0
        for mode, length in meta["planes"]:
            body = payload[offset : offset + length]
            offset += length
            size = meta["size"] // itemsize
            planes.append(bytes(body) if mode == "raw" else self._decompress(body, size))
        return tensor_from_bytes(from_planes(planes, itemsize), dtype, meta["shape"])


class ZstdCodec(_Lossless):
    """zstd (level 1) on the tensor's raw bytes."""

    name = "zstd"

    def _compress(self, raw: bytes | memoryview) -> bytes:
        return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)

    def _decompress(self, data: bytes | memoryview, size: int) -> bytes:
        return zstandard.ZstdDecompressor().decompress(data, max_output_size=size)


class ZstdPlanesCodec(ZstdCodec):
    """zstd (level 1) per byte plane (exponents, then sign + mantissa)."""

    name = "zstd-planes"
    planes = True


class Lz4Codec(_Lossless):
    """lz4 frame (fast mode) on the tensor's raw bytes."""

    name = "lz4"

    def _compress(self, raw: bytes | memoryview) -> bytes:
        return lz4.frame.compress(raw, compression_level=LZ4_LEVEL, store_size=True)

    def _decompress(self, data: bytes | memoryview, size: int) -> bytes:
        return lz4.frame.decompress(data)


class Lz4PlanesCodec(Lz4Codec):
    """lz4 frame (fast mode) per byte plane."""

    name = "lz4-planes"
    planes = True
