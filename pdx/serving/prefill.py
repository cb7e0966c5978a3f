"""The prefill service: runs the prompt, stores its KV, answers with the kv_id and first token.

``PrefillStream`` (what the gateway uses) answers the first token before the KV is stored, so
the store Put is not on the time to first token; ``Prefill`` answers both at once.

One process = one gRPC Prefill service + the KV store that holds what it produced (decode
instances read from that store over the KV transfer contract). Admission is bounded:
``max_inflight`` prompts run at once, at most ``max_queue`` wait, and ``rate_limit_qps``
caps arrivals; anything beyond is refused with RESOURCE_EXHAUSTED, never queued unboundedly.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from pdx._proto import serving_pb2, serving_pb2_grpc
from pdx.kv.codecs import get_codec
from pdx.kv.codecs.base import dtype_name, pack
from pdx.kv.codecs.tensorio import tensor_bytes
from pdx.serving.backends.base import KVState, LayerSink, ModelBackend
from pdx.serving.backends.kvwire import EncodedKV, encode_kv
from pdx.serving.backends.sampling import Picked, Sampling, choose, sampling_problem
from pdx.serving.deploy_config import DeployConfig, NodeOptions, PrefillConfig
from pdx.serving.kv_settings import PrefillKV, dialable, prefill_kv
from pdx.serving.node import run_child, stop_serving
from pdx.serving.prefix_cache import (
    PrefixCache,
    Reuse,
    cache_supported,
    cut_from,
    keep,
    prefill_with,
    reuse,
)
from pdx.serving.rpc import create_server, set_serving, start_health_server
from pdx.tls import tls_for
from pdx.transfer.client import KVClient
from pdx.transfer.contract import KVError, KVLayout
from pdx.transfer.server import create_kv_server

SERVICE = "pdx.serving.v1.Prefill"
#: A whole object is handed to the in-process writer in slices this size (what one streamed
#: layer's tensor is for an 8B-class model at 4k tokens), so the event loop is never held
#: for the whole object's digests.
WHOLE_WRITE_SLICE_BYTES = 8 * 1024 * 1024


class KVSink(Protocol):
    """Where prefill puts KV: the store this process holds."""

    endpoint: str

    async def put(self, encoded: EncodedKV, model_version: str, ttl_s: int) -> tuple[str, int]:
        """Store an object; return (kv_id, stored bytes)."""
        ...

    async def open(self, reserve_bytes: int, codec: str, model_version: str, ttl_s: int) -> Any:
        """Open a streamed object (kv.streaming): a :class:`pdx.transfer.client.StreamWriter`."""
        ...


def reserve_bytes(raw_bytes: int, tensors: int) -> int:
    """An upper bound of a codec's output for ``raw_bytes`` in ``tensors`` tensors: what a
    streamed object reserves before its size is known (the unused part is freed at close).
    Covers a codec's frame header per tensor and the worst expansion of zstd and lz4."""
    return raw_bytes + raw_bytes // 64 + tensors * 4096 + 65536


