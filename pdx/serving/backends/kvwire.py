"""KV state ↔ one byte object plus a layout: the form the KV store holds and ships.

Each tensor is encoded on its own by a measure-kv codec (keys and values get their role, so
lossy codecs group scales the KIVI way) and the encodings are concatenated; the layout
records shapes, dtype, codec and each encoded length so the receiver can split and rebuild.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdx.errors import InputError
from pdx.kv.codecs import get_codec

if TYPE_CHECKING:
    from pdx.serving.backends.base import KVState, ModelBackend


@dataclass
class EncodedKV:
    """Encoded KV ready for a store ``Put``."""

    payload: bytes
    layout: dict[str, Any] = field(default_factory=dict)
    raw_bytes: int = 0


def encode_kv(state: KVState, codec: str, num_layers: int) -> EncodedKV:
    """Encode every tensor with ``codec`` and describe the result."""
    enc = get_codec(codec)
    roles = state.roles or ["other"] * len(state.tensors)
    blobs = [enc.encode(t, role) for t, role in zip(state.tensors, roles, strict=True)]
    layout = {
        "num_layers": num_layers,
        "dtype": str(state.tensors[0].dtype).removeprefix("torch.") if state.tensors else "",
        "shapes": [list(t.shape) for t in state.tensors],
        "codec": codec,
        "tensor_bytes": [len(b) for b in blobs],
        "roles": list(roles),
    }
    return EncodedKV(payload=b"".join(blobs), layout=layout, raw_bytes=state.nbytes)


def decode_kv(
    payload: bytes | memoryview, layout: dict[str, Any], backend: ModelBackend, length: int
) -> KVState:
    """Split ``payload`` by the layout's encoded lengths, decode each tensor, rebuild the state."""
    dec = get_codec(layout["codec"])
    view = memoryview(payload)
    sizes = list(layout["tensor_bytes"])
    if sum(sizes) != len(view):
        raise InputError("kv payload", f"{len(view)} bytes", f"{sum(sizes)} bytes per its layout")
    tensors, offset = [], 0
    for size, shape in zip(sizes, layout["shapes"], strict=True):
        tensor = dec.decode(view[offset : offset + size])
        if list(tensor.shape) != list(shape):
            raise InputError("kv tensor shape", list(tensor.shape), f"{list(shape)}")
        tensors.append(tensor)
        offset += size
    return backend.kv_from_tensors(tensors, length)
