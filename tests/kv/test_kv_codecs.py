"""Codecs: exact round trips for lossless ones, documented error bounds for lossy ones."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdx.errors import InputError
from pdx.kv.codecs import codec_names, get_codec
from pdx.kv.codecs.registry import codec_patterns, decode_any

STABLE_NAMES = [
    "raw",
    "fp8-e4m3",
    "fp8-e4m3-head",
    "fp8-e5m2",
    "fp8-e5m2-head",
    "int8-g64",
    "int4-g64",
    "int4-g32",
    "zstd",
    "zstd-planes",
    "lz4",
    "lz4-planes",
]
LOSSLESS = ["raw", "zstd", "zstd-planes", "lz4", "lz4-planes"]
INT_NAMES = ["int8-g64", "int4-g64", "int4-g32", "int4-g2", "int8-g6", "int4"]
FP8 = {"e4m3": (2**-4, 2**-10, 448.0), "e5m2": (2**-3, 2**-17, 57344.0)}

shapes = st.lists(st.integers(1, 9), min_size=1, max_size=4)
roles = st.sampled_from(["key", "value", "other"])
float_dtypes = st.sampled_from([torch.bfloat16, torch.float16, torch.float32])


def bits_tensor(shape: list[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Arbitrary bit patterns (NaN, inf, subnormals included) of a float dtype."""
    gen = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    ints = torch.randint(0, 256, (*shape, size), generator=gen, dtype=torch.uint8)
    return ints.view(dtype).reshape(shape)


def kv_like(shape: list[int], dtype: torch.dtype, seed: int, scale: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * scale
    x.view(-1)[0] *= 8  # an outlier, as real KV has (stays finite in fp16)
    return x.to(dtype)


def test_stable_codec_names() -> None:
    assert codec_names() == STABLE_NAMES
    assert codec_patterns() == ["int{4|8}[-g<N>]"]


@settings(max_examples=60, deadline=None)
@given(shape=shapes, dtype=float_dtypes, seed=st.integers(0, 2**31), role=roles)
@pytest.mark.parametrize("name", LOSSLESS)
def test_lossless_round_trip_is_bit_exact(name: str, shape, dtype, seed, role) -> None:
    x = bits_tensor(shape, dtype, seed)
    y = get_codec(name).decode(get_codec(name).encode(x, role))
    assert y.dtype == x.dtype and list(y.shape) == shape
    assert torch.equal(y.view(torch.uint8), x.view(torch.uint8))


@settings(max_examples=60, deadline=None)
@given(
    shape=shapes,
    dtype=float_dtypes,
    seed=st.integers(0, 2**31),
    role=roles,
    scale=st.floats(1e-3, 1e3),
)
@pytest.mark.parametrize("name", ["fp8-e4m3", "fp8-e4m3-head", "fp8-e5m2", "fp8-e5m2-head"])
def test_fp8_within_bound(name: str, shape, dtype, seed, role, scale) -> None:
    x = kv_like(shape, dtype, seed, scale)
    y = get_codec(name).decode(get_codec(name).encode(x, role))
    assert y.dtype == x.dtype and list(y.shape) == shape
    rel, absolute, fmax = FP8[name.split("-")[1]]
    xs = x.double()
    tensor_scale = float(xs.abs().max()) * (1 + 2**-6) / fmax
    bound = (rel + 2**-6) * xs.abs() + 2 * absolute * tensor_scale + 1e-30
    assert bool(((y.double() - xs).abs() <= bound).all())


@settings(max_examples=60, deadline=None)
@given(
    shape=shapes,
    dtype=float_dtypes,
    seed=st.integers(0, 2**31),
    role=roles,
    scale=st.floats(1e-3, 1e3),
)
@pytest.mark.parametrize("name", INT_NAMES)
def test_int_within_bound(name: str, shape, dtype, seed, role, scale) -> None:
    x = kv_like(shape, dtype, seed, scale)
    codec = get_codec(name)
    y = codec.decode(codec.encode(x, role))
    assert y.dtype == x.dtype and list(y.shape) == shape
    levels = 15 if name.startswith("int4") else 255
    xs = x.double()
    step = float(xs.max() - xs.min()) / levels
    bound = step / 2 * (1 + 1e-5) + 2**-7 * xs.abs() + 1e-6 * scale
    assert bool(((y.double() - xs).abs() <= bound).all())


def test_keys_are_quantized_per_channel_values_per_token() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 128, 16, generator=gen)
    x[..., 3] += 100.0  # an outlier channel, typical of keys
    codec = get_codec("int4-g32")
    others = [c for c in range(16) if c != 3]
    key_err = (codec.decode(codec.encode(x, "key")) - x)[..., others].abs().max()
    value_err = (codec.decode(codec.encode(x, "value")) - x)[..., others].abs().max()
    assert key_err * 5 < value_err


