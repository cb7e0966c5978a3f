"""Start-up hooks for the vLLM environment: threads that spin while they have nothing to do.

This module runs inside the engine's own Python (``make vllm`` installs it into
``.venv-vllm`` as ``pdx_engine_hooks`` with a ``.pth`` line that imports it at interpreter
start); it uses the standard library only and never imports pdx. Each hook acts only when
its environment variable is set (pdx sets them for the instances it starts), and only on the
module it names, right after that module is imported.

``PDX_NIXL_PROGRESS_DELAY_US`` — NIXL's Python wrapper (``nixl_agent``, 1.5.x) builds its
agent config with ``pthrDelay = 0``; the UCX backend's shared progress thread passes that
delay to ``poll()`` as its timeout, so it never blocks: one core per vLLM instance at 100 %
with no request at all (measured here: 98 % of a core per idle instance). With the variable
set, an agent config whose ``pthrDelay`` is 0 gets that many microseconds instead. The thread
then blocks in ``poll()`` on the UCX worker's event descriptor (armed before each wait) and
wakes at once when UCX has work; the delay only bounds a wait in which no event arrives.

``PDX_VLLM_SHM_BUSY_LOOP_S`` — vLLM's shared-memory message queue between its engine core
and its workers (``shm_broadcast.SpinCondition``) keeps a reader spinning on
``sched_yield()`` for ``busy_loop_s = 1`` second after every read before it sleeps on its
ZeroMQ notification socket. A request every second keeps the engine core and the worker of
each instance spinning for good: on a machine with fewer cores than spinning threads they
take the time the forward passes need. With the variable set, that window is its value.

``PDX_VLLM_SHM_RECHECK_MS`` — a reader asleep on that notification socket also wakes every
``SHM_READER_RECHECK_INTERVAL_MS`` (5,000 ms) to look at the buffer. A notification is
sometimes not seen (measured here: a reader sleeping through a write for the whole 5 s, every
request behind it waiting; with a 0 busy window it happens on most requests, so 0 is not a
setting to use). With the variable set, the reader looks at least that often, so a missed
notification costs at most that long.

``PDX_VLLM_KV_FAILURES`` — a path. vLLM's scheduler handles every KV load that failed (a
transfer, a handshake, blocks that came back invalid, an expired read) in two methods,
``_handle_failed_recving`` and ``_handle_invalid_blocks``; with
``kv_load_failure_policy: recompute`` it then recomputes the prompt and nothing outside vLLM
can tell (the request succeeds). With the variable set, both methods also append one JSON line
per affected request to that file (``{"request_id": ..., "t": ...}``), after a first line
saying the hook is in place, so that "no line" can mean "no failed load".

``PDX_VLLM_KV_CPUS`` — the instance's own cores (``0`` or ``2,3``). On a CPU build vLLM's NIXL
worker (``nixl.base_worker``, 0.32) calls ``os.sched_setaffinity(0, ...)`` with the last core of
each NUMA node, "reserved for KV transfer", from the worker's main thread, which then runs the
forward passes there: every instance on the machine lands on the same last core, whatever
``VLLM_CPU_OMP_THREADS_BIND`` gave it (measured here: prefill bound to core 0 and decode to
core 1 both ran on core 1, and a decode worker spinning on its message queue left a restarted
prefill on that core so little CPU that it missed its 180 s start three times in a row). With
the variable set, that call keeps the worker on the instance's own cores instead.

``PDX_VLLM_AMX`` — ``1``: when vLLM's CPU attention backend is imported (``cpu_attn``), the
process asks the kernel for the AMX tile state first (``torch.cpu._init_amx()``, the
``arch_prctl(ARCH_REQ_XCOMP_PERM)`` Linux requires before a process may use AMX). vLLM picks
its ``amx`` attention kernels for bf16 whenever the CPU lists AMX, but does not ask for the
permission itself; its compiled mode happens to ask on the way (oneDNN), ``--enforce-eager``
does not, and the first KV-loaded decode step then died of SIGILL ("Illegal instruction" in
``cpu_attention_with_kv_cache``; seen on a Xeon with AMX, vLLM 0.32, CPU build).

``PDX_VLLM_COMPILE_KEY_IGNORE`` — comma-separated variable names. vLLM keys its torch.compile
cache (``torch_compile_cache`` under its cache root) on every ``VLLM_*`` variable it knows but
a list of those that cannot change the compiled graph (``envs.compile_factors``). The NIXL
side channel's host is on that list, its port is not: pdx gives each deployment a free port,
so every new deployment compiled the model from nothing (45 s per instance on two busy cores)
instead of reusing the compiled graph of the last one. With the variable set, the names it
lists are left out of the key too.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import re
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

NIXL_ENV = "PDX_NIXL_PROGRESS_DELAY_US"
SHM_ENV = "PDX_VLLM_SHM_BUSY_LOOP_S"
RECHECK_ENV = "PDX_VLLM_SHM_RECHECK_MS"
KV_FAILURES_ENV = "PDX_VLLM_KV_FAILURES"
COMPILE_KEY_ENV = "PDX_VLLM_COMPILE_KEY_IGNORE"
KV_CPUS_ENV = "PDX_VLLM_KV_CPUS"
AMX_ENV = "PDX_VLLM_AMX"


def _env_number(name: str) -> float | None:
    """The variable as a non-negative number; None when unset or not a number."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if value >= 0 else None


