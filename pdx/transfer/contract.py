"""The KV contract in code: kv_id, error codes, layout, bounds and validated configs.

``contracts/kv_contract.yaml`` states the same rules for people; a test keeps both in
step. Nothing here touches the network, so every layer (store, server, client,
scheduler) can import it cheaply.
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdx.errors import PdxError
from pdx.tls import TLSConfig
from pdx.units import GIB, KIB

if TYPE_CHECKING:
    from pdx._proto import kv_transfer_pb2 as pb

CONTRACT_VERSION = "pdx.kv.v1"
TTL_MIN_S = 60
TTL_MAX_S = 300
DEFAULT_TTL_S = 120
CHUNK_MIN_KB = 64
CHUNK_MAX_KB = 8192
DEFAULT_CHUNK_KB = 1024
DEFAULT_LEASE_S = 20
MAX_LEASE_S = 60
DEFAULT_RETRY_BUDGET = 2
MAX_RETRY_BUDGET = 10
DEFAULT_MAX_INFLIGHT_KV = 32
DEFAULT_STORE_BUDGET_BYTES = 4 * GIB
TAIL_MAX_BYTES = 4096  # what a streamed object's writer may attach when it closes it

ERROR_METADATA_KEY = "pdx-kv-error"
RESUME_METADATA_KEY = "pdx-kv-resume-chunk"
CLIENT_ID_METADATA_KEY = "pdx-client-id"


class KVErrorCode(StrEnum):
    """Contract error codes; names equal the ``KVErrorCode`` enum in kv_transfer.proto."""

    KV_NOT_FOUND = "KV_NOT_FOUND"
    KV_EXPIRED = "KV_EXPIRED"
    KV_CORRUPT = "KV_CORRUPT"
    KV_TIMEOUT = "KV_TIMEOUT"
    RETRY_BUDGET_EXHAUSTED = "RETRY_BUDGET_EXHAUSTED"
    KV_OVERLOADED = "KV_OVERLOADED"
    KV_STORE_FULL = "KV_STORE_FULL"
    KV_INVALID = "KV_INVALID"
    KV_UNAVAILABLE = "KV_UNAVAILABLE"
    KV_UNAUTHENTICATED = "KV_UNAUTHENTICATED"
    KV_INTERNAL = "KV_INTERNAL"
    KV_INCOMPLETE = "KV_INCOMPLETE"


# Contract code -> gRPC status code name (grpc.StatusCode member). One table, used by
# the server interceptor and, in reverse as a fallback, by the client wrapper.
GRPC_STATUS: dict[KVErrorCode, str] = {
    KVErrorCode.KV_NOT_FOUND: "NOT_FOUND",
    KVErrorCode.KV_EXPIRED: "NOT_FOUND",
    KVErrorCode.KV_CORRUPT: "DATA_LOSS",
    KVErrorCode.KV_TIMEOUT: "DEADLINE_EXCEEDED",
    KVErrorCode.RETRY_BUDGET_EXHAUSTED: "UNAVAILABLE",
    KVErrorCode.KV_OVERLOADED: "RESOURCE_EXHAUSTED",
    KVErrorCode.KV_STORE_FULL: "RESOURCE_EXHAUSTED",
    KVErrorCode.KV_INVALID: "INVALID_ARGUMENT",
    KVErrorCode.KV_UNAVAILABLE: "UNAVAILABLE",
    KVErrorCode.KV_UNAUTHENTICATED: "UNAUTHENTICATED",
    KVErrorCode.KV_INTERNAL: "INTERNAL",
    KVErrorCode.KV_INCOMPLETE: "ABORTED",
}

# What a client may retry (with backoff, under both retry budgets).
RETRYABLE: frozenset[KVErrorCode] = frozenset(
    {
        KVErrorCode.KV_CORRUPT,
        KVErrorCode.KV_TIMEOUT,
        KVErrorCode.KV_OVERLOADED,
        KVErrorCode.KV_UNAVAILABLE,
    }
)


class KVError(PdxError):
    """A contract error. ``resume_chunk`` says where a retry may resume a transfer."""

    def __init__(
        self,
        code: KVErrorCode,
        message: str,
        *,
        kv_id: str = "",
        resume_chunk: int | None = None,
        retries: int = 0,
    ) -> None:
        self.code = code
        self.message = message
        self.kv_id = kv_id
        self.resume_chunk = resume_chunk
        self.retries = retries
        where = f" [{kv_id}]" if kv_id else ""
        super().__init__(f"{code.value}: {message}{where}")

    @property
    def retryable(self) -> bool:
        """Whether the contract allows retrying this error."""
        return self.code in RETRYABLE


# --- kv_id -----------------------------------------------------------------------------

_MODEL_VERSION = re.compile(r"^[A-Za-z0-9._:/+-]{1,64}$")
MAX_KV_ID_CHARS = 4 + 32 + 1 + 15 + 1 + 64  # kv1.<hex32>.<ms>.<model version>
_KV_ID = re.compile(r"^kv1\.([0-9a-f]{32})\.([0-9]{1,15})\.([A-Za-z0-9._:/+-]{1,64})$")


@dataclass(frozen=True)
class KVId:
    """A parsed kv_id: 128 random bits, creation time (Unix ms) and model version."""

    random_hex: str
    created_at_ms: int
    model_version: str

    def __str__(self) -> str:
        return f"kv1.{self.random_hex}.{self.created_at_ms}.{self.model_version}"


def check_model_version(model_version: str) -> str:
    """Return ``model_version`` if it fits in a kv_id, else raise KV_INVALID."""
    if not _MODEL_VERSION.match(model_version):
        raise KVError(
            KVErrorCode.KV_INVALID,
            f"model_version {model_version!r}: expected 1-64 chars of [A-Za-z0-9._:/+-]",
        )
    return model_version


def new_kv_id(model_version: str, created_at_ms: int) -> str:
    """A fresh, unguessable kv_id (128 bits from ``secrets``) carrying version and time."""
    check_model_version(model_version)
    return str(KVId(secrets.token_hex(16), created_at_ms, model_version))


def parse_kv_id(kv_id: str) -> KVId:
    """Parse a kv_id; a malformed one is KV_INVALID (an unknown well-formed one is not)."""
    m = _KV_ID.match(kv_id)
    if m is None:
        raise KVError(KVErrorCode.KV_INVALID, f"malformed kv_id {kv_id[:80]!r}")
    return KVId(m.group(1), int(m.group(2)), m.group(3))


# --- layout ----------------------------------------------------------------------------


@dataclass
class KVLayout:
    """How an object's bytes map back to tensors, and which codec encoded them."""

    codec: str = "raw"
    dtype: str = ""
    num_layers: int = 0
    shapes: list[list[int]] = field(default_factory=list)
    tensor_bytes: list[int] = field(default_factory=list)
    roles: list[str] = field(default_factory=list)

    def to_proto(self) -> pb.Layout:
        """As the wire message."""
        from pdx._proto import kv_transfer_pb2 as pb

        return pb.Layout(
            num_layers=self.num_layers,
            dtype=self.dtype,
            shapes=[pb.TensorShape(dims=s) for s in self.shapes],
            codec=self.codec,
            tensor_bytes=self.tensor_bytes,
            roles=self.roles,
        )

    @classmethod
    def from_proto(cls, msg: pb.Layout) -> KVLayout:
        """From the wire message."""
        return cls(
            codec=msg.codec,
            dtype=msg.dtype,
            num_layers=msg.num_layers,
            shapes=[list(s.dims) for s in msg.shapes],
            tensor_bytes=list(msg.tensor_bytes),
            roles=list(msg.roles),
        )