def test_ratios_on_bf16_kv() -> None:
    x = kv_like([1, 8, 256, 128], torch.bfloat16, 1, 1.0)
    raw = x.numel() * 2

    def ratio(name: str) -> float:
        return raw / len(get_codec(name).encode(x, "key"))

    assert 1.95 < ratio("fp8-e4m3") <= 2.0
    assert 1.95 < ratio("fp8-e5m2-head") <= 2.0
    assert 1.7 < ratio("int8-g64") < 1.8
    assert 3.1 < ratio("int4-g64") < 3.25
    assert ratio("zstd-planes") > ratio("zstd") > 1.0
    assert ratio("lz4-planes") > ratio("lz4")


def test_parametrised_and_alias_names() -> None:
    assert get_codec("int4").name == "int4-g64"
    assert get_codec("int8").name == "int8-g64"
    assert get_codec("int8-g128").name == "int8-g128"


@pytest.mark.parametrize("name", ["int4-g3", "int4-g0", "int2-g64", "gzip", "", "INT4"])
def test_unknown_or_invalid_codec(name: str) -> None:
    with pytest.raises(InputError, match="codec"):
        get_codec(name)


def test_decode_any_dispatches_on_the_header() -> None:
    x = kv_like([2, 3, 5], torch.bfloat16, 3, 1.0)
    for name in [*STABLE_NAMES, "int8-g6"]:
        back = decode_any(get_codec(name).encode(x, "value"))
        assert back.shape == x.shape and back.dtype == x.dtype


@pytest.mark.parametrize("data", [b"", b"PDXC", b"XXXX\x00\x00\x00\x00", b"PDXC\xff\x00\x00\x00{}"])
def test_garbage_is_an_input_error(data: bytes) -> None:
    with pytest.raises(InputError):
        decode_any(data)


def test_fp8_of_all_zeros_and_empty_tensors() -> None:
    for name in ("fp8-e4m3", "fp8-e4m3-head", "int4-g64", "zstd-planes"):
        codec = get_codec(name)
        zeros = torch.zeros(1, 2, 3, 4, dtype=torch.bfloat16)
        assert torch.equal(codec.decode(codec.encode(zeros, "key")), zeros)


@pytest.mark.parametrize("name", STABLE_NAMES)
def test_truncated_or_corrupted_payloads_are_input_errors(name: str) -> None:
    codec = get_codec(name)
    blob = codec.encode(kv_like([2, 4, 300, 64], torch.bfloat16, 5, 1.0), "key")
    for damaged in (blob[: len(blob) // 2], blob[:-7], blob[:40] + b"\x00" * (len(blob) - 40)):
        with pytest.raises(InputError, match="codec payload"):
            codec.decode(damaged)


def test_a_payload_of_another_codec_is_refused() -> None:
    blob = get_codec("fp8-e4m3").encode(torch.ones(4, 4), "key")
    with pytest.raises(InputError, match="a fp8-e5m2 payload"):
        get_codec("fp8-e5m2").decode(blob)
