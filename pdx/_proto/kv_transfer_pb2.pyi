from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_ERROR_UNSPECIFIED: _ClassVar[KVErrorCode]
    KV_NOT_FOUND: _ClassVar[KVErrorCode]
    KV_EXPIRED: _ClassVar[KVErrorCode]
    KV_CORRUPT: _ClassVar[KVErrorCode]
    KV_TIMEOUT: _ClassVar[KVErrorCode]
    RETRY_BUDGET_EXHAUSTED: _ClassVar[KVErrorCode]
    KV_OVERLOADED: _ClassVar[KVErrorCode]
    KV_STORE_FULL: _ClassVar[KVErrorCode]
    KV_INVALID: _ClassVar[KVErrorCode]
    KV_UNAVAILABLE: _ClassVar[KVErrorCode]
    KV_UNAUTHENTICATED: _ClassVar[KVErrorCode]
    KV_INTERNAL: _ClassVar[KVErrorCode]
    KV_INCOMPLETE: _ClassVar[KVErrorCode]
KV_ERROR_UNSPECIFIED: KVErrorCode
KV_NOT_FOUND: KVErrorCode
KV_EXPIRED: KVErrorCode
KV_CORRUPT: KVErrorCode
KV_TIMEOUT: KVErrorCode
RETRY_BUDGET_EXHAUSTED: KVErrorCode
KV_OVERLOADED: KVErrorCode
KV_STORE_FULL: KVErrorCode
KV_INVALID: KVErrorCode
KV_UNAVAILABLE: KVErrorCode
KV_UNAUTHENTICATED: KVErrorCode
KV_INTERNAL: KVErrorCode
KV_INCOMPLETE: KVErrorCode

class TensorShape(_message.Message):
    __slots__ = ("dims",)
    DIMS_FIELD_NUMBER: _ClassVar[int]
    dims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dims: _Optional[_Iterable[int]] = ...) -> None: ...

class Layout(_message.Message):
    __slots__ = ("num_layers", "dtype", "shapes", "codec", "tensor_bytes", "roles")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPES_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    TENSOR_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    dtype: str
    shapes: _containers.RepeatedCompositeFieldContainer[TensorShape]
    codec: str
    tensor_bytes: _containers.RepeatedScalarFieldContainer[int]
    roles: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, num_layers: _Optional[int] = ..., dtype: _Optional[str] = ..., shapes: _Optional[_Iterable[_Union[TensorShape, _Mapping]]] = ..., codec: _Optional[str] = ..., tensor_bytes: _Optional[_Iterable[int]] = ..., roles: _Optional[_Iterable[str]] = ...) -> None: ...

