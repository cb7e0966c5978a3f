"""Built-in codecs. Registration happens at import, in one place."""

from __future__ import annotations

import torch

from pdx.kv.codecs.base import (
    KVCodec,
    Role,
    dtype_from_name,
    dtype_name,
    pack,
    payload_errors,
    register_codec,
    unpack_for,
)
from pdx.kv.codecs.tensorio import tensor_bytes, tensor_from_bytes

__all__ = ["RawCodec", "tensor_bytes", "tensor_from_bytes"]


@register_codec
class RawCodec(KVCodec):
    """No compression: the tensor's bytes as they are."""

    name = "raw"
    lossless = True

    def encode(self, x: torch.Tensor, role: Role = "value") -> bytes:
        meta = {"codec": self.name, "dtype": dtype_name(x.dtype), "shape": list(x.shape)}
        return pack(meta, tensor_bytes(x))

    def decode(self, data: bytes | memoryview) -> torch.Tensor:
        meta, payload = unpack_for(data, self.name)
        with payload_errors(self.name):
            return tensor_from_bytes(payload, dtype_from_name(meta["dtype"]), meta["shape"])


def _register_all() -> None:
    """Every built-in codec, registered in one place (in the order tables list them)."""
    from pdx.kv.codecs import lossless, lossy
    from pdx.kv.codecs.base import register_codec_family

    for cls in (
        lossy.Fp8E4M3,
        lossy.Fp8E4M3Head,
        lossy.Fp8E5M2,
        lossy.Fp8E5M2Head,
        lossy.Int8G64,
        lossy.Int4G64,
        lossy.Int4G32,
        lossless.ZstdCodec,
        lossless.ZstdPlanesCodec,
        lossless.Lz4Codec,
        lossless.Lz4PlanesCodec,
    ):
        register_codec(cls)
    register_codec_family(lossy.INT_PATTERN, "int{4|8}[-g<N>]", lossy.int_codec_from_name)


_register_all()
