"""Tensor <-> raw bytes helpers shared by every codec."""

from __future__ import annotations

import numpy as np
import torch


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
