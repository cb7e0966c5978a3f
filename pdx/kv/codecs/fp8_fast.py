"""Compiled CPU kernels for the fp8 codecs (numba): bf16 → fp8 and fp8 → any float.

torch converts to and from fp8 one element at a time on CPUs (about 0.5 ns per element,
several times slower than a memory copy). These kernels do the same conversions in SIMD
registers. Written here because no maintained library offers a vectorised CPU fp8 cast
with a fused power-of-two scale; their results are bit-identical to torch's conversion
(checked exhaustively by the tests).

* :func:`encode_bf16` turns bf16 bits ``x`` into the fp8 bits of ``x * 2**-k`` with
  round-to-nearest-even, working in 16-bit lanes on the bit patterns: a power-of-two scale
  is a shift of the exponent field, so no multiply and no float temporaries are needed.
  It covers finite inputs whose scaled magnitude is at most the fp8 maximum and
  ``k >= MIN_EXPONENT``; the caller checks that (see :mod:`pdx.kv.codecs.lossy`).
* :func:`decode` widens fp8 to float32 through the fp16 bit layout (exact), multiplies by
  the row's scale once and rounds to the output dtype: the same single rounding of the
  same product that ``(q.float() * scale).to(dtype)`` does, for any float32 scale.

Importing this module imports numba; callers import it lazily and fall back to torch
when numba is not installed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

#: Smallest exponent ``k`` the encode kernel handles exactly: from there on every bf16
#: subnormal input rounds to zero, which the kernel assumes (it treats them as normals).
MIN_EXPONENT = -100

#: Per format: (bf16 minus fp8 exponent bias, shift base of the subnormal branch, mantissa bits).
_FORMATS = {"e4m3": (120, 125, 3), "e5m2": (112, 118, 2)}


# 16-bit integer operations as LLVM instructions. numba widens small integers to 64 bits in
# arithmetic, which stops LLVM from packing 32 lanes of 16 bits into one vector register.
def _int16_op(op: str) -> Any:
    @intrinsic
    def impl(typingctx: Any, a: Any, b: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            return getattr(builder, op)(args[0], args[1])

        return types.int16(types.int16, types.int16), codegen

    return impl


_add = _int16_op("add")
_sub = _int16_op("sub")
_and = _int16_op("and_")
_or = _int16_op("or_")
_shr = _int16_op("lshr")
_shl = _int16_op("shl")


def _umin_typer(typingctx: Any, a: Any, b: Any) -> Any:
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        less = builder.icmp_unsigned("<", args[0], args[1])
        return builder.select(less, args[0], args[1])

    return types.int16(types.int16, types.int16), codegen


def _pick_ge_typer(typingctx: Any, a: Any, b: Any, yes: Any, no: Any) -> Any:
    """``yes if a >= b else no`` (signed 16-bit)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        at_least = builder.icmp_signed(">=", args[0], args[1])
        return builder.select(at_least, args[2], args[3])

    return types.int16(types.int16, types.int16, types.int16, types.int16), codegen


_umin: Any = intrinsic(_umin_typer)
_pick_ge: Any = intrinsic(_pick_ge_typer)


def _pick_eq_typer(typingctx: Any, a: Any, b: Any, yes: Any, no: Any) -> Any:
    """``yes if a == b else no`` (16-bit)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        equal = builder.icmp_signed("==", args[0], args[1])
        return builder.select(equal, args[2], args[3])

    return types.int16(types.int16, types.int16, types.int16, types.int16), codegen


def _half_to_float_typer(typingctx: Any, h: Any) -> Any:
    """float32 value of fp16 bits (exact)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.int16), codegen


def _half_bits_typer(typingctx: Any, f: Any) -> Any:
    """fp16 bits of a float32, rounded to nearest even."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.int16(types.float32), codegen


def _bf16_bits_typer(typingctx: Any, f: Any) -> Any:
    """bf16 bits of a float32, rounded to nearest even (as torch rounds; NaN stays NaN)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        i32 = ir.IntType(32)
        bits = builder.bitcast(args[0], i32)
        odd = builder.and_(builder.lshr(bits, ir.Constant(i32, 16)), ir.Constant(i32, 1))
        rounded = builder.add(builder.add(bits, ir.Constant(i32, 0x7FFF)), odd)
        return builder.trunc(builder.lshr(rounded, ir.Constant(i32, 16)), ir.IntType(16))

    return types.int16(types.float32), codegen


_pick_eq: Any = intrinsic(_pick_eq_typer)
_half_to_float: Any = intrinsic(_half_to_float_typer)
_half_bits: Any = intrinsic(_half_bits_typer)
_bf16_bits: Any = intrinsic(_bf16_bits_typer)


@njit(inline="always")  # type: ignore[misc]
def _fp8_bits(b: Any, base: Any, shift_base: Any, mbits: Any) -> Any:
    """fp8 bits of (bf16 bits ``b``) * 2**-k, where ``base = (bias gap + k) << 7``."""
    u = _and(b, 0x7FFF)
    sign = _and(_shr(b, 8), 0x80)
    drop = 7 - mbits
    # Normal result: re-bias the exponent, round the mantissa to nearest even.
    odd = _and(_shr(u, drop), 1)
    normal = _shr(_add(_add(_sub(u, base), (1 << (drop - 1)) - 1), odd), drop)
    # Subnormal (or zero) result: shift the significand right by an exponent-dependent count.
    mant = _or(_and(u, 0x7F), 0x80)
    count = _umin(_sub(shift_base, _shr(u, 7)), 15)
    bias = _add(_sub(_shl(1, _sub(count, 1)), 1), _and(_shr(mant, count), 1))
    small = _shr(_add(mant, bias), count)
    return _or(_pick_ge(u, _add(base, 0x80), normal, small), sign)