class TokenBucket:
    """Arrival rate limit: ``rate`` per second with a burst of one second's worth."""

    def __init__(self, rate_per_s: float) -> None:
        self.rate = rate_per_s
        self.tokens = rate_per_s
        self.stamp = time.monotonic()

    def take(self) -> bool:
        """True when a request may pass now."""
        now = time.monotonic()
        self.tokens = min(self.rate, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False


def check_prompt(token_ids: list[int], backend: ModelBackend, max_new: int) -> str | None:
    """Why a prompt is unacceptable, or None."""
    if not token_ids:
        return "prompt is empty"
    if len(token_ids) + max_new > backend.max_context_tokens:
        return (
            f"prompt of {len(token_ids)} tokens + max_tokens {max_new} exceeds the model's "
            f"context of {backend.max_context_tokens} tokens"
        )
    vocab = backend.vocab_size  # a property: read once, not once per token (it is on the TTFT path)
    if min(token_ids) < 0 or max(token_ids) >= vocab:
        bad = next(t for t in token_ids if not 0 <= t < vocab)
        return f"token id {bad} is outside the vocabulary [0, {vocab})"
    return None


@dataclass
class Prefilled:
    """A prompt's KV and first token, before the KV is stored."""

    state: KVState
    first_token: int
    prefill_ms: float
    queue_ms: float
    done_at: float  # perf_counter() when the model finished
    first_logprob: serving_pb2.TokenLogprob | None = None
    cached_tokens: int = 0  # prompt tokens taken from this prefill's prefix cache
    start: int = 0  # the first token that ships (decode holds the ones before)

    def shipped(self, backend: ModelBackend) -> KVState:
        """The KV that ships: tokens ``start:`` of the prompt's."""
        if not self.start:
            return self.state
        tensors = cut_from(backend, self.state.tensors, self.start)
        return KVState(tensors, self.state.length - self.start, self.state.roles)

    @property
    def shipped_raw_bytes(self) -> int:
        """Bytes of the shipped KV before the codec (every layer holds each token alike)."""
        n = max(1, self.state.length)
        return self.state.nbytes * (n - self.start) // n

    def first_event(self, backend: ModelBackend) -> serving_pb2.PrefillFirstToken:
        """The first PrefillStream event."""
        return serving_pb2.PrefillFirstToken(
            first_token=self.first_token,
            prefill_ms=self.prefill_ms,
            queue_ms=self.queue_ms,
            model_version=backend.model_version,
            first_logprob=self.first_logprob,
        )


def _prefill_and_pick(
    backend: ModelBackend,
    ids: list[int],
    sampling: Sampling,
    found: Reuse,
    on_layer: LayerSink | None = None,
) -> tuple[KVState, Picked]:
    # Sampling on the model thread saves one event-loop round trip before the first token.
    state, logits = prefill_with(backend, ids, found, on_layer)
    eos = backend.eos_token_id
    return state, choose(logits, sampling, prompt=ids, output=[], eos_token_id=eos)


class _LayerWriter:
    """Layers from the model thread → encoded on the codec pool → the object's Put stream.

    The model thread only queues each layer (``on_layer``); encoding runs beside the
    forward pass of the next layers, and the encoded bytes join the Put stream in order.
    """

    def __init__(
        self,
        writer: Any,
        codec: str,
        loop: asyncio.AbstractEventLoop,
        pool: ThreadPoolExecutor,
        cut: Callable[[list[Any]], list[Any]] | None = None,
    ) -> None:
        self.writer, self.codec, self.loop, self.pool = writer, codec, loop, pool
        self.cut = cut  # the part of each layer that ships (decode holds the rest)
        self.encoder = get_codec(codec)
        self.queue: asyncio.Queue[tuple[list[Any], list[str]]] = asyncio.Queue()
        self.shapes: list[list[int]] = []
        self.roles: list[str] = []
        self.tensor_bytes: list[int] = []
        self.dtype = ""
        self.layers = 0
        self.task = loop.create_task(self._drain())

    def on_layer(self, tensors: list[Any], roles: list[Any]) -> None:
        """(model thread) One layer's KV exists."""
        tensors = self.cut(tensors) if self.cut is not None else tensors
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (tensors, list(roles)))

    def _encode(self, tensors: list[Any], roles: list[str]) -> list[list[bytes | memoryview]]:
        """Each tensor's encoding, in parts. ``raw``: its frame header and a view of the
        tensor's own bytes (the very bytes ``RawCodec.encode`` would join, without the copy)."""
        if self.codec == "raw":
            return [
                [pack({"codec": "raw", "dtype": dtype_name(t.dtype), "shape": list(t.shape)}),
                 tensor_bytes(t)]
                for t in tensors
            ]  # fmt: skip
        return [[self.encoder.encode(t, r)] for t, r in zip(tensors, roles, strict=True)]  # type: ignore[arg-type]

    async def _drain(self) -> None:
        while True:
            tensors, roles = await self.queue.get()
            if not tensors:
                return
            blobs = await self.loop.run_in_executor(self.pool, self._encode, tensors, roles)
            for t, role, parts in zip(tensors, roles, blobs, strict=True):
                for part in parts:
                    self.writer.write(part)
                self.shapes.append(list(t.shape))
                self.roles.append(role)
                self.tensor_bytes.append(sum(len(part) for part in parts))
                self.dtype = self.dtype or str(t.dtype).removeprefix("torch.")
            self.layers += 1

    async def close(self, tail: bytes) -> Any:
        """Wait for every queued layer, then close the object with its final layout."""
        self.queue.put_nowait(([], []))
        await self.task
        layout = KVLayout(num_layers=self.layers, dtype=self.dtype, shapes=self.shapes,
                          codec=self.codec, tensor_bytes=self.tensor_bytes,
                          roles=self.roles)  # fmt: skip
        return await self.writer.close(layout, tail)


