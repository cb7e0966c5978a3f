"""The codec registry: every codec by name, the built-in ones registered in this one place.

Implementations (:mod:`.raw`, :mod:`.lossy`, :mod:`.lossless`) import only :mod:`.base`;
this module imports them when a codec is first asked for and registers each. Third-party
codecs call :func:`register_codec`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdx.errors import InputError
from pdx.kv.codecs.base import KVCodec, unpack

if TYPE_CHECKING:
    import torch

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


_BUILTIN_LOADED = False


def _load_builtin() -> None:
    """Register every built-in codec (in the order tables list them), once."""
    global _BUILTIN_LOADED
    if _BUILTIN_LOADED:
        return
    from pdx.kv.codecs import lossless, lossy
    from pdx.kv.codecs.raw import RawCodec

    builtin: list[type[KVCodec]] = [
        RawCodec,
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
    ]
    registered = dict(_REGISTRY)  # codecs registered before the built-ins keep their place
    _REGISTRY.clear()
    for cls in builtin:
        _REGISTRY[cls.name] = cls
    _REGISTRY.update(registered)
    register_codec_family(lossy.INT_PATTERN, "int{4|8}[-g<N>]", lossy.int_codec_from_name)
    _BUILTIN_LOADED = True


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