# --- clocks ----------------------------------------------------------------------------


class Clock(Protocol):
    """Time source for TTLs and leases; tests inject :class:`ManualClock`."""

    def now_s(self) -> float:
        """Monotonic seconds."""
        ...

    def wall_ms(self) -> int:
        """Unix epoch milliseconds."""
        ...


class SystemClock:
    """The real clock."""

    def now_s(self) -> float:
        """Monotonic seconds."""
        return time.monotonic()

    def wall_ms(self) -> int:
        """Unix epoch milliseconds."""
        return time.time_ns() // 1_000_000


class ManualClock:
    """A clock that moves only when told to: lets tests pass a 120 s TTL instantly."""

    def __init__(self, start_s: float = 1000.0, wall_ms: int = 1_700_000_000_000) -> None:
        self._now_s = start_s
        self._wall0_ms = wall_ms
        self._start_s = start_s

    def advance(self, seconds: float) -> None:
        """Move time forward."""
        self._now_s += seconds

    def now_s(self) -> float:
        """Monotonic seconds."""
        return self._now_s

    def wall_ms(self) -> int:
        """Unix epoch milliseconds."""
        return self._wall0_ms + int((self._now_s - self._start_s) * 1000)


# --- configs ---------------------------------------------------------------------------

# Settings the contract's configs share with the configs that embed them (a deployment's
# ``kv.*``): each type carries its field's bounds once; the defaults are the constants above.
TTLSeconds = Annotated[int, Field(ge=TTL_MIN_S, le=TTL_MAX_S)]
ChunkSizeKB = Annotated[int, Field(ge=CHUNK_MIN_KB, le=CHUNK_MAX_KB)]
BudgetBytes = Annotated[int, Field(gt=0)]
InflightKV = Annotated[int, Field(ge=1)]
RetryBudget = Annotated[int, Field(ge=0, le=MAX_RETRY_BUDGET)]
Streams = Annotated[
    int, Field(ge=1, le=16, description="stripes per object, each on its own socket")
]
Connections = Annotated[int, Field(ge=1, le=16, description="gRPC channels per store")]
CongestionControl = Annotated[
    Literal["bbr", "cubic", "system"],
    Field(description="TCP algorithm of the data plane (bbr where the kernel has it)"),
]
LinkGbps = Annotated[
    float | None,
    Field(gt=0, le=1000, description="the link's rate: sizes socket buffers to its BDP"),
]
Transport = Literal["auto", "grpc", "data"]
#: Bounds of a transfer's deadline (all attempts together), whatever its number type.
TRANSFER_TIMEOUT_MS = Field(
    gt=0,
    description="deadline of one transfer, all attempts together; null = derived from the "
    "object's size and the path's measured RTT and goodput (see docs/kv-transfer.md)",
)
TransferTimeoutMs = Annotated[int | None, TRANSFER_TIMEOUT_MS]


