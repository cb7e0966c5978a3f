"""The KV chunk sweep over the real gRPC KV path (``probe-link --chunk-transport grpc``).

Each timed chunk is one whole KV object of exactly one chunk, moved by
:class:`~pdx.transfer.client.KVClient` against a running KV store (``pdx kv-serve`` or
a deployed prefill's store). ``get`` (the default, what decode does across the link)
stores one object per size untimed, then times ``Get`` calls of it: from the call to the
moment its chunk digest and object digest (XXH3-64) are verified. ``put`` times ``Put``
calls: from the call to the store's reply, sent only after the store verified both
digests and made the object readable. A chunk is timed as a whole request so that its
time runs from "asked for" to "verified and usable", the same span as the TCP transport's
send-to-acknowledgement; timestamps of chunks inside one long stream would give only
the gaps between arrivals. Every object is released before the sweep moves on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections import deque
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from pdx.errors import InputError, MeasurementError
from pdx.link.chunks import (
    ChunkAck,
    ChunkTransport,
    ChunkTransportFactory,
    chunk_transport_registered,
)
from pdx.link.client import ProbeSession, parse_target
from pdx.units import KIB, MIB

T = TypeVar("T")
KVOp = Literal["get", "put"]
KV_OPS: tuple[KVOp, ...] = ("get", "put")
# The contract's chunk bounds (64 KiB - 8 MiB, whole KiB); a swept size becomes one chunk.
MIN_CHUNK_BYTES = 64 * KIB
MAX_CHUNK_BYTES = 8 * MIB
MODEL_VERSION = "pdx-probe-link"
# Deadline of one timed call. Far above the contract's 300 ms default on purpose: the
# sweep reports how long a chunk takes on this link instead of failing on a slow one.
CALL_TIMEOUT_MS = 30_000
# Objects live TTL_S (the contract's maximum); a Get sweep longer than REFRESH_AFTER_S
# stores a fresh copy in the background and reads that one instead.
TTL_S = 300
REFRESH_AFTER_S = 200.0


@dataclass(frozen=True)
class KVSweepSettings:
    """Where and how the sweep reaches the KV store."""

    target: str
    op: KVOp = "get"
    tls_dir: Path | None = None
    tls_name: str = "decode"
    connect_timeout_s: float = 5.0

    def tls(self) -> Any:
        """The client's ``TLSConfig`` (mutual TLS), or None for plaintext."""
        from pdx.tls import TLSConfig

        if self.tls_dir is None:
            return None
        return TLSConfig(cert_dir=self.tls_dir, name=self.tls_name)


def kv_sweep_settings(
    target: str,
    op: str,
    tls_dir: Path | None,
    tls_name: str,
    chunk_sizes: list[int],
    connect_timeout_s: float = 5.0,
) -> KVSweepSettings:
    """Validated settings, or an :class:`InputError` naming the bad option."""
    try:
        parse_target(target)
    except InputError as exc:
        raise InputError("--kv-target", target, exc.expected) from None
    kv_op = next((o for o in KV_OPS if o == op), None)
    if kv_op is None:
        raise InputError("--kv-op", op, f"one of {', '.join(KV_OPS)}")
    bad = [s for s in chunk_sizes if not MIN_CHUNK_BYTES <= _chunk_kib(s) * KIB <= MAX_CHUNK_BYTES]
    if bad:
        raise InputError("--chunk-sizes", bad[0], "64 KiB to 8 MiB per chunk over the KV path")
    if tls_dir is not None:
        from pdx.tls import cert_files

        try:
            cert_files(tls_dir, tls_name)
        except InputError as exc:
            raise InputError("--tls-dir", str(exc.value), exc.expected) from None
    return KVSweepSettings(target, kv_op, tls_dir, tls_name, connect_timeout_s)