class ObjectInfo(_message.Message):
    __slots__ = ("kv_id", "model_version", "created_at_ms", "ttl_s", "layout", "size_bytes", "chunk_size_bytes", "num_chunks", "object_digest", "expires_at_ms", "chunk_digests", "writing", "chunks_stored", "tail")
    KV_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    OBJECT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    WRITING_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_STORED_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    kv_id: str
    model_version: str
    created_at_ms: int
    ttl_s: int
    layout: Layout
    size_bytes: int
    chunk_size_bytes: int
    num_chunks: int
    object_digest: int
    expires_at_ms: int
    chunk_digests: _containers.RepeatedScalarFieldContainer[int]
    writing: bool
    chunks_stored: int
    tail: bytes
    def __init__(self, kv_id: _Optional[str] = ..., model_version: _Optional[str] = ..., created_at_ms: _Optional[int] = ..., ttl_s: _Optional[int] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., size_bytes: _Optional[int] = ..., chunk_size_bytes: _Optional[int] = ..., num_chunks: _Optional[int] = ..., object_digest: _Optional[int] = ..., expires_at_ms: _Optional[int] = ..., chunk_digests: _Optional[_Iterable[int]] = ..., writing: _Optional[bool] = ..., chunks_stored: _Optional[int] = ..., tail: _Optional[bytes] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("index", "digest", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    digest: int
    data: bytes
    def __init__(self, index: _Optional[int] = ..., digest: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutHeader(_message.Message):
    __slots__ = ("model_version", "ttl_s", "layout", "size_bytes", "chunk_size_bytes", "object_digest", "upload_token", "start_chunk", "digest_in_trailer")
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OBJECT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_TOKEN_FIELD_NUMBER: _ClassVar[int]
    START_CHUNK_FIELD_NUMBER: _ClassVar[int]
    DIGEST_IN_TRAILER_FIELD_NUMBER: _ClassVar[int]
    model_version: str
    ttl_s: int
    layout: Layout
    size_bytes: int
    chunk_size_bytes: int
    object_digest: int
    upload_token: bytes
    start_chunk: int
    digest_in_trailer: bool
    def __init__(self, model_version: _Optional[str] = ..., ttl_s: _Optional[int] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., size_bytes: _Optional[int] = ..., chunk_size_bytes: _Optional[int] = ..., object_digest: _Optional[int] = ..., upload_token: _Optional[bytes] = ..., start_chunk: _Optional[int] = ..., digest_in_trailer: _Optional[bool] = ...) -> None: ...

class OpenRequest(_message.Message):
    __slots__ = ("header",)
    HEADER_FIELD_NUMBER: _ClassVar[int]
    header: PutHeader
    def __init__(self, header: _Optional[_Union[PutHeader, _Mapping]] = ...) -> None: ...

class OpenResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: ObjectInfo
    def __init__(self, info: _Optional[_Union[ObjectInfo, _Mapping]] = ...) -> None: ...

class PutTrailer(_message.Message):
    __slots__ = ("object_digest", "size_bytes", "layout", "tail")
    OBJECT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    object_digest: int
    size_bytes: int
    layout: Layout
    tail: bytes
    def __init__(self, object_digest: _Optional[int] = ..., size_bytes: _Optional[int] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., tail: _Optional[bytes] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("header", "chunk", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: PutHeader
    chunk: Chunk
    trailer: PutTrailer
    def __init__(self, header: _Optional[_Union[PutHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., trailer: _Optional[_Union[PutTrailer, _Mapping]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("info", "missing_chunks")
    INFO_FIELD_NUMBER: _ClassVar[int]
    MISSING_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    info: ObjectInfo
    missing_chunks: int
    def __init__(self, info: _Optional[_Union[ObjectInfo, _Mapping]] = ..., missing_chunks: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("kv_id", "from_chunk", "to_chunk")
    KV_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_CHUNK_FIELD_NUMBER: _ClassVar[int]
    TO_CHUNK_FIELD_NUMBER: _ClassVar[int]
    kv_id: str
    from_chunk: int
    to_chunk: int
    def __init__(self, kv_id: _Optional[str] = ..., from_chunk: _Optional[int] = ..., to_chunk: _Optional[int] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("info", "chunk")
    INFO_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    info: ObjectInfo
    chunk: Chunk
    def __init__(self, info: _Optional[_Union[ObjectInfo, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("kv_id",)
    KV_ID_FIELD_NUMBER: _ClassVar[int]
    kv_id: str
    def __init__(self, kv_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("size_bytes", "object_digest")
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OBJECT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    size_bytes: int
    object_digest: int
    def __init__(self, size_bytes: _Optional[int] = ..., object_digest: _Optional[int] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("kv_id", "lease_s")
    KV_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    kv_id: str
    lease_s: int
    def __init__(self, kv_id: _Optional[str] = ..., lease_s: _Optional[int] = ...) -> None: ...

class RenewResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: ObjectInfo
    def __init__(self, info: _Optional[_Union[ObjectInfo, _Mapping]] = ...) -> None: ...

class StatRequest(_message.Message):
    __slots__ = ("kv_id",)
    KV_ID_FIELD_NUMBER: _ClassVar[int]
    kv_id: str
    def __init__(self, kv_id: _Optional[str] = ...) -> None: ...

class StatResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: ObjectInfo
    def __init__(self, info: _Optional[_Union[ObjectInfo, _Mapping]] = ...) -> None: ...

class DataPlaneRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DataPlaneResponse(_message.Message):
    __slots__ = ("enabled", "port", "tls", "max_frame_bytes", "congestion_controls")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONGESTION_CONTROLS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    port: int
    tls: bool
    max_frame_bytes: int
    congestion_controls: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, enabled: _Optional[bool] = ..., port: _Optional[int] = ..., tls: _Optional[bool] = ..., max_frame_bytes: _Optional[int] = ..., congestion_controls: _Optional[_Iterable[str]] = ...) -> None: ...

class DataHello(_message.Message):
    __slots__ = ("version", "client_id", "congestion_control", "send_buffer_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    CONGESTION_CONTROL_FIELD_NUMBER: _ClassVar[int]
    SEND_BUFFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: str
    client_id: str
    congestion_control: str
    send_buffer_bytes: int
    def __init__(self, version: _Optional[str] = ..., client_id: _Optional[str] = ..., congestion_control: _Optional[str] = ..., send_buffer_bytes: _Optional[int] = ...) -> None: ...

class DataRequest(_message.Message):
    __slots__ = ("timeout_ms", "put", "get")
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    PUT_FIELD_NUMBER: _ClassVar[int]
    GET_FIELD_NUMBER: _ClassVar[int]
    timeout_ms: int
    put: PutHeader
    get: GetRequest
    def __init__(self, timeout_ms: _Optional[int] = ..., put: _Optional[_Union[PutHeader, _Mapping]] = ..., get: _Optional[_Union[GetRequest, _Mapping]] = ...) -> None: ...

class DataError(_message.Message):
    __slots__ = ("code", "message", "has_resume_chunk", "resume_chunk")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    HAS_RESUME_CHUNK_FIELD_NUMBER: _ClassVar[int]
    RESUME_CHUNK_FIELD_NUMBER: _ClassVar[int]
    code: KVErrorCode
    message: str
    has_resume_chunk: bool
    resume_chunk: int
    def __init__(self, code: _Optional[_Union[KVErrorCode, str]] = ..., message: _Optional[str] = ..., has_resume_chunk: _Optional[bool] = ..., resume_chunk: _Optional[int] = ...) -> None: ...
