"""fp8 codecs: power-of-two scales, kernels bit-identical to torch's fp8 conversion, same bytes
on both paths."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdx.kv.codecs import get_codec
from pdx.kv.codecs.base import pack, unpack
from pdx.kv.codecs.lossy import Fp8Codec

try:
    from pdx.kv.codecs import fp8_fast as fast
except ModuleNotFoundError:  # numba is optional: without it the codecs run on torch alone
    fast = None  # type: ignore[assignment]
needs_kernels = pytest.mark.skipif(fast is None, reason="numba is not installed")

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_NAMES = ["fp8-e4m3", "fp8-e4m3-head", "fp8-e5m2", "fp8-e5m2-head"]
ALL_BF16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
ALL_CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8)


def both_paths(name: str) -> tuple[Fp8Codec, Fp8Codec]:
    """The codec with its kernels, and the same codec forced onto plain torch."""
    kernel, plain = get_codec(name), get_codec(name)
    assert isinstance(kernel, Fp8Codec) and isinstance(plain, Fp8Codec)
    plain.use_kernels = False
    return kernel, plain


def same_floats(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, except that any NaN matches any NaN (NaN payloads are not specified)."""
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    size = a.element_size()
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[size]
    return torch.equal(a[~nan].view(view), b[~nan].view(view))


@needs_kernels
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_encode_kernel_matches_torch_for_every_bf16_and_exponent(fmt: str) -> None:
    """All 65536 bf16 patterns, every exponent the kernel accepts (ties, subnormals of both
    formats, the fp8 maximum, signed zeros): bits equal torch's round-to-nearest-even."""
    fmax = torch.finfo(FORMATS[fmt]).max
    values = ALL_BF16.float()
    for k in range(fast.MIN_EXPONENT, 120):
        scaled = values * 2.0**-k
        ok = scaled.isfinite() & (scaled.abs() <= fmax)
        bits = ALL_BF16[ok].view(torch.int16).numpy().view(np.uint16).reshape(1, -1)
        got = fast.encode_bf16(bits, np.array([k], np.int32), fmt)[0]
        want = scaled[ok].to(FORMATS[fmt]).view(torch.uint8).numpy()
        assert np.array_equal(got, want), f"k={k}"


@needs_kernels
def test_abs_max_bits_orders_like_magnitude() -> None:
    rows = ALL_BF16.reshape(16, -1)
    finite = torch.where(rows.isfinite(), rows, torch.zeros((), dtype=torch.bfloat16))
    bits = finite.view(torch.int16).numpy().view(np.uint16)
    top = torch.from_numpy(fast.abs_max_bits(bits).view(np.int16)).view(torch.bfloat16)
    assert torch.equal(top, finite.abs().amax(dim=1))


DECODE_SCALES = [1.0, 2.0**-20, 3.7e-3, 6.1e4, 2.0**119, 1e-40, 2.0**-126, 0.1]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_decode_kernel_matches_torch_for_every_code(fmt: str, dtype: torch.dtype) -> None:
    """Every fp8 code times power-of-two and arbitrary scales (overflow, float32 subnormal
    scales, results below the output's range): values equal ``(q.float() * s).to(dtype)``."""
    q = ALL_CODES.view(FORMATS[fmt]).repeat(len(DECODE_SCALES), 1)
    scale = torch.tensor(DECODE_SCALES, dtype=torch.float32)
    want = (q.float() * scale.reshape(-1, 1)).to(dtype)
    bits = fast.decode(q.view(torch.uint8).numpy(), scale.numpy(), fmt, str(dtype)[6:])
    assert bits is not None
    assert same_floats(torch.from_numpy(bits).view(dtype), want)


@needs_kernels
def test_decode_kernel_declines_what_it_cannot_do_exactly() -> None:
    q = np.zeros((1, 4), np.uint8)
    assert fast.decode(q, np.array([2.0**121], np.float32), "e4m3", "bfloat16") is None
    assert fast.decode(q, np.array([np.nan], np.float32), "e5m2", "bfloat16") is None
    assert fast.decode(q, np.array([1.0], np.float32), "e5m2", "int32") is None


def bf16_tensor(shape: list[int], seed: int, spread: int) -> torch.Tensor:
    """Random bf16 values over ``spread`` binades around 1, with zeros, -0, ties and tiny ones."""
    gen = torch.Generator().manual_seed(seed)
    mantissa = torch.randint(0, 128, shape, generator=gen, dtype=torch.int32)
    exponent = torch.randint(127 - spread, 128 + spread, shape, generator=gen, dtype=torch.int32)
    sign = torch.randint(0, 2, shape, generator=gen, dtype=torch.int32) << 15
    bits = sign | (exponent.clamp(0, 254) << 7) | mantissa
    bits.view(-1)[::7] = 0x8000  # negative zeros
    return bits.to(torch.int16).view(torch.bfloat16)


kv_shapes = st.lists(st.integers(1, 6), min_size=1, max_size=4).map(lambda s: [*s[:-1], s[-1] * 8])


@settings(max_examples=80, deadline=None)
@given(shape=kv_shapes, seed=st.integers(0, 2**31), spread=st.integers(0, 127))
@pytest.mark.parametrize("name", FP8_NAMES)
def test_codec_bytes_identical_on_both_paths(name: str, shape, seed, spread) -> None:
    x = bf16_tensor(shape, seed, spread)
    kernel, plain = both_paths(name)
    blob = kernel.encode(x, "key")
    assert blob == plain.encode(x, "key")
    assert same_floats(kernel.decode(blob), plain.decode(blob))


