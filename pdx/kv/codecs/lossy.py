"""Lossy codecs: FP8 (e4m3 / e5m2, per-tensor or per-head scales) and INT8 / INT4 (KIVI-style).

Tensors are read as ``[..., heads, tokens, head_dim]`` (the transformers cache layout).
Written here rather than taken from a library because the wire layout (header + payload
planes) is part of pdx's KV contract and must not change with a dependency's version.

Error bounds (per element, before the final cast back to the source dtype):

* ``fp8-e4m3`` / ``fp8-e5m2``: the scale is ``2**k``, the smallest power of two with
  ``amax / scale <= fp8 max`` (per tensor or per head), so the scaling is exact and
  ``scale < 2 * amax / fp8 max``; only the round-to-nearest-even to fp8 loses precision:
  ``|x - x'| <= 2**-4 * |x| + 2**-10 * scale`` (e4m3) and ``2**-3 * |x| + 2**-17 * scale``
  (e5m2). A tensor (or head) holding inf or NaN keeps scale 1 and follows torch's fp8
  rules (NaN stays NaN; e5m2 keeps inf; e4m3, which has no inf, saturates to +-448).
* ``int<b>-g<N>``: ``|x - x'| <= (max - min) / (2**b - 1) / 2`` over each group of ``N``
  (keys: N tokens of one channel; values: N channels of one token; rows shorter than N
  form one group).
"""

from __future__ import annotations

import functools
import math
import re
from types import ModuleType
from typing import Any

import numpy as np
import torch

from pdx.errors import InputError
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

_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_MIN_EXPONENT = -126  # keeps every float32 scale a normal number


@functools.cache
def _kernels() -> ModuleType | None:
    """The compiled fp8 kernels, or None where numba is not installed (torch does it all)."""
    try:
        from pdx.kv.codecs import fp8_fast
    except ImportError:
        return None
    return fp8_fast


def _power_of_two(exponents: np.ndarray) -> np.ndarray:
    """``2.0 ** e`` as exact float32, built from the bits (e in [-126, 127])."""
    return ((exponents.astype(np.int32) + 127) << 23).view(np.float32)