class _AgentFactory:
    """Stands in for the bindings module inside ``_api``: only ``nixlAgent`` is changed."""

    def __init__(self, bindings: ModuleType, delay_us: int) -> None:
        self._bindings = bindings
        self._delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # the bindings' own name
        if getattr(config, "pthrDelay", None) == 0:
            config.pthrDelay = self._delay_us
        return self._bindings.nixlAgent(name, config)


def patch_nixl(module: ModuleType, delay_us: int) -> bool:
    """Wrap ``module.nixlBind`` (NIXL's bindings as ``_api`` names them); True if patched."""
    bindings = getattr(module, "nixlBind", None)
    if bindings is None or isinstance(bindings, _AgentFactory) or delay_us <= 0:
        return False
    module.nixlBind = _AgentFactory(bindings, delay_us)  # type: ignore[attr-defined]
    return True


def patch_shm(module: ModuleType, busy_loop_s: float) -> bool:
    """Make ``SpinCondition`` readers spin ``busy_loop_s`` (not 1 s) after a read."""
    cls = getattr(module, "SpinCondition", None)
    init = getattr(cls, "__init__", None)
    if cls is None or init is None or getattr(init, "_pdx_patched", False):
        return False

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if getattr(self, "is_reader", False):
            self.busy_loop_s = busy_loop_s

    __init__._pdx_patched = True  # type: ignore[attr-defined]
    cls.__init__ = __init__
    return True


def _nixl(module: ModuleType) -> None:
    delay = _env_number(NIXL_ENV)
    if delay:
        patch_nixl(module, int(delay))


def patch_recheck(module: ModuleType, recheck_ms: int) -> bool:
    """Shorten the shared-memory readers' periodic recheck (vLLM's: 5,000 ms)."""
    if not hasattr(module, "SHM_READER_RECHECK_INTERVAL_MS") or recheck_ms <= 0:
        return False
    module.SHM_READER_RECHECK_INTERVAL_MS = recheck_ms  # type: ignore[attr-defined]
    return True


def _shm(module: ModuleType) -> None:
    busy = _env_number(SHM_ENV)
    if busy is not None:
        patch_shm(module, busy)
    recheck = _env_number(RECHECK_ENV)
    if recheck:
        patch_recheck(module, max(1, int(recheck)))


def _append(path: str, record: dict[str, Any]) -> None:
    record = {**record, "t": time.time(), "pid": os.getpid()}
    # One short line per write in append mode: lines from several processes stay whole.
    # A record that cannot be written must not take the engine down with it.
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    except OSError:
        pass


def patch_kv_failures(module: ModuleType, path: str) -> bool:
    """Record each request whose KV load failed, as vLLM's scheduler handles it."""
    cls = getattr(module, "Scheduler", None)
    names = ("_handle_failed_recving", "_handle_invalid_blocks")
    if cls is None or not all(callable(getattr(cls, n, None)) for n in names):
        return False
    if getattr(getattr(cls, names[0]), "_pdx_patched", False):
        return False

    def wrap(name: str) -> Callable[..., Any]:
        inner = getattr(cls, name)

        def handler(self: Any, *args: Any, **kwargs: Any) -> Any:
            # recompute: the method returns what it fails (nothing) and queues the rest in
            # failed_recving_kv_req_ids; fail: it returns every affected request.
            before = set(getattr(self, "failed_recving_kv_req_ids", ()) or ())
            out = inner(self, *args, **kwargs)
            after = set(getattr(self, "failed_recving_kv_req_ids", ()) or ())
            policy = "recompute" if getattr(self, "recompute_kv_load_failures", False) else "fail"
            for rid in sorted(set(out or ()) | (after - before)):
                _append(path, {"request_id": str(rid), "policy": policy, "via": name})
            return out

        handler._pdx_patched = True  # type: ignore[attr-defined]
        return handler

    for name in names:
        setattr(cls, name, wrap(name))
    _append(path, {"hook": "kv_load_failures"})
    return True


