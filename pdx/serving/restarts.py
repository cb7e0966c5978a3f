"""Restart back-off, and what the supervisor knows of each child for the gateway to report.

The supervisor never gives up on a child: each crash schedules a restart after
:func:`backoff_s`, which stays at ``backoff_initial_s`` for the first ``max_restarts`` crashes
of a run, then doubles up to ``backoff_max_s``; a child that stays up ``restart_window_s``
starts a fresh run. :class:`RestartBoard` holds each child's state. The supervisor writes
it and the gateway, in the same process and event loop, reads it: ``/readyz``, the
``pdx_restarts_total`` / ``pdx_role_up`` / ``pdx_role_backoff_seconds`` series of
``/metrics``, and the ``Retry-After`` of the 503 it answers while no decode instance is up.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdx.serving.deploy_config import SupervisorConfig

__all__ = ["ChildRecord", "RestartBoard", "backoff_s"]

ChildState = Literal["starting", "up", "backoff"]


def backoff_s(cfg: SupervisorConfig, streak: int) -> float:
    """The wait before restarting a child after crash ``streak`` of a run (1 = the first)."""
    doublings = min(64, streak - cfg.max_restarts)  # bounded: 2.0 ** 1100 overflows
    if doublings <= 0:
        return cfg.backoff_initial_s
    return min(cfg.backoff_max_s, cfg.backoff_initial_s * 2.0**doublings)


@dataclass
class ChildRecord:
    """One supervised child as the supervisor last saw it (times are ``time.monotonic``)."""

    role: str
    index: int
    state: ChildState = "starting"
    restarts: int = 0  # replacement processes started
    streak: int = 0  # crashes in the current run (reset after restart_window_s up)
    up_since: float | None = None
    next_attempt_at: float | None = None  # while state == "backoff"
    last_exit_code: int | None = None

    @property
    def name(self) -> str:
        """``prefill-0``, ``decode-1``, ..."""
        return f"{self.role}-{self.index}"


class RestartBoard:
    """Every child's state, written by the supervisor, read by the gateway."""

    def __init__(self, cfg: SupervisorConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock
        self.children: dict[str, ChildRecord] = {}
        self._restarts: Counter | None = None

    def add(self, role: str, index: int) -> ChildRecord:
        """Track a child (before its first start)."""
        rec = self.children[f"{role}-{index}"] = ChildRecord(role, index)
        return rec

    # --- written by the supervisor -------------------------------------------------

    def starting(self, name: str) -> None:
        """A process for ``name`` is being started (a restart when it crashed before)."""
        rec = self.children[name]
        if rec.state == "backoff":
            rec.restarts += 1
            if self._restarts is not None:
                self._restarts.labels(rec.role, str(rec.index)).inc()
        rec.state, rec.next_attempt_at = "starting", None

    def up(self, name: str) -> None:
        """``name`` announced itself ready."""
        rec = self.children[name]
        rec.state, rec.up_since = "up", self.clock()

    def crashed(self, name: str, exit_code: int | None) -> float:
        """``name``'s process ended: schedule its restart; return the wait in seconds."""
        rec, now = self.children[name], self.clock()
        if rec.up_since is not None and now - rec.up_since >= self.cfg.restart_window_s:
            rec.streak = 0  # it stayed up long enough: the back-off starts over
        rec.streak += 1
        delay = backoff_s(self.cfg, rec.streak)
        rec.state, rec.up_since, rec.last_exit_code = "backoff", None, exit_code
        rec.next_attempt_at = now + delay
        return delay

    # --- read by the gateway -------------------------------------------------------

    def is_down(self, name: str) -> bool:
        """Whether the supervisor knows ``name``'s process is not up (unknown names: no)."""
        rec = self.children.get(name)
        return rec is not None and rec.state != "up"

    def roles_down(self) -> list[str]:
        """Roles with no child up."""
        roles = dict.fromkeys(r.role for r in self.children.values())
        return [role for role in roles if all(self.is_down(n) for n in self._names(role))]

    def next_attempt_in_s(self, role: str) -> float | None:
        """Seconds until the soonest restart of a ``role`` child in back-off; None if none is."""
        waits = [self._wait_s(self.children[n]) for n in self._names(role)]
        known = [w for w in waits if w is not None]
        return min(known) if known else None

    def describe(self) -> list[dict[str, Any]]:
        """Every child for ``/readyz``: state, restarts, the next attempt while backing off."""
        return [
            {"name": rec.name, "role": rec.role, "index": rec.index, "state": rec.state,
             "restarts": rec.restarts, "next_attempt_in_s": _round(self._wait_s(rec)),
             "last_exit_code": rec.last_exit_code}
            for rec in self.children.values()
        ]  # fmt: skip

    def export(self, registry: CollectorRegistry) -> None:
        """Add the restart series to ``registry`` (the gateway's): call once, before restarts."""
        labels = ["role", "instance"]
        self._restarts = Counter("pdx_restarts", "Child processes restarted by the supervisor",
                                 labels, registry=registry)  # fmt: skip
        up = Gauge("pdx_role_up", "1 while the child's process is up (announced ready)",
                   labels, registry=registry)  # fmt: skip
        backoff = Gauge("pdx_role_backoff_seconds",
                        "Seconds until the child's next restart attempt (0 unless backing off)",
                        labels, registry=registry)  # fmt: skip
        for rec in self.children.values():
            key = (rec.role, str(rec.index))
            self._restarts.labels(*key).inc(rec.restarts)
            up.labels(*key).set_function(partial(_is_up, rec))
            backoff.labels(*key).set_function(partial(self._backoff_gauge, rec))

    def _names(self, role: str) -> list[str]:
        return [n for n, rec in self.children.items() if rec.role == role]

    def _backoff_gauge(self, rec: ChildRecord) -> float:
        return self._wait_s(rec) or 0.0

    def _wait_s(self, rec: ChildRecord) -> float | None:
        if rec.state != "backoff" or rec.next_attempt_at is None:
            return None
        return max(0.0, rec.next_attempt_at - self.clock())


def _is_up(rec: ChildRecord) -> float:
    return float(rec.state == "up")


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
