"""Start-up hook for the vLLM environment: let NIXL's UCX progress thread sleep when idle.

This module runs inside the engine's own Python (``make vllm`` installs it into
``.venv-vllm`` with a ``.pth`` line that imports it at interpreter start); it uses the
standard library only and never imports pdx.

Why: NIXL's Python wrapper (``nixl_agent``, 1.5.x) builds its agent config with
``pthrDelay = 0``. The UCX backend's shared progress thread passes that delay to ``poll()``
as its timeout, so with 0 it never blocks: one core per vLLM instance spins at 100 % even
with no request at all (measured: 98 % of a core per idle instance), and on a small box
the spinning threads take the cores the model needs. vLLM has no setting for it.

What it does: when ``PDX_NIXL_PROGRESS_DELAY_US`` is set to a positive number of
microseconds, the first time a ``nixl*._api`` module is imported its ``nixlAgent``
constructor is wrapped so that an agent config with ``pthrDelay == 0`` gets that delay
instead. The thread then blocks in ``poll()`` on the UCX worker's event descriptor (armed
before each wait) and wakes at once when UCX has work; the delay only bounds a wait in
which no event arrives. Without the variable nothing changes.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import re
import sys
from types import ModuleType
from typing import Any

ENV = "PDX_NIXL_PROGRESS_DELAY_US"
_TARGET = re.compile(r"^nixl(_cu\d+|_rocm)?\._api$")


def _delay_us() -> int:
    try:
        return max(0, int(os.environ.get(ENV, "0")))
    except ValueError:
        return 0


class _AgentFactory:
    """Stands in for the bindings module inside ``_api``: only ``nixlAgent`` is changed."""

    def __init__(self, bindings: ModuleType, delay_us: int) -> None:
        self._bindings = bindings
        self._delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)

    def nixlAgent(self, name: str, config: Any) -> Any:
        if getattr(config, "pthrDelay", None) == 0:
            config.pthrDelay = self._delay_us
        return self._bindings.nixlAgent(name, config)


def patch_api(module: ModuleType, delay_us: int) -> bool:
    """Wrap ``module.nixlBind`` (NIXL's bindings as ``_api`` names them); True if patched."""
    bindings = getattr(module, "nixlBind", None)
    if bindings is None or isinstance(bindings, _AgentFactory) or delay_us <= 0:
        return False
    module.nixlBind = _AgentFactory(bindings, delay_us)  # type: ignore[attr-defined]
    return True


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        patch_api(module, _delay_us())


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not _TARGET.match(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Register the import hook once (only when the delay is asked for)."""
    if _delay_us() > 0 and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
