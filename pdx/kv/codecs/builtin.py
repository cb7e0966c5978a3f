"""Built-in codecs. Registration happens at import, in one place."""

from __future__ import annotations

import numpy as np
import torch

from pdx.kv.codecs.base import (
    KVCodec,
    Role,
    dtype_from_name,
    dtype_name,
    pack,
    register_codec,
    unpack,
)


def tensor_bytes(x: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without copying."""
    x = x.detach().contiguous().cpu()
    return memoryview(x.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def tensor_from_bytes(
    buf: bytes | memoryview, dtype: torch.dtype, shape: list[int]
) -> torch.Tensor:
    """Rebuild a tensor from raw bytes (copies, so the result owns its memory)."""
    arr = np.frombuffer(buf, dtype=np.uint8).copy()
    return torch.from_numpy(arr).view(dtype).reshape(shape)


@register_codec
class RawCodec(KVCodec):
    """No compression: the tensor's bytes as they are."""

    name = "raw"
    lossless = True

    def encode(self, x: torch.Tensor, role: Role = "value") -> bytes:
        meta = {"codec": self.name, "dtype": dtype_name(x.dtype), "shape": list(x.shape)}
        return pack(meta, tensor_bytes(x))

    def decode(self, data: bytes | memoryview) -> torch.Tensor:
        meta, payload = unpack(data)
        return tensor_from_bytes(payload, dtype_from_name(meta["dtype"]), meta["shape"])
