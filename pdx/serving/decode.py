"""The decode service: fetches KV by kv_id, decodes with continuous batching, streams tokens.

New sequences join the running batch at step boundaries and finished ones leave, so one
model forward per step serves every active request. Admission is bounded by
``max_batch + max_queue``: a request beyond that is refused (RESOURCE_EXHAUSTED) rather than
queued without bound. The resident KV is bounded by ``kv_budget_bytes``: each request reserves
the KV it will hold (prompt + max_tokens) before any of it exists and waits for room
(:mod:`pdx.serving.admission`); one larger than the whole budget is refused
(INVALID_ARGUMENT, naming both sizes). When the transfer fails past its retry budget (or the
gateway asks for it) the service prefills locally and says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from pdx._proto import serving_pb2, serving_pb2_grpc
from pdx.errors import PdxError, ServingError
from pdx.serving.admission import KVReservations
from pdx.serving.backends.base import KVState, ModelBackend
from pdx.serving.backends.kvwire import StreamRebuild, decode_kv
from pdx.serving.backends.sampling import Picked, Sampling, choose, sampling_problem
from pdx.serving.deploy_config import DecodeConfig, DeployConfig, NodeOptions
from pdx.serving.kv_source import ClientSource, KVSource
from pdx.serving.node import run_child, stop_serving
from pdx.serving.prefill import check_prompt
from pdx.serving.prefix_cache import (
    PrefixCache,
    Reuse,
    cache_supported,
    keep,
    prefill_with,
    reuse,
    token_join,
)
from pdx.serving.rpc import create_server, set_serving, start_health_server
from pdx.tls import tls_for
from pdx.transfer.audit import AuditLog
from pdx.transfer.contract import KVError, KVErrorCode

log = logging.getLogger("pdx.decode")
MAX_CACHE_SUBSCRIBERS = 16  # routers watching one decode's prefix cache


class KVUnusable(PdxError):
    """Fetched KV that must not be used here (e.g. produced by other weights)."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)


class DecodeFailed(ServingError):
    """A sequence could not be decoded (its batch step raised)."""


@dataclass
class Sequence:
    """One request inside the decode engine."""

    request: serving_pb2.GenerateRequest
    tokens: list[int] = field(default_factory=list)  # generated so far (first token included)
    state: KVState | None = None
    out: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    finish_reason: str = ""
    cancelled: bool = False
    error: str = ""
    stats: serving_pb2.GenerateStats = field(default_factory=serving_pb2.GenerateStats)
    release_due: bool = False  # fetched KV rebuilt here; the store may be told to delete it
    kv_released: bool = False  # a Release for the request's kv_id was sent (or is being sent)
    logprobs: list[serving_pb2.TokenLogprob | None] = field(default_factory=list)  # per token
    kv_need_bytes: int = 0  # the KV it holds at its longest (prompt + max_tokens)
    kv_reserved_bytes: int = 0  # reserved against the budget (given back when it ends)
    found: Reuse | None = None  # prefix blocks pinned in decode's cache until the KV is built

    @property
    def prompt(self) -> list[int]:
        """Prompt token ids."""
        return list(self.request.prompt_token_ids)

    @property
    def salt(self) -> str:
        """The request's prefix-cache salt ("" = none)."""
        return self.request.cache_salt