def _kv_failures(module: ModuleType) -> None:
    path = os.environ.get(KV_FAILURES_ENV)
    if path:
        patch_kv_failures(module, path)


def patch_compile_key(module: ModuleType, ignored: set[str]) -> bool:
    """Leave the variables in ``ignored`` out of vLLM's compile cache key."""
    factors = getattr(module, "compile_factors", None)
    if not ignored or not callable(factors) or getattr(factors, "_pdx_patched", False):
        return False

    def compile_factors() -> dict[str, object]:
        return {k: v for k, v in factors().items() if k not in ignored}

    compile_factors._pdx_patched = True  # type: ignore[attr-defined]
    module.compile_factors = compile_factors  # type: ignore[attr-defined]
    return True


def _compile_key(module: ModuleType) -> None:
    names = {n.strip() for n in os.environ.get(COMPILE_KEY_ENV, "").split(",") if n.strip()}
    patch_compile_key(module, names)


class _PinnedOs:
    """Stands in for ``os`` inside NIXL's worker module: only ``sched_setaffinity`` changes."""

    def __init__(self, cpus: set[int]) -> None:
        self._cpus = cpus

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def sched_setaffinity(self, pid: int, cpus: Any) -> None:  # os's own name
        os.sched_setaffinity(pid, self._cpus)


def patch_kv_cpus(module: ModuleType, cpus: set[int]) -> bool:
    """Keep the affinity NIXL's worker sets for itself within ``cpus``; True if patched."""
    if not cpus or getattr(module, "os", None) is not os:
        return False
    module.os = _PinnedOs(cpus)  # type: ignore[attr-defined]
    return True


def _kv_cpus(module: ModuleType) -> None:
    raw = os.environ.get(KV_CPUS_ENV, "")
    try:
        cpus = {int(c) for c in raw.split(",") if c.strip()}
    except ValueError:
        return
    patch_kv_cpus(module, cpus)


def _amx(module: ModuleType) -> None:
    if os.environ.get(AMX_ENV) != "1":
        return
    torch = sys.modules.get("torch")
    init = getattr(getattr(torch, "cpu", None), "_init_amx", None)
    if callable(init):
        init()  # False where the CPU or kernel has no AMX: nothing to do then


# module name pattern → its hook, and the variables that turn it on
HOOKS: list[tuple[re.Pattern[str], Callable[[ModuleType], None], tuple[str, ...]]] = [
    (re.compile(r"^nixl(_cu\d+|_rocm)?\._api$"), _nixl, (NIXL_ENV,)),
    (re.compile(r"^vllm\.distributed\.device_communicators\.shm_broadcast$"), _shm,
     (SHM_ENV, RECHECK_ENV)),
    (re.compile(r"^vllm\.v1\.core\.sched\.scheduler$"), _kv_failures, (KV_FAILURES_ENV,)),
    (re.compile(r"^vllm\.envs$"), _compile_key, (COMPILE_KEY_ENV,)),
    (re.compile(r"^vllm\.distributed\.kv_transfer\.kv_connector\.v1\.nixl\.base_worker$"),
     _kv_cpus, (KV_CPUS_ENV,)),
    (re.compile(r"^vllm\.v1\.attention\.backends\.cpu_attn$"), _amx, (AMX_ENV,)),
]  # fmt: skip


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, hook: Callable[[ModuleType], None]) -> None:
        self._inner, self._hook = inner, hook

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        self._hook(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        hook = next((h for pattern, h, _ in HOOKS if pattern.match(fullname)), None)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, hook)
                return spec
        return None


def install() -> None:
    """Register the import hook once, when any of the variables is set."""
    wanted = any(os.environ.get(env) for _, _, envs in HOOKS for env in envs)
    if wanted and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
