"""KV transfer: the KV contract's implementation, for moving KV objects between sites.

The layer below the serving pair and beside the link probe: ``contract`` (kv_id, error
codes, layout, configs), ``wire`` (chunk messages and digests), ``store`` (TTL, lease,
budget, LRU), ``service`` and ``rpc`` (the gRPC service and its error mapping), ``server``
(lifecycle), ``dataplane`` (raw chunk bytes on a socket of their own), ``client`` (deadlines,
retries, budgets, striping, the choice of transport), ``writer`` (the interface of a
streamed object's writer) and ``local`` (that writer into a store in this process),
``objects`` (encoding and verified assembly), ``audit``, ``metrics``, ``retry`` and
``bench`` (``pdx kv-bench``). It imports nothing from :mod:`pdx.serving`.
"""

__all__ = [
    "audit",
    "bench",
    "client",
    "contract",
    "dataplane",
    "local",
    "metrics",
    "objects",
    "path",
    "retry",
    "rpc",
    "server",
    "service",
    "store",
    "wire",
    "writer",
]
