"""Codec base class and header framing (the registry is :mod:`pdx.kv.codecs.registry`)."""

from __future__ import annotations

import json
import struct
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar, Literal

import torch

from pdx.errors import InputError

Role = Literal["key", "value", "other"]

_MAGIC = b"PDXC"
_HEADER = struct.Struct("<4sI")  # magic, json-length

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise InputError("dtype", name, f"one of {', '.join(sorted(_DTYPES))}") from None


def pack(meta: dict[str, Any], *payloads: bytes | memoryview) -> bytes:
    """Frame a JSON header and payload buffers into one bytes object."""
    head = json.dumps(meta, separators=(",", ":")).encode()
    return b"".join((_HEADER.pack(_MAGIC, len(head)), head, *payloads))


def unpack(data: bytes | memoryview) -> tuple[dict[str, Any], memoryview]:
    """Split framed bytes into (header, payload view). Raises InputError on garbage."""
    view = memoryview(data)
    if len(view) < _HEADER.size:
        raise InputError("codec payload", f"{len(view)} bytes", "a framed codec payload")
    magic, head_len = _HEADER.unpack_from(view)
    if magic != _MAGIC or _HEADER.size + head_len > len(view):
        raise InputError("codec payload", "bad header", "a framed codec payload")
    try:
        meta = json.loads(bytes(view[_HEADER.size : _HEADER.size + head_len]))
    except (ValueError, UnicodeDecodeError):
        raise InputError("codec payload", "bad header", "a framed codec payload") from None
    if not isinstance(meta, dict):
        raise InputError("codec payload", "bad header", "a framed codec payload")
    return meta, view[_HEADER.size + head_len :]


@contextmanager
def payload_errors(codec: str) -> Iterator[None]:
    """Report any failure while decoding a damaged payload as one InputError."""
    try:
        yield
    except InputError:
        raise
    except Exception as exc:  # a truncated or corrupted payload fails in many ways
        raise InputError(
            "codec payload", f"{codec}: {exc.__class__.__name__}", f"an intact {codec} payload"
        ) from None


def unpack_for(data: bytes | memoryview, codec: str) -> tuple[dict[str, Any], memoryview]:
    """:func:`unpack`, also checking that the header names ``codec``."""
    meta, payload = unpack(data)
    if meta.get("codec") != codec:
        raise InputError("codec payload", meta.get("codec"), f"a {codec} payload")
    return meta, payload


class KVCodec(ABC):
    """Encode one KV tensor to self-describing bytes and back.

    ``role`` tells lossy codecs how to group scales (KIVI-style: keys per channel,
    values per token); lossless codecs ignore it.
    """

    #: Stable name; parametrised codecs (``int4-g32``) set it per instance.
    name: str
    lossless: ClassVar[bool]

    @abstractmethod
    def encode(self, x: torch.Tensor, role: Role = "value") -> bytes:
        """Tensor → framed bytes (see :func:`pack`)."""

    @abstractmethod
    def decode(self, data: bytes | memoryview) -> torch.Tensor:
        """Framed bytes → tensor with the original shape and dtype."""
