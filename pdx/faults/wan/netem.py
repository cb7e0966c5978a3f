"""The kernel's own emulator, where it exists: one ``netem`` qdisc per direction on the router.

Users' hosts usually have ``sch_netem``; this module turns :class:`LinkConditions` into its
arguments (delay with normal jitter, random or Gilbert loss, reordering, duplication, rate and
a packet limit sized to the delay plus the bottleneck queue) and reads its counters. netem
acts per queued skb, and the kernel hands veths 64 KB aggregates, so for loss, reordering or
duplication per wire packet the site veths send unaggregated frames (``gso_max_segs 1``).
"""

from __future__ import annotations

import math
import re
import subprocess
from typing import Any

from pdx.faults.wan.conditions import LinkConditions

_STATS = re.compile(
    r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+) requeues (\d+)\)"
)
_BACKLOG = re.compile(r"backlog (\S+) (\d+)p")


def available(router_ns: str) -> bool:
    """Whether this kernel has ``sch_netem`` (tried on the router's loopback, then removed)."""
    add = ["tc", "-n", router_ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "0ms"]
    ok = subprocess.run(add, capture_output=True, check=False).returncode == 0
    if ok:
        subprocess.run(["tc", "-n", router_ns, "qdisc", "del", "dev", "lo", "root"],
                       capture_output=True, check=False)  # fmt: skip
    return ok


def limit_packets(c: LinkConditions, mtu: int) -> int:
    """netem's queue (in packets) must hold what the delay line holds plus the bottleneck queue."""
    held_ms = c.delay_ms + 4 * c.jitter_ms + c.queue_ms
    return max(100, math.ceil(c.rate_mbit * 1e6 / 8 * held_ms / 1e3 / mtu))


def args(c: LinkConditions, mtu: int) -> list[str]:
    """``tc qdisc ... netem`` arguments for one direction."""
    out = ["delay", f"{c.delay_ms:g}ms"]
    if c.jitter_ms:
        out += [f"{c.jitter_ms:g}ms", "distribution", "normal"]
    if c.loss and c.loss_model == "gilbert":
        p, r = c.gilbert_p_r()
        out += ["loss", "gemodel", f"{p * 100:.6g}%", f"{r * 100:.6g}%"]
    elif c.loss:
        out += ["loss", "random", f"{c.loss * 100:.6g}%"]
    if c.duplicate:
        out += ["duplicate", f"{c.duplicate * 100:.6g}%"]
    if c.reorder:
        out += ["reorder", f"{c.reorder * 100:.6g}%"]
    out += ["rate", f"{c.rate_mbit:g}mbit", "limit", str(limit_packets(c, mtu))]
    return out


def per_packet(c: LinkConditions) -> bool:
    """Whether the condition needs single wire packets (not aggregates) to be exact."""
    return bool(c.loss or c.reorder or c.duplicate)


def counters(qdisc_text: str) -> dict[str, Any]:
    """Counters of one ``tc -s qdisc show`` netem block."""
    out: dict[str, Any] = {}
    m = _STATS.search(qdisc_text)
    if m:
        sent_b, sent_p, dropped, overlimits, requeues = (int(g) for g in m.groups())
        out.update(bytes_out=sent_b, packets_out=sent_p, dropped=dropped,
                   overlimits=overlimits, requeues=requeues)  # fmt: skip
    m = _BACKLOG.search(qdisc_text)
    if m:
        out["queue_packets"] = int(m.group(2))
    return out
