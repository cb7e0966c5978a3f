"""The backend registry: every backend by name, registered in this one place.

Implementations import only :mod:`pdx.serving.backends.base`; this module imports them
(when a backend is first asked for, so that naming backends does not import torch) and
registers each. Third-party backends call :func:`register_backend`.
"""

from __future__ import annotations

from pdx.errors import InputError
from pdx.serving.backends.base import BackendConfig, ModelBackend

_REGISTRY: dict[str, type[ModelBackend]] = {}
_BUILTIN_LOADED = False


def register_backend(cls: type[ModelBackend]) -> type[ModelBackend]:
    """Make a backend available by its ``name`` (usable as a class decorator)."""
    _REGISTRY[cls.name] = cls
    return cls


def _load_builtin() -> None:
    global _BUILTIN_LOADED
    if _BUILTIN_LOADED:
        return
    from pdx.serving.backends.synthetic import SyntheticBackend
    from pdx.serving.backends.transformers_backend import TransformersBackend

    for cls in (SyntheticBackend, TransformersBackend):
        _REGISTRY.setdefault(cls.name, cls)
    _BUILTIN_LOADED = True


def backend_names() -> list[str]:
    """Names of every registered backend."""
    _load_builtin()
    return list(_REGISTRY)


def create_backend(cfg: BackendConfig) -> ModelBackend:
    """Build the backend named in ``cfg``; an unknown name is an InputError."""
    _load_builtin()
    try:
        cls = _REGISTRY[cfg.backend]
    except KeyError:
        raise InputError("model.backend", cfg.backend, f"one of {', '.join(_REGISTRY)}") from None
    return cls(cfg)