class Fp8Codec(KVCodec):
    """FP8 with a power-of-two float32 scale per tensor, or per head (dimension -3) when
    ``per_head``. Set ``use_kernels = False`` to force the plain torch path (same bytes)."""

    lossless = False
    use_kernels = True

    def __init__(self, fmt: str, per_head: bool) -> None:
        self.fmt = fmt
        self.per_head = per_head
        self.name = f"fp8-{fmt}" + ("-head" if per_head else "")
        self._dtype = _FP8[fmt]
        self._max = float(torch.finfo(self._dtype).max)

    def _scale_shape(self, x: torch.Tensor) -> list[int]:
        if self.per_head and x.dim() >= 3:
            return [*x.shape[:-2], 1, 1]
        return [1] * max(x.dim(), 1)

    @staticmethod
    def _amax(x: torch.Tensor, rows: int) -> np.ndarray:
        """Largest magnitude per row (tensor or head) as float64, in one pass (no |x| temporary)."""
        if x.numel() == 0:
            return np.zeros(rows)
        if rows > 1:
            flat = x.reshape(rows, -1)  # aminmax(dim=) is ~30x slower on CPU than these
            return torch.maximum(flat.amin(dim=-1).neg(), flat.amax(dim=-1)).double().numpy()
        low, high = torch.aminmax(x)
        return torch.maximum(low.neg(), high).double().numpy().reshape(1)

    def _exponents(self, amax: np.ndarray) -> np.ndarray:
        """Per row, the smallest k with ``amax <= fp8 max * 2**k`` (0 for zero, inf or NaN)."""
        mantissa, exponent = np.frexp(amax)
        top_mantissa, top_exponent = math.frexp(self._max)
        k = np.maximum(exponent - top_exponent + (mantissa > top_mantissa), _MIN_EXPONENT)
        return np.where(np.isfinite(amax) & (amax > 0), k, 0).astype(np.int32)

    def encode(self, x: torch.Tensor, role: Role = "value") -> bytes:
        x = x.detach().cpu()
        scale_shape = self._scale_shape(x)
        rows = _numel(scale_shape)
        kernels = _kernels() if self.use_kernels else None
        if kernels and x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.numel():
            payload, k = self._encode_bf16(kernels, x, rows)
        else:
            k = self._exponents(self._amax(x, rows))
            payload = tensor_bytes(self._quantize(x, k, scale_shape))
        meta = {
            "codec": self.name,
            "dtype": dtype_name(x.dtype),
            "shape": list(x.shape),
            "scale_shape": scale_shape,
        }
        return pack(meta, payload, _power_of_two(k).tobytes())

    def _quantize(self, x: torch.Tensor, k: np.ndarray, scale_shape: list[int]) -> torch.Tensor:
        """torch path: x * 2**-k (exact) rounded to fp8 by torch's own conversion."""
        inverse = torch.from_numpy(_power_of_two(-k)).reshape(scale_shape)
        if x.dtype in (torch.bfloat16, torch.float32):
            inverse = inverse.to(x.dtype)  # a power of two in range: exact, and faster
        return (x * inverse).to(self._dtype)

    def _encode_bf16(
        self, kernels: ModuleType, x: torch.Tensor, rows: int
    ) -> tuple[memoryview, np.ndarray]:
        """Kernel path for bf16 (the usual KV dtype); torch's path where it does not apply."""
        bits = x.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(rows, -1)
        top = kernels.abs_max_bits(bits)
        k = self._exponents((top.astype(np.uint32) << 16).view(np.float32).astype(np.float64))
        if int(top.max()) >= 0x7F80 or int(k.min()) < kernels.MIN_EXPONENT:
            return tensor_bytes(self._quantize(x, k, self._scale_shape(x))), k
        q = kernels.encode_bf16(bits, k, self.fmt)
        return memoryview(q.reshape(-1)), k

    def decode(self, data: bytes | memoryview) -> torch.Tensor:
        meta, payload = unpack_for(data, self.name)
        with payload_errors(self.name):
            shape = meta["shape"]
            count = _numel(shape)
            scale = tensor_from_bytes(payload[count:], torch.float32, meta["scale_shape"])
            dtype = dtype_from_name(meta["dtype"])
            kernels = _kernels() if self.use_kernels else None
            if kernels and count and _one_scale_per_row(shape, meta["scale_shape"]):
                q = np.frombuffer(payload, np.uint8, count).reshape(scale.numel(), -1)
                bits = kernels.decode(q, scale.reshape(-1).numpy(), self.fmt, meta["dtype"])
                if bits is not None:
                    return torch.from_numpy(bits).view(dtype).reshape(shape)
            q8 = tensor_from_bytes(payload[:count], self._dtype, shape)
            return (q8.float() * scale).to(dtype)


