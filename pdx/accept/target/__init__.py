"""Stage 1 of a run: the system under test, up and reachable, with the conditions each step
asks for on its KV link.

``process`` (an external URL's readiness, the ``pdx deploy`` child process), ``deploy`` (the
pair started with ``pdx deploy``, its fault proxy if asked), ``netns`` (the pair placed in two
emulated sites, packet-level conditions per step), ``proxy`` (conditions applied through the
userspace fault proxy on the KV link), ``engine_faults`` (an engine instance killed mid-step).
"""

__all__ = ["deploy", "engine_faults", "netns", "process", "proxy"]
