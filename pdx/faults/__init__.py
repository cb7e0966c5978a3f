"""Fault injection: userspace TCP/UDP proxy, kernel shaping between namespaces, control API.

Python API (stable)::

    from pdx.faults import FaultProxy, Latency
    async with FaultProxy(("127.0.0.1", 0), ("127.0.0.1", port)) as proxy:
        proxy.add_toxic(Latency(latency_ms=25))   # or a dict: {"type": "latency", ...}
        await proxy.link_down(duration_s=2)
"""

from pdx.faults.proxy import FaultProxy, parse_hostport
from pdx.faults.toxics import (
    Bandwidth,
    Corrupt,
    Duplicate,
    Latency,
    LimitData,
    Loss,
    Reorder,
    ResetPeer,
    Slicer,
    SlowClose,
    Stall,
    Timeout,
    Toxic,
    parse_toxic,
)

__all__ = [
    "Bandwidth",
    "Corrupt",
    "Duplicate",
    "FaultProxy",
    "Latency",
    "LimitData",
    "Loss",
    "Reorder",
    "ResetPeer",
    "Slicer",
    "SlowClose",
    "Stall",
    "Timeout",
    "Toxic",
    "parse_hostport",
    "parse_toxic",
]
