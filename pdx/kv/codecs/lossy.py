"""Lossy codecs: FP8 (e4m3 / e5m2, per-tensor or per-head scales) and INT8 / INT4 (KIVI-style).

Tensors are read as ``[..., heads, tokens, head_dim]`` (the transformers cache layout).
Written here rather than taken from a library because the wire layout (header + payload
planes) is part of pdx's KV contract and must not change with a dependency's version.

Error bounds (per element, before the final cast back to the source dtype):

* ``fp8-e4m3``: ``|x - x'| <= (2**-4 + 2**-6) * |x| + 2**-9 * scale``; ``fp8-e5m2``:
  ``(2**-3 + 2**-6) * |x| + 2**-16 * scale`` (scale = amax * (1 + 2**-6) / fp8 max, per
  tensor or per head; the 2**-6 term covers the multiply's rounding in bf16 and the final
  rounding back to the source dtype).
* ``int<b>-g<N>``: ``|x - x'| <= (max - min) / (2**b - 1) / 2`` over each group of ``N``
  (keys: N tokens of one channel; values: N channels of one token; rows shorter than N
  form one group).
"""

from __future__ import annotations

import re
from typing import Any

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
_MARGIN = 1 + 2**-6  # headroom over amax; see Fp8Codec.encode


class Fp8Codec(KVCodec):
    """FP8 with a float32 scale per tensor, or per head (dimension -3) when ``per_head``."""

    lossless = False

    def __init__(self, fmt: str, per_head: bool) -> None:
        self.fmt = fmt
        self.per_head = per_head
        self.name = f"fp8-{fmt}" + ("-head" if per_head else "")
        self._dtype = _FP8[fmt]
        self._max = float(torch.finfo(self._dtype).max)

    def _amax(self, x: torch.Tensor) -> torch.Tensor:
        """Largest magnitude per tensor or per head, in one pass (no |x| temporary)."""
        if self.per_head and x.dim() >= 3:
            rows = x.reshape(*x.shape[:-2], -1)  # aminmax(dim=) is ~30x slower on CPU than these
            amax = torch.maximum(rows.amin(dim=-1).neg(), rows.amax(dim=-1)).float()
            return amax.reshape(*x.shape[:-2], 1, 1)
        low, high = torch.aminmax(x)
        return torch.maximum(low.neg(), high).float().reshape([1] * max(x.dim(), 1))

    @staticmethod
    def _inverse(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """1 / scale in the dtype the multiply runs in (bf16 and fp32 inputs stay in their own
        dtype for speed; fp16, whose range is too narrow for 1 / scale, goes through fp32)."""
        inverse = scale.reciprocal()
        if dtype in (torch.bfloat16, torch.float32):
            narrowed = inverse.to(dtype)
            if bool(torch.isfinite(narrowed).all()):
                return narrowed
        return inverse

    def encode(self, x: torch.Tensor, role: Role = "value") -> bytes:
        x = x.detach()
        # The margin keeps |x| / scale below the fp8 maximum after the rounding of the
        # multiply in x's own dtype, so no clamp pass is needed.
        scale = self._amax(x) * (_MARGIN / self._max)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = (x * self._inverse(scale, x.dtype)).to(self._dtype)
        meta = {
            "codec": self.name,
            "dtype": dtype_name(x.dtype),
            "shape": list(x.shape),
            "scale_shape": list(scale.shape),
        }
        return pack(meta, tensor_bytes(q), tensor_bytes(scale.contiguous()))

    def decode(self, data: bytes | memoryview) -> torch.Tensor:
        meta, payload = unpack_for(data, self.name)
        with payload_errors(self.name):
            shape = meta["shape"]
            count = _numel(shape)
            q = tensor_from_bytes(payload[:count], self._dtype, shape)
            scale = tensor_from_bytes(payload[count:], torch.float32, meta["scale_shape"])
            return (q.float() * scale).to(dtype_from_name(meta["dtype"]))


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