class PrefillServicer(serving_pb2_grpc.PrefillServicer):
    """gRPC Prefill: bounded admission → model prefill → encode → KV store put.

    ``PrefillStream`` answers the first token before the encode and put, which overlap its send.
    """

    def __init__(
        self,
        backend: ModelBackend,
        cfg: PrefillConfig,
        kv: PrefillKV,
        sink: KVSink,
        cache: PrefixCache | None = None,
    ) -> None:
        self.backend = backend
        self.cache = cache  # this prefill's prefix cache (prefix_cache.*), None when off
        self.cfg = cfg
        self.kv = kv
        self.sink = sink
        self._slots = asyncio.Semaphore(cfg.max_inflight)
        self._waiting = 0
        self._bucket = TokenBucket(cfg.rate_limit_qps)
        self._model = ThreadPoolExecutor(1, thread_name_prefix="prefill-model")
        self._background: set[asyncio.Future[None]] = set()
        self._codec_pool = ThreadPoolExecutor(2, thread_name_prefix="prefill-codec")

    async def Prefill(
        self, request: serving_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.PrefillReply:
        """Run one prompt; the reply carries kv_id, first token and timings."""
        ids = await self._admit(request, context)
        self._waiting += 1
        arrived = time.perf_counter()
        try:
            async with self._slots:
                done = await self._compute(request, ids, arrived)
                return await self._store(request, done, await self._encode(request, done))
        finally:
            self._waiting -= 1

    async def PrefillStream(
        self, request: serving_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[serving_pb2.PrefillEvent]:
        """Run one prompt; answer the first token at once, then the kv_id once stored."""
        if self.kv.streaming:
            async for event in self._prefill_streamed(request, context):
                yield event
            return
        ids = await self._admit(request, context)
        self._waiting += 1
        arrived = time.perf_counter()
        try:
            async with self._slots:
                done = await self._compute(request, ids, arrived)
                # Encoding (a worker thread) overlaps the first token's send; the Put, which
                # works on this event loop, starts once that message is written.
                encoding = self._encode(request, done)
                try:
                    yield serving_pb2.PrefillEvent(first=done.first_event(self.backend))
                    put = asyncio.ensure_future(self._store(request, done, await encoding))
                    try:  # shielded: a caller that leaves mid-Put must not orphan the object
                        stored = await asyncio.shield(put)
                    except asyncio.CancelledError:
                        put.add_done_callback(self._release_unclaimed)
                        raise
                except KVError as exc:  # the first token is out; the caller decides what next
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV store put: {exc}")
                finally:
                    encoding.cancel()
                try:
                    yield serving_pb2.PrefillEvent(stored=stored)
                except (asyncio.CancelledError, GeneratorExit):
                    self._release_unclaimed(put)
                    raise
        finally:
            self._waiting -= 1

    async def _prefill_streamed(
        self, request: serving_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[serving_pb2.PrefillEvent]:
        """kv.streaming: open the object, announce its kv_id, store each layer's KV as the
        forward pass produces it, answer the first token, then close the object.

        The object's tail carries the first token (a serialized PrefillFirstToken), so a
        decode that started reading at the ``opened`` event learns it with the last chunk.
        A failed or abandoned prefill aborts the Put: readers get KV_INCOMPLETE.
        """
        ids = await self._admit(request, context)
        self._waiting += 1
        arrived = time.perf_counter()
        try:
            async with self._slots:
                codec = request.codec or self.kv.codec
                raw, count = self.backend.kv_bytes_bound(len(ids) - request.kv_start_token)
                version, ttl = self.backend.model_version, self.kv.ttl_s
                try:
                    writer = await self.sink.open(reserve_bytes(raw, count), codec, version, ttl)
                except KVError as exc:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV store open: {exc}")
                opened = serving_pb2.PrefillOpened(kv_id=writer.kv_id,
                                                   kv_endpoint=self.sink.endpoint)  # fmt: skip
                layers: _LayerWriter | None = None
                try:
                    yield serving_pb2.PrefillEvent(opened=opened)
                    start = request.kv_start_token
                    cut = (lambda t: cut_from(self.backend, t, start)) if start else None
                    layers = _LayerWriter(writer, codec, asyncio.get_running_loop(),
                                          self._codec_pool, cut)  # fmt: skip
                    done = await self._compute(request, ids, arrived, layers.on_layer)
                    writer.mark_overlap()
                    first = done.first_event(self.backend)
                    yield serving_pb2.PrefillEvent(first=first)
                    info = await layers.close(first.SerializeToString())
                except BaseException:
                    writer.abort()
                    if layers is not None:
                        layers.task.cancel()
                    raise
                overlap_bytes, overlap_ms = writer.overlap or (0, 0.0)
                stored = serving_pb2.PrefillReply(
                    kv_id=writer.kv_id, first_token=done.first_token,
                    kv_endpoint=self.sink.endpoint, kv_bytes=info.size_bytes,
                    kv_raw_bytes=done.shipped_raw_bytes, prefill_ms=done.prefill_ms,
                    store_ms=(time.perf_counter() - done.done_at) * 1e3, queue_ms=done.queue_ms,
                    model_version=version, codec=codec, kv_overlap_bytes=overlap_bytes,
                    kv_overlap_ms=overlap_ms, kv_streamed=True, cached_tokens=done.cached_tokens,
                    kv_start_token=done.start,
                )  # fmt: skip
                yield serving_pb2.PrefillEvent(stored=stored)
        finally:
            self._waiting -= 1

    def _release_unclaimed(self, put: asyncio.Future[serving_pb2.PrefillReply]) -> None:
        """The caller left before it learnt the kv_id: nobody else can release the object.

        Without this it stays in the store until its TTL (stranded KV). Sinks that can delete
        offer ``release(kv_id)``.
        """
        release = getattr(self.sink, "release", None)
        if release is None or put.cancelled() or put.exception() is not None:
            return
        task = asyncio.ensure_future(release(put.result().kv_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _admit(
        self, request: serving_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> list[int]:
        if not self._bucket.take():
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "prefill rate limit")
        if self._waiting >= self.cfg.max_queue + self.cfg.max_inflight:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "prefill queue full")
        ids = list(request.token_ids)
        problem = check_prompt(ids, self.backend, 0) or sampling_problem(
            request.sampling, self.backend.vocab_size
        )
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if request.kv_start_token and (why := self._start_problem(request.kv_start_token, ids)):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        return ids

    def _start_problem(self, start: int, ids: list[int]) -> str | None:
        if start >= len(ids):
            return f"kv_start_token {start} leaves no token of the {len(ids)}-token prompt to ship"
        if not cache_supported(self.backend):
            return f"kv_start_token {start}: this model's KV cannot be cut at a token"
        return None

    async def _compute(
        self,
        request: serving_pb2.PrefillRequest,
        ids: list[int],
        arrived: float,
        on_layer: LayerSink | None = None,
    ) -> Prefilled:
        """Prefill ``ids``, the cached prefix (this prefill's own cache) not recomputed; the
        prompt's whole blocks are kept for the next request that shares them."""
        started = time.perf_counter()
        sampling = Sampling.from_proto(request.sampling)
        found = reuse(self.cache, ids, salt=request.cache_salt)
        try:
            state, first = await asyncio.get_running_loop().run_in_executor(
                self._model, _prefill_and_pick, self.backend, ids, sampling, found, on_layer
            )
        except BaseException:
            if self.cache is not None:
                self.cache.unpin(found.blocks)
            raise
        done = time.perf_counter()
        keep(self.cache, self.backend, found, state)
        if self.cache is not None:
            self.cache.count(len(ids), found.cached_tokens)
        queue_ms, prefill_ms = (started - arrived) * 1e3, (done - started) * 1e3
        return Prefilled(state, first.token, prefill_ms, queue_ms, done, first.message(),
                         found.cached_tokens, request.kv_start_token)  # fmt: skip

    def _encode(
        self, request: serving_pb2.PrefillRequest, done: Prefilled
    ) -> asyncio.Future[EncodedKV]:
        codec = request.codec or self.kv.codec
        layers = len(done.state.tensors) // 2
        return asyncio.get_running_loop().run_in_executor(
            self._codec_pool, encode_kv, done.shipped(self.backend), codec, layers
        )

    async def _store(
        self, request: serving_pb2.PrefillRequest, done: Prefilled, encoded: EncodedKV
    ) -> serving_pb2.PrefillReply:
        kv_id, stored = await self.sink.put(encoded, self.backend.model_version, self.kv.ttl_s)
        return serving_pb2.PrefillReply(
            kv_id=kv_id,
            first_token=done.first_token,
            kv_endpoint=self.sink.endpoint,
            kv_bytes=stored,
            kv_raw_bytes=encoded.raw_bytes,
            prefill_ms=done.prefill_ms,
            store_ms=(time.perf_counter() - done.done_at) * 1e3,
            queue_ms=done.queue_ms,
            model_version=self.backend.model_version,
            codec=encoded.layout["codec"],
            cached_tokens=done.cached_tokens,
            kv_start_token=done.start,
        )

    def close(self) -> None:
        """Stop the worker threads."""
        self._model.shutdown(wait=False, cancel_futures=True)
        self._codec_pool.shutdown(wait=False, cancel_futures=True)


def prefill_cache(cfg: DeployConfig, backend: ModelBackend) -> PrefixCache | None:
    """This prefill's prefix cache, when on and the model's KV can be cut at a token."""
    pc = cfg.prefix_cache
    if not pc.enabled or not pc.prefill_budget_bytes or not cache_supported(backend):
        return None
    return PrefixCache(pc.block_tokens, lambda: pc.prefill_budget_bytes)


def describe(servicer: PrefillServicer) -> dict[str, Any]:
    """What the process announces when ready."""
    return {"kv_endpoint": servicer.sink.endpoint, **servicer.backend.describe()}


class StoreSink:
    """Puts KV into this process's own store (the contract's Open + Put rules).

    With ``local_service``, the store this process holds, every object (whole or streamed,
    kv.streaming) is written straight into it by one writer
    (:class:`pdx.transfer.local.LocalWriter`: the rules of Open + Put without a loopback gRPC
    stream, which in one Python process costs as much CPU as the transfer itself); without
    it, through the KV client's Put (whole) or Open + Put (streamed).
    """

    def __init__(self, client: Any, endpoint: str, local_service: Any = None) -> None:
        self.client = client
        self.endpoint = endpoint
        self.local_service = local_service

    async def put(self, encoded: EncodedKV, model_version: str, ttl_s: int) -> tuple[str, int]:
        """Store ``encoded``; return (kv_id, stored bytes)."""
        layout = KVLayout(**encoded.layout)
        if self.local_service is None:
            kv_id = await self.client.put(
                encoded.payload, layout, model_version=model_version, ttl_s=ttl_s
            )
            return str(kv_id), len(encoded.payload)
        payload = memoryview(encoded.payload)
        writer = await self.open(len(payload), layout.codec, model_version, ttl_s)
        try:
            for start in range(0, len(payload), WHOLE_WRITE_SLICE_BYTES):
                writer.write(payload[start : start + WHOLE_WRITE_SLICE_BYTES])
                await asyncio.sleep(0)  # other calls on this loop run between slices
            info = await writer.close(layout)
        except BaseException:
            writer.abort()
            raise
        return str(writer.kv_id), int(info.size_bytes)

    async def open(self, reserve_bytes: int, codec: str, model_version: str, ttl_s: int) -> Any:
        """Open a streamed object reserving ``reserve_bytes``; return its writer."""
        layout = KVLayout(codec=codec)
        if self.local_service is not None:
            from pdx.transfer.local import LocalWriter

            cfg = self.client.cfg
            who = "cn=prefill" if self.client.secure else f"client={cfg.client_id}"
            return LocalWriter(self.local_service, reserve_bytes, layout,
                               chunk_size_bytes=cfg.chunk_size_bytes,
                               model_version=model_version, ttl_s=ttl_s, who=who)  # fmt: skip
        return await self.client.open(
            reserve_bytes, layout, model_version=model_version, ttl_s=ttl_s
        )

    async def release(self, kv_id: str) -> None:
        """Delete an object no consumer will ever ask for (its request is gone)."""
        with contextlib.suppress(KVError):
            await self.client.release(kv_id)


class PrefillNode:
    """One running prefill process: the Prefill gRPC service and the KV store it holds."""

    def __init__(self) -> None:
        self.server: grpc.aio.Server | None = None
        self.kv_server: Any = None
        self.servicer: PrefillServicer | None = None
        self.client: Any = None
        self.port = 0
        self.kv_port = 0
        self.health_server: grpc.aio.Server | None = None
        self.health: Any = None

    @classmethod
    async def start(cls, cfg: DeployConfig, opts: NodeOptions) -> PrefillNode:
        """Build the model, start the store and the service; ports are bound when this returns."""
        from pdx.serving.backends import create_backend

        node = cls()
        pc, kv, certs = cfg.prefill, prefill_kv(cfg, opts), opts.cert_dir
        host = opts.host or pc.host
        backend = await asyncio.to_thread(create_backend, cfg.model)
        node.kv_server, node.kv_port = await create_kv_server(kv.store)
        local = f"{dialable(host)}:{node.kv_port}"
        advertised = f"{opts.advertise_host or dialable(host)}:{node.kv_port}"
        tls = tls_for(certs, "prefill")
        node.client = KVClient(local, kv.client, tls=tls)
        sink = StoreSink(node.client, advertised, node.kv_server.service)
        node.servicer = PrefillServicer(backend, pc, kv, sink, prefill_cache(cfg, backend))
        node.server, node.port, health = create_server(
            host, opts.pick_port(pc.port, opts.port), tls
        )
        serving_pb2_grpc.add_PrefillServicer_to_server(node.servicer, node.server)
        await node.server.start()
        await set_serving(health, SERVICE)
        node.health_server = await start_health_server(host, opts.health_port, health)
        node.health = health
        return node

    def announce(self) -> dict[str, Any]:
        """What the supervisor learns when the node is ready."""
        assert self.servicer is not None
        return {"port": self.port, "kv_port": self.kv_port, **describe(self.servicer)}

    async def stop(self, grace_s: float = 2.0) -> None:
        """Graceful: stop taking requests, finish in-flight ones, then close the store."""
        await stop_serving(self.health, self.server, self.health_server, grace_s)
        if self.client is not None:
            await self.client.close()
        if self.kv_server is not None:
            await self.kv_server.stop(grace_s)
        if self.servicer is not None:
            self.servicer.close()


def main() -> None:
    """Child-process entry: ``python -m pdx.serving.prefill CONFIG INDEX [--cert-dir D] ...``."""
    run_child(PrefillNode.start)


if __name__ == "__main__":
    main()