@settings(max_examples=60, deadline=None)
@given(shape=kv_shapes, seed=st.integers(0, 2**31), scale=st.floats(1e-30, 1e30))
@pytest.mark.parametrize("name", FP8_NAMES)
def test_scale_is_the_smallest_fitting_power_of_two(name: str, shape, seed, scale) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16)
    codec = get_codec(name)
    meta, payload = unpack(codec.encode(x, "value"))
    scales = torch.from_numpy(np.frombuffer(payload[x.numel() :], np.float32).copy())
    rows = x.reshape(scales.numel(), -1).abs().amax(dim=1).double()
    fmax = torch.finfo(FORMATS[name.split("-")[1]]).max
    mantissa, _ = torch.frexp(scales)
    assert bool((mantissa == 0.5).all())  # powers of two
    assert bool((rows <= fmax * scales).all())
    assert bool(((rows > fmax * scales / 2) | (rows == 0)).all())
    y = codec.decode(codec.encode(x, "value"))
    rel, absolute = (2**-4, 2**-10) if "e4m3" in name else (2**-3, 2**-17)
    each = scales.double().reshape(meta["scale_shape"])
    bound = rel * x.double().abs() + absolute * each  # bf16 round trip: no extra rounding
    assert bool(((y.double() - x.double()).abs() <= bound).all())


def test_edges_max_ties_and_subnormals_round_trip_like_torch() -> None:
    values = [448.0, -448.0, 416.0, 432.0, 2**-6, 2**-7, 2**-9, 2**-10, 3 * 2**-11, 0.0, -0.0]
    x = torch.tensor(values, dtype=torch.bfloat16).reshape(1, 1, -1)
    for name in FP8_NAMES:
        kernel, plain = both_paths(name)
        assert kernel.encode(x) == plain.encode(x)
    e4m3 = get_codec("fp8-e4m3")
    back = e4m3.decode(e4m3.encode(x))[0, 0].tolist()  # amax 448: scale 1
    # 432 and 2**-10 are ties (to even: 448 and 0); 3 * 2**-11 rounds up to the subnormal 2**-9
    assert back == [448.0, -448.0, 416.0, 448.0, 2**-6, 2**-7, 2**-9, 0.0, 2**-9, 0.0, -0.0]


@pytest.mark.parametrize("name", FP8_NAMES)
def test_non_finite_values_follow_torch_rules(name: str) -> None:
    x = torch.tensor([[1.0, float("nan"), float("inf"), -float("inf"), 3.0]], dtype=torch.bfloat16)
    kernel, plain = both_paths(name)
    blob = kernel.encode(x)
    assert blob == plain.encode(x)
    back = kernel.decode(blob)
    assert back[0, 0].item() == 1.0 and back[0, 4].item() == 3.0 and back[0, 1].isnan()
    expected_inf = 448.0 if "e4m3" in name else math.inf
    assert back[0, 2].item() == expected_inf and back[0, 3].item() == -expected_inf


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name", FP8_NAMES)
def test_payloads_with_any_float32_scale_still_decode(name: str, dtype: torch.dtype) -> None:
    """Blobs whose scale is not a power of two (as earlier versions wrote them) decode to
    ``fp8 * scale`` on both paths."""
    fmt = FORMATS[name.split("-")[1]]
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 5, 8, generator=gen).to(dtype)
    scale_shape = [2, 3, 1, 1] if name.endswith("head") else [1, 1, 1, 1]
    scale = torch.rand(scale_shape, generator=gen) * 0.01 + 1e-3
    q = (x / scale).to(fmt)
    meta = {"codec": name, "dtype": str(dtype)[6:], "shape": [2, 3, 5, 8]}
    blob = pack({**meta, "scale_shape": scale_shape}, q.view(torch.uint8).numpy(), scale.numpy())
    kernel, plain = both_paths(name)
    want = (q.float() * scale).to(dtype)
    assert same_floats(kernel.decode(blob), want) and same_floats(plain.decode(blob), want)


def test_other_dtypes_and_odd_layouts_take_the_torch_path_with_the_same_bytes() -> None:
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(2, 4, 6, 8, generator=gen)
    for x in (base.half(), base, base.bfloat16().transpose(-1, -2), base.bfloat16()[..., ::2]):
        for name in FP8_NAMES:
            kernel, plain = both_paths(name)
            blob = kernel.encode(x)
            assert blob == plain.encode(x)
            assert same_floats(kernel.decode(blob), plain.decode(blob))


@needs_kernels
@pytest.mark.parametrize("name", FP8_NAMES)
def test_bf16_kv_goes_through_the_kernels(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With numba installed, bf16 encode and decode never fall back to torch's fp8 cast."""
    import pdx.kv.codecs.lossy as lossy

    real_from_bytes = lossy.tensor_from_bytes

    def scales_only(buf, dtype, shape):  # the torch decode path reads the fp8 codes here
        assert dtype == torch.float32, "torch decode path used"
        return real_from_bytes(buf, dtype, shape)

    def refuse(*_):
        raise AssertionError("torch encode path used")

    monkeypatch.setattr(Fp8Codec, "_quantize", refuse)
    monkeypatch.setattr(lossy, "tensor_from_bytes", scales_only)
    x = bf16_tensor([2, 4, 16, 8], 11, 20)
    codec = get_codec(name)
    back = codec.decode(codec.encode(x, "key"))
    assert back.shape == x.shape and back.dtype == x.dtype