class DecodeEngine:
    """Continuous batching over one backend; a single thread runs every forward pass."""

    def __init__(self, backend: ModelBackend, cfg: DecodeConfig, instance: str) -> None:
        self.backend = backend
        self.cfg = cfg
        self.instance = instance
        self.model_pool = ThreadPoolExecutor(1, thread_name_prefix="decode-model")
        self.running: list[Sequence] = []
        self.joining: list[Sequence] = []
        self.admitted = 0  # accepted and not yet finished (waiting + running)
        self.kv = KVReservations(cfg.kv_budget_bytes)
        # Finished prompts' KV in blocks, in the budget's unreserved part (evicted first).
        self.cache: PrefixCache | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def resident_bytes(self) -> int:
        """Bytes of KV held for running and joining sequences."""
        seqs = self.running + self.joining
        return sum(s.state.nbytes for s in seqs if s.state is not None)

    def kv_need_bytes(self, prompt_tokens: int, max_tokens: int) -> int:
        """The KV bytes a request holds at its longest (0 where the backend cannot say)."""
        try:
            return self.backend.kv_bytes_bound(prompt_tokens + max_tokens)[0]
        except NotImplementedError:
            return 0

    @property
    def kv_bytes_per_token(self) -> float:
        """Bytes of KV per token over the model's whole context (exact for full attention)."""
        ctx = max(1, self.backend.max_context_tokens)
        return self.kv_need_bytes(ctx, 0) / ctx

    @property
    def capacity(self) -> int:
        """Most sequences admitted at once (batch + queue)."""
        return self.cfg.max_batch + self.cfg.max_queue

    def enable_cache(self, block_tokens: int) -> None:
        """Keep a prefix cache in what requests have not reserved of the KV budget."""
        if cache_supported(self.backend):
            self.cache = PrefixCache(block_tokens, lambda: self.kv.free_bytes)

    def start(self) -> None:
        """Start the step loop."""
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        """Stop the step loop and the model thread."""
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.model_pool.shutdown(wait=False, cancel_futures=True)

    async def run_model(self, fn: Any, *args: Any) -> Any:
        """Run a model call on the model thread."""
        return await asyncio.get_running_loop().run_in_executor(self.model_pool, fn, *args)

    def join(self, seq: Sequence) -> None:
        """Queue a ready sequence; it enters the batch at the next step boundary."""
        self.joining.append(seq)
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            if not self.running and not self.joining:
                self._wake.clear()
                await self._wake.wait()
            room = self.cfg.max_batch - len(self.running)
            self.running += self.joining[:room]
            del self.joining[:room]
            self.running = [s for s in self.running if not s.cancelled]
            if self.running:
                try:
                    await self._step()
                except Exception as exc:  # a failed step must end its requests, not hang them
                    log.exception("decode step failed")
                    self._fail(self.running, f"decode step failed: {exc}")

    def _fail(self, seqs: list[Sequence], why: str) -> None:
        for seq in seqs:
            seq.error, seq.state = why, None
            seq.out.put_nowait(None)
        self.running = [s for s in self.running if s not in seqs]

    @property
    def alive(self) -> bool:
        """Whether the step loop is running."""
        return self._task is not None and not self._task.done()

    async def _step(self) -> None:
        batch = list(self.running)
        states = [s.state for s in batch]
        last = [s.tokens[-1] for s in batch]
        t0 = time.perf_counter()
        new_states, logits = await self.run_model(self.backend.decode_step, states, last)
        step_ms = (time.perf_counter() - t0) * 1e3
        for row, seq in enumerate(batch):
            seq.state = new_states[row]
            if not seq.stats.first_step_ms:
                seq.stats.first_step_ms = step_ms
            try:
                picked = self.pick(seq, logits[row])
            except Exception as exc:  # one sequence's sampling must not end the whole batch
                log.warning("sampling failed for %s: %s", seq.request.request_id, exc)
                self._fail([seq], f"sampling failed: {exc}")
                continue
            self.emit(seq, picked.token, picked.message())
        self.running = [s for s in self.running if not s.finish_reason and not s.cancelled]

    def pick(self, seq: Sequence, logits: Any) -> Picked:
        """The next token of ``seq`` under its sampling parameters."""
        sampling = Sampling.from_proto(seq.request.sampling)
        return choose(logits, sampling, prompt=seq.prompt, output=seq.tokens,
                      eos_token_id=self.backend.eos_token_id)  # fmt: skip

    def emit(
        self, seq: Sequence, token: int, logprob: serving_pb2.TokenLogprob | None = None
    ) -> None:
        """Record a generated token, decide whether the sequence is finished, hand it out."""
        seq.tokens.append(token)
        seq.logprobs.append(logprob)
        sp = seq.request.sampling
        if not sp.ignore_eos and token == self.backend.eos_token_id:
            seq.finish_reason = "stop"
        elif len(seq.tokens) >= sp.max_tokens:
            seq.finish_reason = "length"
        seq.out.put_nowait(token)
        if seq.finish_reason:
            seq.state = None
            seq.out.put_nowait(None)


