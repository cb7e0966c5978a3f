"""Codec base class, header framing and the registry."""

from __future__ import annotations

import json
import re
import struct
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
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


_REGISTRY: dict[str, type[KVCodec]] = {}
_FAMILIES: list[tuple[re.Pattern[str], str, Callable[[re.Match[str]], KVCodec]]] = []


def register_codec(cls: type[KVCodec]) -> type[KVCodec]:
    """Class decorator: make a codec available by its ``name``."""
    _REGISTRY[cls.name] = cls
    return cls


def register_codec_family(
    pattern: str, shown_as: str, factory: Callable[[re.Match[str]], KVCodec]
) -> None:
    """Make parametrised names (e.g. ``int4-g<N>``) available: ``factory(match)`` builds one."""
    _FAMILIES.append((re.compile(pattern), shown_as, factory))


def _load_builtin() -> None:
    # Importing the module registers the built-in codecs (kept out of import time).
    import pdx.kv.codecs.builtin  # noqa: F401


def codec_names() -> list[str]:
    """Names of every registered codec, in registration order."""
    _load_builtin()
    return list(_REGISTRY)


def codec_patterns() -> list[str]:
    """Parametrised name forms accepted besides :func:`codec_names` (e.g. ``int4-g<N>``)."""
    _load_builtin()
    return [shown for _, shown, _ in _FAMILIES]


def valid_codec_names() -> str:
    """Every accepted name and name form, for error messages."""
    return ", ".join([*codec_names(), *codec_patterns()])


def is_codec_name(name: str) -> bool:
    """Whether ``name`` is a registered codec or matches a parametrised form (``int4-g16``)."""
    _load_builtin()
    return name in _REGISTRY or any(p.fullmatch(name) for p, _, _ in _FAMILIES)


def get_codec(name: str) -> KVCodec:
    """A codec instance by name; unknown names are an InputError listing the valid ones."""
    _load_builtin()
    if name in _REGISTRY:
        return _REGISTRY[name]()
    for pattern, _, factory in _FAMILIES:
        match = pattern.fullmatch(name)
        if match:
            return factory(match)
    raise InputError("codec", name, f"one of {valid_codec_names()}")


def decode_any(data: bytes | memoryview) -> torch.Tensor:
    """Decode framed bytes with whichever codec its header names."""
    meta, _ = unpack(data)
    return get_codec(str(meta.get("codec"))).decode(data)
