"""Client of the KV store: chunked, checksummed, resumable, bounded in time.

``KVClient(target, cfg, tls=...)`` offers ``put``, ``get``, ``release``, ``renew`` and
``stat``, and streamed objects (``open``, ``get_streamed``). Every call has a deadline
(``kv_transfer_timeout_ms``, for all attempts together); retryable errors are retried with
jittered exponential backoff under the per-request and global budgets; a corrupt chunk is
re-fetched from that chunk, not from zero. Each transfer leaves a :class:`TransferRecord`.

Modules: ``attempts`` (deadlines, attempts, retries, records), ``grpc_transport`` (the
gRPC channels), ``transport`` (:class:`KVTransport`, the data plane, and the
``kv.transport`` policy choosing a transport per attempt), ``put`` (and
:class:`StreamWriter`), ``get`` (and :class:`StreamedGet`), ``facade`` (:class:`KVClient`).
Fetched objects are assembled and verified in :mod:`pdx.transfer.objects`; data-plane
bytes move in worker threads through :mod:`pdx.transfer.dataplane.client`.
"""

from pdx.transfer.client.facade import KVClient
from pdx.transfer.client.get import StreamedGet
from pdx.transfer.client.grpc_transport import CONNECT_ATTEMPT_MS, RECONNECT_OPTIONS
from pdx.transfer.client.put import StreamWriter
from pdx.transfer.client.transport import (
    DATA_RETRY_AFTER_S,
    TRANSPORTS,
    KVTransport,
    TransportPolicy,
)
from pdx.transfer.metrics import TransferRecord
from pdx.transfer.writer import KVWriter

__all__ = [
    "CONNECT_ATTEMPT_MS",
    "DATA_RETRY_AFTER_S",
    "RECONNECT_OPTIONS",
    "TRANSPORTS",
    "KVClient",
    "KVTransport",
    "KVWriter",
    "StreamWriter",
    "StreamedGet",
    "TransferRecord",
    "TransportPolicy",
]
