"""The ``raw`` codec: a tensor's bytes as they are (registered by :mod:`.registry`)."""

from __future__ import annotations

import torch

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
