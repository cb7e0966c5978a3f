"""Model backends: a small registry of engines that run prefill and decode steps.

``transformers`` runs a real causal LM (a local checkpoint or a tiny seeded random model
built from a preset config); ``synthetic`` has no weights and produces KV of the exact
layout and size a named model would, taking its compute time from roofline formulas.
"""

from pdx.serving.backends.base import BackendConfig, KVState, ModelBackend
from pdx.serving.backends.registry import backend_names, create_backend, register_backend

__all__ = [
    "BackendConfig",
    "KVState",
    "ModelBackend",
    "backend_names",
    "create_backend",
    "register_backend",
]
