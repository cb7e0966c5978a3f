"""Link probing for ``pdx probe-server`` and ``pdx probe-link``: probe server and client,
statistics, verdict rules.

Public modules: ``server`` (the probe server), ``probe`` (the client run), ``kv_transport``
(probing with real KV transfers), ``stats`` (bounds), ``verdict`` (the link verdict).
"""

__all__ = ["kv_transport", "probe", "server", "stats", "verdict"]