def _one_scale_per_row(shape: list[int], scale_shape: list[int]) -> bool:
    """Whether each scale covers one contiguous run of elements (per tensor or per head)."""
    return _numel(scale_shape) == 1 or scale_shape == [*shape[:-2], 1, 1]


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class IntCodec(KVCodec):
    """Asymmetric INT8/INT4 with a float32 (scale, min) per group of ``group`` elements.

    Keys are grouped per channel over ``group`` tokens, values per token over ``group``
    channels (KIVI); other tensors like values.
    """

    lossless = False

    def __init__(self, bits: int, group: int) -> None:
        if bits not in (4, 8):
            raise InputError("codec bits", bits, "4 or 8")
        if group < 2 or group % 2:
            raise InputError("codec group size", group, "an even integer >= 2")
        self.bits, self.group = bits, group
        self.levels = (1 << bits) - 1
        self.name = f"int{bits}-g{group}"

    def encode(self, x: torch.Tensor, role: Role = "value") -> bytes:
        x = x.detach()
        y = x.reshape(1, -1) if x.dim() < 2 else x
        y = y.transpose(-1, -2) if role == "key" else y
        rows = y.float().reshape(-1, y.shape[-1])
        group = min(self.group, rows.shape[1] + rows.shape[1] % 2)  # short rows: one group
        pad = (-rows.shape[1]) % group
        if pad:
            rows = torch.cat([rows, rows[:, -1:].expand(-1, pad)], dim=1)
        groups = rows.reshape(-1, group)
        low = groups.amin(dim=1, keepdim=True)
        scale = (groups.amax(dim=1, keepdim=True) - low) / self.levels
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = ((groups - low) * scale.reciprocal()).round_().clamp_(0, self.levels).to(torch.uint8)
        if self.bits == 4:
            pairs = q.reshape(-1, 2)
            q = pairs[:, 0] | (pairs[:, 1] << 4)
        meta = {
            "codec": self.name,
            "dtype": dtype_name(x.dtype),
            "shape": list(x.shape),
            "work_shape": list(y.shape),
            "role": role,
            "groups": groups.shape[0],
            "group": group,
        }
        return pack(meta, tensor_bytes(q), tensor_bytes(scale), tensor_bytes(low))

    def decode(self, data: bytes | memoryview) -> torch.Tensor:
        meta, payload = unpack_for(data, self.name)
        with payload_errors(self.name):
            return self._dequantize(meta, payload)

    def _dequantize(self, meta: dict[str, Any], payload: memoryview) -> torch.Tensor:
        n_groups, group = meta["groups"], meta["group"]
        q_len = n_groups * group * self.bits // 8
        q = tensor_from_bytes(payload[:q_len], torch.uint8, [q_len])
        if self.bits == 4:
            q = torch.stack([q & 0x0F, q >> 4], dim=1).reshape(-1)
        stats = tensor_from_bytes(payload[q_len:], torch.float32, [2, n_groups, 1])
        groups = q.reshape(n_groups, group).float() * stats[0] + stats[1]
        work = meta["work_shape"]
        width = work[-1]
        flat = groups.reshape(_numel(work) // width, -1)[:, :width]
        y = flat.reshape(work)
        y = y.transpose(-1, -2) if meta["role"] == "key" else y
        return y.reshape(meta["shape"]).to(dtype_from_name(meta["dtype"]))


#: Group size of ``int8`` / ``int4`` written without ``-g<N>``.
DEFAULT_GROUP = 64
INT_PATTERN = r"int(4|8)(?:-g(\d+))?"


def int_codec_from_name(match: re.Match[str]) -> KVCodec:
    """``int4-g32`` → IntCodec(4, 32); ``int8`` → IntCodec(8, DEFAULT_GROUP)."""
    return IntCodec(int(match.group(1)), int(match.group(2) or DEFAULT_GROUP))


class Fp8E4M3(Fp8Codec):
    """FP8 e4m3 (3 mantissa bits, max 448), one scale per tensor."""

    name = "fp8-e4m3"

    def __init__(self) -> None:
        super().__init__("e4m3", per_head=False)


class Fp8E4M3Head(Fp8Codec):
    """FP8 e4m3, one scale per head."""

    name = "fp8-e4m3-head"

    def __init__(self) -> None:
        super().__init__("e4m3", per_head=True)


class Fp8E5M2(Fp8Codec):
    """FP8 e5m2 (2 mantissa bits, max 57344), one scale per tensor."""

    name = "fp8-e5m2"

    def __init__(self) -> None:
        super().__init__("e5m2", per_head=False)


class Fp8E5M2Head(Fp8Codec):
    """FP8 e5m2, one scale per head."""

    name = "fp8-e5m2-head"

    def __init__(self) -> None:
        super().__init__("e5m2", per_head=True)


class Int8G64(IntCodec):
    """INT8, groups of 64."""

    name = "int8-g64"

    def __init__(self) -> None:
        super().__init__(8, 64)


class Int4G64(IntCodec):
    """INT4, groups of 64."""

    name = "int4-g64"

    def __init__(self) -> None:
        super().__init__(4, 64)


class Int4G32(IntCodec):
    """INT4, groups of 32."""

    name = "int4-g32"

    def __init__(self) -> None:
        super().__init__(4, 32)