def _chunk_kib(size_bytes: int) -> int:
    return -(-size_bytes // KIB)


class _LoopThread:
    """An asyncio loop on its own thread: the sweep is synchronous, KVClient is asyncio."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kv-sweep", daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        return self.submit(coro).result(timeout_s)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()


def _kv_failure(exc: BaseException, what: str) -> MeasurementError:
    from pdx.transfer.contract import KVError

    reason = f"{exc.code.value}: {exc.message}" if isinstance(exc, KVError) else str(exc)
    return MeasurementError(f"KV {what} failed ({reason})")


class KVChunkTransport(ChunkTransport):
    """Chunks as one-chunk KV objects through ``KVClient``; the ack is the verified reply."""

    name = "grpc"

    def __init__(self, settings: KVSweepSettings) -> None:
        self.settings = settings
        self.runner: _LoopThread | None = None
        self.client: Any = None
        self.pending: deque[concurrent.futures.Future[ChunkAck]] = deque()
        self.kv_ids: list[str] = []
        self.releases: list[asyncio.Future[None]] = []
        self.stored_id: str | None = None
        self.stored_at_s = 0.0
        self.refreshes: list[concurrent.futures.Future[None]] = []
        self.released = 0
        self.release_errors: list[str] = []
        self.retries = 0

    def open(self, *, duration_s: float, max_bytes: int) -> None:
        self.runner = _LoopThread()

    async def _connect(self, size_bytes: int) -> Any:
        from pdx.transfer.client import KVClient
        from pdx.transfer.contract import KVClientConfig

        # The chunk size is per client, so each swept size gets its own client (and
        # connection); the sweep's unmeasured warm-up chunks absorb the set-up.
        cfg = KVClientConfig(
            kv_transfer_timeout_ms=CALL_TIMEOUT_MS,
            chunk_size_kb=_chunk_kib(size_bytes),
            client_id="pdx-probe-link",
            # `--chunk-transport grpc` means the store's gRPC Put/Get, not its data plane.
            transport="grpc",
        )
        return KVClient(self.settings.target, cfg, tls=self.settings.tls())

    def send_chunk(self, payload: memoryview) -> None:
        assert self.runner is not None
        if self.client is None:
            self.client = self.runner.run(self._connect(len(payload)), CALL_TIMEOUT_MS / 1000)
        if self.settings.op == "put":
            self.pending.append(self.runner.submit(self._put_one(payload)))
            return
        if self.stored_id is None:  # untimed set-up: the object every Get reads
            try:
                self.stored_id = self.runner.run(self._store(payload), CALL_TIMEOUT_MS / 1000)
            except Exception as exc:  # any failure ends the measurement
                raise _kv_failure(exc, f"put of a {len(payload)}-byte object") from None
            self.stored_at_s = time.monotonic()
        elif time.monotonic() - self.stored_at_s > REFRESH_AFTER_S:
            self.stored_at_s = time.monotonic()
            self.refreshes.append(self.runner.submit(self._refresh(payload)))
        self.pending.append(self.runner.submit(self._get_one(self.stored_id, len(payload))))

    async def _store(self, payload: memoryview) -> str:
        kv_id: str = await self.client.put(payload, model_version=MODEL_VERSION, ttl_s=TTL_S)
        self.kv_ids.append(kv_id)
        return kv_id

    async def _refresh(self, payload: memoryview) -> None:
        """Swap in a fresh object before the one being read reaches its TTL."""
        self.stored_id = await self._store(payload)

    async def _put_one(self, payload: memoryview) -> ChunkAck:
        kv_id = await self._store(payload)
        at_s = time.perf_counter()
        # Released right away, off the timed path, so the store never fills up.
        self.releases.append(asyncio.ensure_future(self._release(kv_id)))
        return ChunkAck(len(payload), at_s)

    async def _get_one(self, kv_id: str, size_bytes: int) -> ChunkAck:
        obj = await self.client.get(kv_id)  # raises KV_CORRUPT unless both digests match
        at_s = time.perf_counter()
        if len(obj) != size_bytes:
            raise MeasurementError(f"KV get returned {len(obj)} bytes, expected {size_bytes}")
        return ChunkAck(size_bytes, at_s)

    async def _release(self, kv_id: str) -> None:
        try:
            await self.client.release(kv_id)
            self.released += 1
        except Exception as exc:  # reported in details(), never hidden
            self.release_errors.append(f"{kv_id}: {exc}")

    def next_ack(self, timeout_s: float) -> ChunkAck:
        future = self.pending.popleft()
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise MeasurementError(
                f"no KV {self.settings.op} reply within {timeout_s:.1f} s"
            ) from None
        except Exception as exc:  # KVError, MeasurementError, gRPC errors
            raise _kv_failure(exc, self.settings.op) from None

    def close(self) -> None:
        if self.runner is None:
            return
        in_flight: list[concurrent.futures.Future[Any]] = [*self.pending, *self.refreshes]
        for future in in_flight:  # let calls in flight finish so their objects are released
            with contextlib.suppress(Exception):
                future.result(CALL_TIMEOUT_MS / 1000)
        self.pending.clear()
        with contextlib.suppress(Exception):
            self.runner.run(self._finish(), CALL_TIMEOUT_MS / 1000)
        self.runner.stop()
        self.runner = None

    async def _finish(self) -> None:
        await asyncio.gather(*self.releases)
        if self.client is None:
            return
        if self.settings.op == "get":  # the objects Gets read (more than one after a refresh)
            for kv_id in self.kv_ids:
                await self._release(kv_id)
        self.retries = sum(r.retries for r in self.client.records())
        await self.client.close()

    def details(self) -> dict[str, Any]:
        """KV target, operation, TLS, checksums, and how many objects were stored/released."""
        return {
            "kv_target": self.settings.target,
            "kv_op": self.settings.op,
            "tls": self.settings.tls_dir is not None,
            "checksums": "xxh3_64 per chunk and per object, verified on every transfer",
            "objects_stored": len(self.kv_ids),
            "objects_released": self.released,
            "release_errors": self.release_errors,
            "retries": self.retries,
        }


def check_kv_store(settings: KVSweepSettings) -> None:
    """Fail fast with one line if the KV store cannot be reached (or refuses our TLS)."""
    runner = _LoopThread()
    try:
        runner.run(_stat_unknown(settings), settings.connect_timeout_s + 5)
    except concurrent.futures.TimeoutError:
        raise MeasurementError(f"--kv-target {settings.target}: no answer") from None
    finally:
        runner.stop()


async def _stat_unknown(settings: KVSweepSettings) -> None:
    from pdx.transfer.client import KVClient
    from pdx.transfer.contract import KVClientConfig, KVError, KVErrorCode, new_kv_id

    timeout_ms = max(1, int(settings.connect_timeout_s * 1000))
    cfg = KVClientConfig(kv_transfer_timeout_ms=timeout_ms, kv_retry_budget=0)
    async with KVClient(settings.target, cfg, tls=settings.tls()) as kv:
        try:
            # An id nobody stored: NOT_FOUND proves the store answered (and accepted our TLS).
            await kv.stat(new_kv_id(MODEL_VERSION, 0))
        except KVError as exc:
            if exc.code is not KVErrorCode.KV_NOT_FOUND:
                tls = "mTLS" if settings.tls_dir is not None else "plaintext"
                raise MeasurementError(
                    f"--kv-target {settings.target}: KV store unreachable over {tls} "
                    f"({exc.code.value}: {exc.message})"
                ) from None


def kv_transport_factory(settings: KVSweepSettings) -> ChunkTransportFactory:
    """A ``ChunkTransportFactory`` for :func:`pdx.link.chunks.register_chunk_transport`."""

    def factory(session: ProbeSession) -> ChunkTransport:
        return KVChunkTransport(settings)

    return factory


@contextlib.contextmanager
def kv_chunk_transport(settings: KVSweepSettings) -> Iterator[None]:
    """Check the store answers, then make ``--chunk-transport grpc`` use it in the block."""
    check_kv_store(settings)
    with chunk_transport_registered(KVChunkTransport.name, kv_transport_factory(settings)):
        yield
