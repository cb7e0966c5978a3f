"""A KV client's requests: deadline, one attempt, retries under the budgets, the record.

Every request has a deadline (``kv_transfer_timeout_ms``, or derived from its size and the
path, for all attempts together); retryable errors are retried with jittered exponential
backoff under the per-request and global budgets. A Get that ran out of a derived deadline is
retried too, under a new one (:meth:`Attempts.regrant`, docs in :mod:`pdx.transfer.path`).
``AioRpcError`` becomes :class:`KVError` here, through :func:`pdx.transfer.rpc.map_rpc_error`.
Each request ends in a :class:`TransferRecord`, the metrics and the audit log.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import grpc

from pdx.tcp import bdp_bytes, buffer_limits, window_for
from pdx.transfer.audit import AuditLog
from pdx.transfer.contract import KVClientConfig, KVError, KVErrorCode
from pdx.transfer.metrics import KVMetrics, TransferRecord
from pdx.transfer.path import Deadline, PathEstimate, regranted_ms
from pdx.transfer.retry import GlobalRetryBudget, backoff_s
from pdx.transfer.rpc import map_rpc_error

T = TypeVar("T")
log = logging.getLogger("pdx.transfer.client")


@dataclass
class Request:
    """Retry and deadline state of one logical request."""

    op: str
    deadline_s: float
    kv_id: str = ""
    transport: str = "grpc"
    retries: int = 0
    resumed_chunks: int = 0
    start_s: float = field(default_factory=time.perf_counter)
    deadline: Deadline | None = None
    began_s: float = 0.0
    size: int | None = 0  # bytes it moves, None = unknown (a Get without a size hint)
    congestion_control: str | None = None  # of the data-plane sockets that carried it
    limited_by: str | None = None  # a Put stream capped by its send buffer / the peer's window
    moved_seen: int = 0  # bytes a timed-out Get had moved at its last timeout
    progressed: bool = False  # its last timed-out attempt moved bytes (a slow link, not a dead one)
    epoch: int = 0  # deadlines granted after the first (:meth:`Attempts.regrant`)

    def remaining_s(self) -> float:
        return self.deadline_s - time.monotonic()


class Attempts:
    """Begins, attempts, retries and finishes the requests of one client to one store."""

    def __init__(
        self,
        target: str,
        cfg: KVClientConfig,
        *,
        path: PathEstimate,
        metrics: KVMetrics,
        audit: AuditLog,
        retry_budget: GlobalRetryBudget,
        system_cc: str | None,
    ) -> None:
        self.target, self.cfg, self.path = target, cfg, path
        self.metrics, self.audit, self.retry_budget = metrics, audit, retry_budget
        self.system_cc = system_cc
        self._warned_cap = False

    def begin(self, op: str, kv_id: str = "", size_bytes: int | None = 0) -> Request:
        """A new request and its deadline (counted by the global retry budget)."""
        self.retry_budget.on_request()
        d = self.path.deadline(size_bytes, self.cfg.kv_transfer_timeout_ms)
        now = time.monotonic()
        return Request(op, now + d.ms / 1000, kv_id, deadline=d, began_s=now, size=size_bytes)

    def _extend(self, req: Request) -> None:
        """A derived deadline follows what the request itself taught the path estimate (the
        first RTT a cold client measures): it may grow, never shrink."""
        d = req.deadline
        if d is None or d.source != "derived":
            return
        now = self.path.deadline(req.size, None)
        if now.ms > d.ms:
            req.deadline = now
            req.deadline_s = max(req.deadline_s, req.began_s + now.ms / 1000)

    async def attempt(
        self, req: Request, fn: Callable[[float], Awaitable[T]], *, self_timed: bool = False
    ) -> T:
        """Run ``fn(timeout_s)`` once, mapping gRPC failures and the deadline to KVError.

        ``self_timed``: ``fn`` keeps a deadline that moves (a streamed Get follows its writer)
        and raises TimeoutError itself, so it is not cut at the deadline it started with.
        """
        self._extend(req)
        remaining = req.remaining_s()
        if remaining <= 0:
            raise KVError(KVErrorCode.KV_TIMEOUT, f"{req.op}: deadline passed", kv_id=req.kv_id)
        try:
            if self_timed:
                return await fn(remaining)
            return await asyncio.wait_for(fn(remaining), timeout=remaining + 0.05)
        except grpc.aio.AioRpcError as exc:
            raise map_rpc_error(exc, req.kv_id) from None
        except TimeoutError:
            raise KVError(
                KVErrorCode.KV_TIMEOUT, f"{req.op}: deadline passed", kv_id=req.kv_id
            ) from None

    def _regrantable(self, req: Request, exc: KVError) -> bool:
        """A Get that ran out of its derived deadline while bytes still moved (retried under a
        new one); one that moved nothing met a dead link, and ends as before."""
        d = req.deadline
        return (
            exc.code is KVErrorCode.KV_TIMEOUT
            and req.op == "get"
            and req.progressed
            and d is not None
            and d.source == "derived"
        )

    def timed_out(self, req: Request, moved_bytes: int) -> None:
        """``req`` ran out of its deadline having moved ``moved_bytes``: teach the path."""
        req.progressed = moved_bytes > req.moved_seen
        req.moved_seen = max(req.moved_seen, moved_bytes)
        self.path.observe_timeout(moved_bytes, time.monotonic() - req.began_s)

    def regrant(self, req: Request) -> None:
        """A new deadline for a timed-out Get's next attempt: derived from the estimate (which
        its timeout just lowered), doubled per timeout already spent (capped), from now."""
        d = self.path.deadline(req.size, None)
        ms = round(regranted_ms(d.ms, req.retries), 1)
        req.deadline = replace(d, ms=ms)
        req.deadline_s = time.monotonic() + ms / 1000
        req.epoch += 1

    async def before_retry(self, req: Request, exc: KVError) -> None:
        """Decide whether ``exc`` may be retried; wait the backoff, or raise."""
        exc.retries = req.retries
        regrant = self._regrantable(req, exc) and req.remaining_s() <= 0
        if (
            not exc.retryable
            or (req.remaining_s() <= 0 and not regrant)
            or self.cfg.kv_retry_budget == 0
        ):
            raise exc
        if req.retries >= self.cfg.kv_retry_budget:
            raise KVError(
                KVErrorCode.RETRY_BUDGET_EXHAUSTED,
                f"{req.op}: {req.retries} retries used (kv_retry_budget); "
                f"last error {exc.code.value}: {exc.message}",
                kv_id=req.kv_id,
                retries=req.retries,
            ) from exc
        if not self.retry_budget.try_retry():
            raise KVError(
                KVErrorCode.RETRY_BUDGET_EXHAUSTED,
                f"{req.op}: global retry budget spent; last error {exc.code.value}: {exc.message}",
                kv_id=req.kv_id,
                retries=req.retries,
            ) from exc
        req.retries += 1
        if regrant:
            self.regrant(req)
        self.metrics.retries.labels(op=req.op).inc()
        self.audit.record(
            "retry",
            who=self.cfg.client_id,
            peer=self.target,
            side="client",
            op=req.op,
            kv_id=req.kv_id or exc.kv_id or None,
            outcome=exc.code.value,
            reason=exc.message,
            resume_chunk=exc.resume_chunk,
            retries=req.retries,
        )
        delay = backoff_s(req.retries, self.cfg.backoff_base_ms, self.cfg.backoff_max_ms)
        await asyncio.sleep(min(delay, max(req.remaining_s(), 0)))

    def finish(
        self, req: Request, nbytes: int, chunks: int, outcome: str, **extra: Any
    ) -> TransferRecord:
        """End ``req``: its record, metrics, path observation and audit entry."""
        ms = (time.perf_counter() - req.start_s) * 1000
        d = req.deadline
        moves = req.op in ("put", "get")
        rec = TransferRecord(
            req.kv_id,
            req.op,
            nbytes,
            round(ms, 3),
            req.retries,
            outcome,
            chunks,
            req.resumed_chunks,
            transport=req.transport if moves else None,
            congestion_control=req.congestion_control
            or (self.system_cc if moves and req.transport == "grpc" else None),
            streams=self.cfg.streams if moves else None,
            connections=self.cfg.connections if moves else None,
            rtt_ms=round(self.path.rtt_ms, 3) if self.path.rtt_ms is not None else None,
            deadline_ms=d.ms if d is not None else None,
            deadline_source=d.source if d is not None else None,
            limited_by=req.limited_by,
            **extra,
        )
        self.metrics.add_record(rec)
        self.metrics.duration.labels(op=req.op, side="client").observe(ms / 1000)
        if outcome != "ok":
            self.metrics.errors.labels(code=outcome, side="client").inc()
        else:
            self.path.observe_success(nbytes, ms / 1000)
            self.metrics.bytes.labels(op=req.op, side="client").inc(nbytes)
            self.metrics.chunks.labels(op=req.op, side="client").inc(chunks)
        if moves:
            self.metrics.transfers.labels(
                op=req.op, outcome=outcome, transport=req.transport,
                congestion_control=rec.congestion_control or "unknown",
            ).inc()  # fmt: skip
        rtt = self.path.rtt_ms
        if req.limited_by and not self._warned_cap and rtt is not None and rtt >= 1.0:
            self._warn_cap(req, rtt)  # (on a LAN a window limit is about the peer's CPU)
        self.audit.record(
            req.op,
            who=self.cfg.client_id,
            peer=self.target,
            side="client",
            **{k: v for k, v in rec.as_dict().items() if k != "op" and v is not None},
        )
        return rec

    def _warn_cap(self, req: Request, rtt_ms: float) -> None:
        """Say once which sysctl caps this client's streams, and what would not."""
        self._warned_cap = True
        if req.limited_by == "send buffer":
            where = f"net.ipv4.tcp_wmem max {buffer_limits().tcp_wmem_max} B here"
        else:
            where = "net.ipv4.tcp_rmem max on the store"
        log.warning(
            "KV %s to %s: one stream is limited by its %s (%s) at RTT %.1f ms; a max of "
            "%d B per Gbit/s of link would not cap it: raise it, set kv.link_gbps, or use "
            "more kv.streams",
            req.op, self.target, req.limited_by, where, rtt_ms,
            window_for(bdp_bytes(1e9, rtt_ms)),
        )  # fmt: skip


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """``n`` chunks into at most ``parts`` contiguous, non-empty ranges (one empty if n=0)."""
    parts = max(1, min(parts, n))
    step = -(-n // parts) if n else 0
    return [(a, min(a + step, n)) for a in range(0, n, step)] if n else [(0, 0)]
