"""KV codecs: a small registry of tensor <-> bytes encoders, reused by the transfer path.

Every codec turns one tensor into self-describing bytes (shape, dtype and codec
parameters travel in a header) and back. Lossless codecs round-trip exactly; lossy
ones stay within the error bound they document.
"""

from pdx.kv.codecs.base import KVCodec, Role
from pdx.kv.codecs.registry import (
    codec_names,
    get_codec,
    is_codec_name,
    register_codec,
    valid_codec_names,
)

__all__ = [
    "KVCodec",
    "Role",
    "codec_names",
    "get_codec",
    "is_codec_name",
    "register_codec",
    "valid_codec_names",
]