@njit(nogil=True, cache=True)  # type: ignore[misc]
def _encode_rows(x: Any, k: Any, out: Any, gap: Any, shift: Any, mbits: Any) -> None:
    for i in range(x.shape[0]):
        row, dst = x[i], out[i]
        base = np.int16((gap + k[i]) << 7)
        shift_base = np.int16(shift + k[i])
        for j in range(row.shape[0]):
            dst[j] = np.uint8(_fp8_bits(row[j], base, shift_base, mbits))


@njit(nogil=True, cache=True)  # type: ignore[misc]
def _abs_max_rows(x: Any, out: Any) -> None:
    for i in range(x.shape[0]):
        row = x[i]
        top = np.uint16(0)
        for j in range(row.shape[0]):
            top = max(top, row[j] & np.uint16(0x7FFF))
        out[i] = top


@njit(inline="always")  # type: ignore[misc]
def _fp8_value(b: Any, e4m3: Any) -> Any:
    """float32 of fp8 bits ``b``: e5m2 is the top byte of fp16; e4m3 shifted into fp16 is
    its value * 2**-8 (subnormals included), so the caller folds 2**8 into the scale."""
    if e4m3:
        mag = _and(b, 0x7F)
        h = _or(_shl(_and(b, 0x80), 8), _shl(mag, 7))
        return _half_to_float(_pick_eq(mag, 0x7F, _or(h, 0x7E00), h))  # 0x7f: NaN
    return _half_to_float(_shl(b, 8))


@njit(nogil=True, cache=True)  # type: ignore[misc]
def _decode_bf16_rows(q: Any, factor: Any, out: Any, e4m3: Any) -> None:
    for i in range(q.shape[0]):
        row, dst, f = q[i], out[i], factor[i]
        for j in range(row.shape[0]):
            dst[j] = _bf16_bits(_fp8_value(np.int16(row[j]), e4m3) * f)


@njit(nogil=True, cache=True)  # type: ignore[misc]
def _decode_f16_rows(q: Any, factor: Any, out: Any, e4m3: Any) -> None:
    for i in range(q.shape[0]):
        row, dst, f = q[i], out[i], factor[i]
        for j in range(row.shape[0]):
            dst[j] = _half_bits(_fp8_value(np.int16(row[j]), e4m3) * f)


@njit(nogil=True, cache=True)  # type: ignore[misc]
def _decode_f32_rows(q: Any, factor: Any, out: Any, e4m3: Any) -> None:
    for i in range(q.shape[0]):
        row, dst, f = q[i], out[i], factor[i]
        for j in range(row.shape[0]):
            dst[j] = _fp8_value(np.int16(row[j]), e4m3) * f


#: Output dtype name → (kernel, numpy dtype of its bits).
_DECODERS = {
    "bfloat16": (_decode_bf16_rows, np.int16),
    "float16": (_decode_f16_rows, np.int16),
    "float32": (_decode_f32_rows, np.float32),
}


def abs_max_bits(bits: np.ndarray) -> np.ndarray:
    """Per row of bf16 bit patterns (uint16, 2-D), the largest ``bits & 0x7fff``.

    For finite values this orders like ``|x|``; above ``0x7f80`` the row holds inf or NaN."""
    out = np.empty(bits.shape[0], np.uint16)
    _abs_max_rows(bits, out)
    return out


def encode_bf16(bits: np.ndarray, exponents: np.ndarray, fmt: str) -> np.ndarray:
    """fp8 (``e4m3`` / ``e5m2``) bits of ``x * 2**-k`` per row; ``bits`` uint16 2-D, one ``k``
    per row (int32). Exact only for finite rows with ``|x| * 2**-k <= fp8 max`` and
    ``k >= MIN_EXPONENT``."""
    out = np.empty(bits.shape, np.uint8)
    _encode_rows(bits, exponents.astype(np.int32), out, *_FORMATS[fmt])
    return out


def decode(q: np.ndarray, scales: np.ndarray, fmt: str, dtype: str) -> np.ndarray | None:
    """Bits of ``(fp8 q).float() * scale`` cast to ``dtype`` (bfloat16, float16, float32), one
    float32 scale per row of q (uint8, 2-D); None where the kernels do not apply."""
    if dtype not in _DECODERS:
        return None
    e4m3 = fmt == "e4m3"
    with np.errstate(over="ignore"):
        factor = scales.astype(np.float32) * np.float32(256.0 if e4m3 else 1.0)
    if not np.isfinite(factor).all():
        return None  # a scale of 2**120 or more (e4m3), inf or NaN: torch does it
    kernel, bits = _DECODERS[dtype]
    out = np.empty(q.shape, bits)
    kernel(q, factor, out, e4m3)
    return out
