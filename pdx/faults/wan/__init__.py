"""Packet-level WAN conditions between the namespaces: delay, jitter, loss, reordering,
duplication, rate and cuts per wire packet, with the kernel's netem or pdx's userspace
delay line (see docs/faults.md, "A WAN that TCP feels").
"""

__all__ = ["conditions", "control", "netem", "timeline"]