class DecodeServicer(serving_pb2_grpc.DecodeServicer):
    """gRPC Decode: admission, KV fetch or local prefill, then tokens from the engine."""

    def __init__(
        self,
        engine: DecodeEngine,
        kv: KVSource,
        *,
        records: AuditLog | None = None,
        kv_load_failure_policy: str = "degrade",
    ) -> None:
        self.engine = engine
        self.kv = kv
        self.fetching = 0
        self._background: set[asyncio.Task[None]] = set()
        self.records = records  # one line per request: which KV it consumed, how it ended
        self.kv_load_failure_policy = kv_load_failure_policy

    async def Status(
        self, request: serving_pb2.DecodeStatusRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.DecodeStatusReply:
        """Health, queue depth and free KV memory, for routing."""
        e = self.engine
        return serving_pb2.DecodeStatusReply(
            healthy=e.alive,
            queue_depth=max(0, e.admitted - len(e.running)),
            running=len(e.running),
            max_batch=e.cfg.max_batch,
            max_queue=e.cfg.max_queue,
            kv_budget_bytes=e.cfg.kv_budget_bytes,
            kv_free_bytes=e.kv.free_bytes,
            kv_bytes_per_token=e.kv_bytes_per_token,
            model_version=e.backend.model_version,
            instance=e.instance,
            vocab_size=e.backend.vocab_size,
            max_context_tokens=e.backend.max_context_tokens,
            prefill_tflops=e.backend.prefill_tflops,
            prefix_cache_bytes=e.cache.bytes if e.cache else 0,
            prefix_block_tokens=e.cache.block_tokens if e.cache else 0,
        )

    async def CacheEvents(
        self, request: serving_pb2.CacheEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[serving_pb2.CacheEvent]:
        """What the prefix cache holds: a snapshot, then every change (the router's view)."""
        cache = self.engine.cache
        if cache is None:
            return
        if cache.subscribers >= MAX_CACHE_SUBSCRIBERS:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many cache watchers")
        queue = cache.subscribe()
        try:
            while (ev := await queue.get()) is not None:
                yield serving_pb2.CacheEvent(
                    stored=ev.stored,
                    removed=ev.removed,
                    cleared=ev.cleared,
                    block_tokens=cache.block_tokens,
                )
        finally:
            cache.unsubscribe(queue)

    async def Generate(
        self, request: serving_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[serving_pb2.GenerateChunk]:
        """Stream one chunk per token, then a last chunk with finish reason and stats."""
        e = self.engine
        if e.admitted >= e.capacity:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "decode queue full")
        problem = check_prompt(
            list(request.prompt_token_ids), e.backend, request.sampling.max_tokens
        ) or sampling_problem(request.sampling, e.backend.vocab_size)
        if problem or request.sampling.max_tokens < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem or "max_tokens < 1")
        if request.kv_start_token and (why := self._start_problem(request)):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        prompt, most = len(request.prompt_token_ids), request.sampling.max_tokens
        need = e.kv_need_bytes(prompt, most)
        if not e.kv.fits_ever(need):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the request's KV needs {need} bytes (prompt {prompt} + max_tokens {most} "
                f"tokens) and decode.kv_budget_bytes of {e.instance} is {e.cfg.kv_budget_bytes}",
            )
        seq = Sequence(request=request, kv_need_bytes=need)
        seq.stats.instance = e.instance
        e.admitted += 1
        try:
            async for chunk in self._serve(seq):
                yield chunk
        except DecodeFailed as exc:
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        finally:
            self._release_if_due(seq)  # also when the request ended early
            self._release_unused(seq)
            self._record(seq)
            self._unpin(seq)
            seq.cancelled = not seq.finish_reason
            seq.state = None
            e.admitted -= 1
            e.kv.give_back(seq.kv_reserved_bytes)

    async def _serve(self, seq: Sequence) -> AsyncIterator[serving_pb2.GenerateChunk]:
        req, arrived = seq.request, time.perf_counter()
        if req.has_first_token:
            self.engine.emit(seq, req.first_token)
            seq.out.get_nowait()  # sent right here, before the KV arrives
            yield serving_pb2.GenerateChunk(token_ids=[req.first_token])
        if seq.finish_reason and req.kv_id:  # max_tokens 1: prefill's token was all of it
            self._release_unused(seq)
        elif not seq.finish_reason:
            # room in the KV budget first (prefill's first token, if any, is already out)
            await self.engine.kv.take(seq.kv_need_bytes, while_waiting=lambda: self._renew(req))
            seq.kv_reserved_bytes = seq.kv_need_bytes
            if self.engine.cache is not None:
                self.engine.cache.fit()  # the cache lives in what is not reserved
            await self._obtain_kv(seq)
        seq.stats.queue_ms = (time.perf_counter() - arrived) * 1e3
        if not seq.finish_reason:
            self.engine.join(seq)
        sent = 1 if req.has_first_token else 0
        while (token := await seq.out.get()) is not None:
            logprob = seq.logprobs[sent] if sent < len(seq.logprobs) else None
            sent += 1
            lps = [logprob] if logprob else []
            yield serving_pb2.GenerateChunk(token_ids=[token], logprobs=lps)
            self._release_if_due(seq)
        if seq.error:
            raise DecodeFailed(seq.error)
        yield serving_pb2.GenerateChunk(finish_reason=seq.finish_reason, stats=seq.stats)

    async def _obtain_kv(self, seq: Sequence) -> None:
        req, st = seq.request, seq.stats
        if req.kv_id and not self._pin_prefix(seq):
            st.route = "disaggregated"
            self._degrade(seq, "decode_prefix_evicted")  # its KV was cut for blocks now gone
        elif req.kv_id:
            st.route = "disaggregated"
            try:
                await self._fetch(seq)
                return
            except KVError as exc:
                st.transfer_outcome = exc.code.value
                st.retries = exc.retries
                self._kv_load_failed(seq, exc.code.value)
            except PdxError as exc:  # fetched, but not usable as this model's KV
                reason = exc.reason if isinstance(exc, KVUnusable) else "kv_unusable"
                log.warning("KV %s unusable (%s): %s", req.kv_id, reason, exc)
                st.transfer_outcome = reason
                self._kv_load_failed(seq, reason)
        else:
            st.route = "local"
            if req.degrade_reason:
                self._degrade(seq, req.degrade_reason)
        await self._local_prefill(seq)

    def _kv_load_failed(self, seq: Sequence, reason: str) -> None:
        """Shipped KV cannot be used: degrade (said so), or recompute quietly if configured."""
        if self.kv_load_failure_policy != "recompute":
            self._degrade(seq, reason)
            return
        # As vLLM's kv_load_failure_policy=recompute looks to a router: the request keeps its
        # disaggregated label and no transfer failure is reported; only decode's own figures
        # (no KV bytes read, a local prefill) show it. Never the default.
        log.warning("KV %s not loaded (%s): recomputing quietly", seq.request.kv_id, reason)
        seq.stats.transfer_outcome, seq.stats.retries, seq.stats.kv_bytes = "", 0, 0

    def _degrade(self, seq: Sequence, reason: str) -> None:
        seq.stats.degraded = True
        seq.stats.degrade_reason = reason
        seq.stats.route = "local"

    async def _fetch(self, seq: Sequence) -> None:
        req, st, e = seq.request, seq.stats, self.engine
        self.fetching += 1
        rebuild: list[StreamRebuild] = []  # the early rebuild of a streamed object
        started = time.perf_counter()
        try:
            if req.first_token_in_kv:  # streamed KV: read it while prefill still writes it

                def on_bytes(codec: str, data: memoryview) -> None:
                    if not rebuild:
                        rebuild.append(StreamRebuild(codec))
                    rebuild[0].feed(data)  # raw: each tensor rebuilt as its bytes arrive

                got = await self.kv.fetch_streamed(req.kv_endpoint, req.kv_id, on_bytes)
            else:
                got = await self.kv.fetch(req.kv_endpoint, req.kv_id)
        except KVError:  # transfer_ms is the whole fetch, its failed attempts too
            st.transfer_ms = (time.perf_counter() - started) * 1e3
            raise
        finally:
            self.fetching -= 1
        st.kv_bytes, st.transfer_ms, st.retries = got.kv_bytes, got.transfer_ms, got.retries
        st.transfer_outcome = "ok"
        st.kv_streamed, st.kv_wait_ms = got.streamed, got.wait_ms
        st.kv_bytes_while_writing = got.bytes_while_writing
        first: serving_pb2.PrefillFirstToken | None = None
        if req.first_token_in_kv:
            try:
                first = serving_pb2.PrefillFirstToken.FromString(got.tail)
            except DecodeError:
                raise KVUnusable(
                    "kv_tail_invalid", "the object's tail is not a first token"
                ) from None
            if not 0 <= first.first_token < e.backend.vocab_size:
                raise KVUnusable("kv_tail_invalid", f"first token {first.first_token} in the tail")
        if got.model_version and got.model_version != e.backend.model_version:
            # KV from other weights would decode into silently wrong tokens: never use it.
            raise KVUnusable("model_version_mismatch", f"KV from {got.model_version}")
        length = len(req.prompt_token_ids) - req.kv_start_token
        if rebuild and got.joined is not None:
            seq.state = rebuild[0].finish(got.joined, got.kv_bytes, got.layout, e.backend, length)
        else:
            payload = got.joined() if got.joined is not None else got.payload
            seq.state = await e.run_model(decode_kv, payload, got.layout, e.backend, length)
        await self._stitch(seq)
        # Acknowledge only once the KV is rebuilt here: then the store may delete it. The
        # acknowledgement is one more round trip: it is sent once this sequence's first decoded
        # token is out (see _serve), not between the fetch and that token.
        seq.release_due = True
        if first is not None and not seq.tokens:  # prefill's first token, from the tail
            lp = first.first_logprob if first.HasField("first_logprob") else None
            e.emit(seq, first.first_token, lp)

    def _release_if_due(self, seq: Sequence) -> None:
        if seq.release_due:
            seq.release_due = False
            seq.kv_released = True
            # Retried while the store cannot be reached: a Release lost to a link cut would
            # leave the object held until its TTL.
            self._spawn(self._release_until_done(seq.request.kv_endpoint, seq.request.kv_id))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._background.discard)

    def _release_unused(self, seq: Sequence) -> None:
        """The request ended without releasing its KV (failed, degraded, cancelled): release it.

        Otherwise the store holds it until its TTL (stranded KV). Retried in the background
        while the store cannot be reached (a link cut), until it answers or the TTL maximum.
        """
        req = seq.request
        if req.kv_id and not seq.kv_released:
            seq.kv_released = True
            self._spawn(self._release_until_done(req.kv_endpoint, req.kv_id))

    async def _release_until_done(
        self, endpoint: str, kv_id: str, give_up_s: float = 300.0
    ) -> None:
        gone = (KVErrorCode.KV_NOT_FOUND, KVErrorCode.KV_EXPIRED)
        delay, t0 = 0.2, time.monotonic()
        while time.monotonic() - t0 < give_up_s:
            try:
                await self.kv.release(endpoint, kv_id)
                return
            except KVError as exc:
                if exc.code in gone:
                    return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _record(self, seq: Sequence) -> None:
        """Decode's own per-request record (kv.audit_dir): the KV it consumed, how it ended."""
        if self.records is None:
            return
        req, st = seq.request, seq.stats
        used_kv = st.kv_bytes > 0 and not st.local_prefill_ms
        self.records.record(
            "request",
            request_id=req.request_id,
            kv_id=req.kv_id or None,
            route=st.route,
            degraded=st.degraded,
            transfer_outcome=st.transfer_outcome or None,
            kv_bytes=st.kv_bytes,
            prompt_tokens=len(req.prompt_token_ids),
            prompt_tokens_from_kv=len(req.prompt_token_ids) - st.cached_tokens if used_kv else 0,
            cached_tokens=st.cached_tokens,
            local_prefill=bool(st.local_prefill_ms),
            outcome="finished" if seq.finish_reason else ("failed" if seq.error else "cancelled"),
            tokens=len(seq.tokens),
            kv_released=seq.kv_released,
        )

    async def _renew(self, req: serving_pb2.GenerateRequest) -> None:
        """Keep a request's KV object leased while it waits for room in the budget."""
        if req.kv_id:
            with contextlib.suppress(KVError):
                await self.kv.renew(req.kv_endpoint, req.kv_id)

    def _start_problem(self, req: serving_pb2.GenerateRequest) -> str | None:
        cache, start = self.engine.cache, req.kv_start_token
        if cache is None:
            return f"kv_start_token {start}: decode {self.engine.instance} keeps no prefix cache"
        if start % cache.block_tokens or start >= len(req.prompt_token_ids):
            return (
                f"kv_start_token {start}: expected a multiple of the cache's "
                f"{cache.block_tokens}-token blocks, before the prompt's last token"
            )
        return None

    def _pin_prefix(self, seq: Sequence) -> bool:
        """Pin the cached prefix the shipped KV continues; False when it is no longer held."""
        start, cache = seq.request.kv_start_token, self.engine.cache
        if not start or cache is None:
            return True
        seq.found = reuse(cache, seq.prompt, start // cache.block_tokens, seq.salt)
        if seq.found.cached_tokens == start:
            return True
        self._unpin(seq)
        return False

    def _unpin(self, seq: Sequence) -> None:
        if seq.found is not None and self.engine.cache is not None:
            self.engine.cache.unpin(seq.found.blocks)
        seq.found = None

    async def _stitch(self, seq: Sequence) -> None:
        """Cached prefix + received suffix → the prompt's KV; its blocks join the cache."""
        e = self.engine
        found = seq.found or reuse(e.cache, seq.prompt, 0, seq.salt)  # whole KV: hashes only
        if found.blocks and seq.state is not None:
            seq.state = await e.run_model(_join_prefix, e.backend, found, seq.state)
            seq.stats.cached_tokens = found.cached_tokens
        self._keep(seq, found)

    def _keep(self, seq: Sequence, found: Reuse) -> None:
        """The prompt's whole blocks join decode's cache; the pinned prefix is let go."""
        e = self.engine
        if e.cache is not None and seq.state is not None:
            keep(e.cache, e.backend, found, seq.state)
            e.cache.count(len(seq.prompt), seq.stats.cached_tokens)
        elif e.cache is not None:
            e.cache.unpin(found.blocks)
        seq.found = None

    async def _local_prefill(self, seq: Sequence) -> None:
        e, prompt = self.engine, seq.prompt
        self._unpin(seq)
        found = reuse(e.cache, prompt, salt=seq.salt)
        t0 = time.perf_counter()
        try:
            seq.state, logits, compute_s = await e.run_model(
                _timed_prefill, e.backend, prompt, found
            )
        except BaseException:
            if e.cache is not None:
                e.cache.unpin(found.blocks)
            raise
        seq.stats.local_prefill_ms = (time.perf_counter() - t0) * 1e3
        seq.stats.local_prefill_compute_ms = compute_s * 1e3
        seq.stats.cached_tokens = found.cached_tokens
        seq.stats.computed_tokens = len(prompt) - found.cached_tokens
        self._keep(seq, found)
        if not seq.tokens:
            picked = e.pick(seq, logits)
            e.emit(seq, picked.token, picked.message())
        if seq.finish_reason:
            seq.state = None


def _timed_prefill(
    backend: ModelBackend, prompt: list[int], found: Reuse
) -> tuple[Any, Any, float]:
    """(model thread) :func:`prefill_with`, and how long the model itself took (seconds)."""
    t0 = time.perf_counter()
    state, logits = prefill_with(backend, prompt, found)
    return state, logits, time.perf_counter() - t0


def _join_prefix(backend: ModelBackend, found: Reuse, suffix: KVState) -> KVState:
    """(model thread) The prompt's KV: the pinned cached blocks, then the received suffix."""
    axes = backend.kv_token_axes(suffix.tensors)
    assert axes is not None
    tokens = {t.shape[a] for t, a in zip(suffix.tensors, axes, strict=True)}
    if tokens != {suffix.length}:  # a prefill that ignored kv_start_token, or sent another range
        raise KVUnusable("kv_range_mismatch", f"KV of {sorted(tokens)} tokens, expected "
                         f"{suffix.length} (from token {found.cached_tokens})")  # fmt: skip
    tensors = token_join([*(b.tensors for b in found.blocks), suffix.tensors], axes)
    return KVState(tensors, found.cached_tokens + suffix.length, suffix.roles)


class DecodeNode:
    """One running decode process: the Decode gRPC service over a batching engine."""

    def __init__(self) -> None:
        self.server: grpc.aio.Server | None = None
        self.engine: DecodeEngine | None = None
        self.source: ClientSource | None = None
        self.port = 0
        self.health_server: grpc.aio.Server | None = None
        self.health: Any = None

    @classmethod
    async def start(cls, cfg: DeployConfig, opts: NodeOptions) -> DecodeNode:
        """Build the model and start the service; the port is bound when this returns."""
        from pdx.serving.backends import create_backend

        node = cls()
        dc, host = cfg.decode, opts.host or cfg.decode.host
        model = cfg.model
        if dc.synthetic_time_scale is not None:  # a slower decode site (synthetic backend)
            model = model.model_copy(update={"synthetic_time_scale": dc.synthetic_time_scale})
        backend = await asyncio.to_thread(create_backend, model)
        node.engine = DecodeEngine(backend, dc, instance=f"decode-{opts.index}")
        if cfg.prefix_cache.enabled:
            node.engine.enable_cache(cfg.prefix_cache.block_tokens)
        node.engine.start()
        node.source = ClientSource(cfg, opts.cert_dir)
        port = opts.pick_port(dc.port, opts.port)
        node.server, node.port, health = create_server(host, port, tls_for(opts.cert_dir, "decode"))
        serving_pb2_grpc.add_DecodeServicer_to_server(
            DecodeServicer(
                node.engine,
                node.source,
                records=_records_log(cfg, opts),
                kv_load_failure_policy=dc.kv_load_failure_policy,
            ),
            node.server,
        )
        await node.server.start()
        await set_serving(health, "pdx.serving.v1.Decode")
        node.health_server = await start_health_server(host, opts.health_port, health)
        node.health = health
        return node

    def announce(self) -> dict[str, Any]:
        """What the supervisor learns when the node is ready."""
        assert self.engine is not None
        return {
            "port": self.port,
            "instance": self.engine.instance,
            **self.engine.backend.describe(),
        }

    async def stop(self, grace_s: float = 2.0) -> None:
        """Graceful: let running streams finish within ``grace_s``, then stop the engine."""
        await stop_serving(self.health, self.server, self.health_server, grace_s)
        if self.engine is not None:
            await self.engine.stop()
        if self.source is not None:
            await self.source.close()


def _records_log(cfg: DeployConfig, opts: NodeOptions) -> AuditLog | None:
    """Per-request records under ``kv.audit_dir`` (none when it is unset)."""
    if cfg.kv.audit_dir is None:
        return None
    return AuditLog(cfg.kv.audit_dir / f"decode-{opts.index}-requests.jsonl", keep_in_memory=0)


def main() -> None:
    """Child-process entry: ``python -m pdx.serving.decode CONFIG INDEX [--cert-dir D] ...``."""
    run_child(DecodeNode.start)


if __name__ == "__main__":
    main()