class KVStoreConfig(BaseModel):
    """The store server (prefill side)."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)
    budget_bytes: BudgetBytes = DEFAULT_STORE_BUDGET_BYTES
    kv_ttl_seconds: TTLSeconds = DEFAULT_TTL_S
    lease_s: int = Field(default=DEFAULT_LEASE_S, ge=1, le=MAX_LEASE_S)
    max_inflight_kv: InflightKV = DEFAULT_MAX_INFLIGHT_KV
    inflight_wait_ms: int = Field(default=1000, ge=0)
    sweep_interval_s: float = Field(default=1.0, gt=0)
    chunk_size_kb_max: ChunkSizeKB = CHUNK_MAX_KB
    checksum: Literal["xxh3_64"] = "xxh3_64"
    eviction_policy: Literal["TTL+LRU"] = "TTL+LRU"
    audit_path: Path | None = None
    tls: TLSConfig | None = None
    # The bulk data plane (raw chunk payloads on a socket of its own, same TLS identity):
    # on by default, on ``data_port`` (0 = any free port, announced by the DataPlane RPC).
    data_plane: bool = True
    data_port: int = Field(default=0, ge=0, le=65535)
    # Congestion control of the data plane's sockets unless the client asks for another the
    # kernel offers; and the largest send buffer a client may ask for (a long fat path's
    # BDP), which bounds what one connection can hold of the store's memory.
    congestion_control: CongestionControl = "bbr"
    max_send_buffer_bytes: int = Field(default=64 * 1024 * 1024, ge=0, le=1 << 30)
    # The most this store's Gets send across the link, Gbit/s: the data plane paces each
    # connection sending a Get at this divided by the Gets sending at once (None: unpaced).
    max_get_gbps: float | None = Field(default=None, gt=0, le=10_000)
    # Limits against hostile peers (docs/kv-transfer.md, "Security and limits"). Peers are
    # told apart by certificate identity, else by source address.
    max_connections: int = Field(default=256, ge=1, le=65536)  # data-plane connections
    max_unauthenticated: int = Field(default=64, ge=1)  # not yet past TLS and HELLO
    max_connections_per_peer: int = Field(default=64, ge=1)
    max_unauthenticated_per_peer: int = Field(default=8, ge=1)
    handshake_timeout_s: float = Field(default=5.0, gt=0, le=120)  # TLS + HELLO, in all
    max_request_timeout_ms: int = Field(default=300_000, gt=0)  # caps a client's deadline
    stall_timeout_s: float = Field(default=10.0, gt=0, le=600)  # no progress: end it
    upload_resume_s: float = Field(default=10.0, ge=0, le=300)  # a failed upload stays rejoinable
    # None: all but a quarter of max_inflight_kv (kept for other peers), or all of a pool
    # smaller than 4
    max_inflight_per_peer: int | None = Field(default=None, ge=1)
    # Bytes one peer may hold reserved in streamed objects still being written (rpc Open);
    # None: half of budget_bytes, so a peer that opens objects and never writes them
    # cannot take the whole budget before the stall sweep ends them.
    max_open_bytes_per_peer: int | None = Field(default=None, ge=1)
    # Who may Get, Stat, Renew and Release an object besides the identity that wrote it:
    # service names (a certificate's CN, else the declared client id); "*" = anyone.
    readers: list[str] = Field(default_factory=lambda: ["decode"])

    @property
    def open_bytes_per_peer(self) -> int:
        """Bytes one peer may hold reserved in objects it is still writing."""
        if self.max_open_bytes_per_peer is not None:
            return self.max_open_bytes_per_peer
        return self.budget_bytes // 2

    @property
    def inflight_per_peer(self) -> int:
        """Transfer slots one peer may hold at once."""
        if self.max_inflight_per_peer is not None:
            return self.max_inflight_per_peer
        n = self.max_inflight_kv
        return n if n < 4 else n - n // 4


class KVClientConfig(BaseModel):
    """The client (decode side reading, prefill side writing)."""

    model_config = ConfigDict(extra="forbid")

    # None: derived per request from its size and the path's measured RTT and goodput
    # (pdx.transfer.path); a number is a fixed deadline for every request.
    kv_transfer_timeout_ms: TransferTimeoutMs = None
    kv_retry_budget: RetryBudget = DEFAULT_RETRY_BUDGET
    chunk_size_kb: ChunkSizeKB = DEFAULT_CHUNK_KB
    streams: Streams = 1
    connections: Connections = 1
    backoff_base_ms: float = Field(default=10.0, gt=0)
    backoff_max_ms: float = Field(default=200.0, gt=0)
    retry_ratio: float = Field(default=0.1, ge=0, le=1)
    retry_min_per_s: float = Field(default=10.0, ge=0)
    retry_window_s: float = Field(default=10.0, gt=0)
    client_id: str = "pdx-client"
    checksum: Literal["xxh3_64"] = "xxh3_64"
    # How Put/Get bytes travel: "data" = the store's data plane (fails if it has none),
    # "grpc" = inside gRPC messages, "auto" = the data plane when the store offers it.
    transport: Transport = "auto"
    # HOST:PORT to dial for the data plane instead of the gRPC host + announced port
    # (a NAT, a port forward, or a fault proxy in front of it).
    data_target: str | None = None
    # TCP congestion control of the data plane's sockets (this side's, and asked of the
    # store for what it sends): bbr where the kernel has it, else the system's default.
    congestion_control: CongestionControl = "bbr"
    # The link's rate, when known (pdx probe-link measures it): socket buffers are then sized
    # to twice its bandwidth-delay product, up to the kernel's limits; None = autotuning.
    link_gbps: LinkGbps = None

    @model_validator(mode="after")
    def _backoff_order(self) -> KVClientConfig:
        if self.backoff_max_ms < self.backoff_base_ms:
            raise ValueError("backoff_max_ms must be >= backoff_base_ms")
        return self

    @property
    def chunk_size_bytes(self) -> int:
        """Chunk size in bytes."""
        return self.chunk_size_kb * KIB


def config_defaults() -> dict[str, Any]:
    """Default values of both configs, as the contract YAML states them."""
    return {
        "store": KVStoreConfig().model_dump(mode="json"),
        "client": KVClientConfig().model_dump(mode="json"),
    }
