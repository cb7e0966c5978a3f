"""The backend registry: register a backend by name, list the names, build one from config.

Implementations import only :mod:`pdx.serving.backends.base`; the table they are named in
(:data:`~pdx.serving.backends.base.BACKENDS`) lists the built-ins by import path, loaded
here when first asked for. Third-party backends call :func:`register_backend`.
"""

from __future__ import annotations

import importlib

from pdx.errors import InputError
from pdx.serving.backends.base import BACKENDS, BackendConfig, ModelBackend


def register_backend(cls: type[ModelBackend]) -> type[ModelBackend]:
    """Make a backend available by its ``name`` (usable as a class decorator)."""
    BACKENDS[cls.name] = cls
    return cls


def backend_names() -> list[str]:
    """Names of every registered backend."""
    return list(BACKENDS)


def _load(name: str) -> type[ModelBackend]:
    entry = BACKENDS[name]
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = BACKENDS[name] = getattr(importlib.import_module(module), attr)
    return entry


def create_backend(cfg: BackendConfig) -> ModelBackend:
    """Build the backend named in ``cfg``; an unknown name is an InputError."""
    if cfg.backend not in BACKENDS:
        raise InputError("model.backend", cfg.backend, f"one of {', '.join(BACKENDS)}")
    return _load(cfg.backend)(cfg)
