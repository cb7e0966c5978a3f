"""A KV client's gRPC channels: every call, and Put and Get ranges inside gRPC messages."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import xxhash

from pdx._proto import kv_transfer_pb2 as pb
from pdx.transfer.client.attempts import Attempts, Request
from pdx.transfer.contract import CLIENT_ID_METADATA_KEY, KVClientConfig, KVError
from pdx.transfer.objects import Assembly, StreamAssembly
from pdx.transfer.rpc import CHANNEL_OPTIONS, SERVICE_NAME
from pdx.transfer.wire import encode_chunk, is_chunk_message

# After a link blip gRPC refuses calls until its reconnect backoff (default 1 s, growing)
# expires; keep that short so a healed link is used again within ~0.1 s. gRPC also takes
# min_reconnect_backoff as the least time it gives one connection attempt: TCP, TLS and the
# HTTP/2 SETTINGS exchange are four round trips (1.2 s at 300 ms RTT) and a lost SYN is
# resent after 1 s, so an attempt gets 3 s; the request's own deadline still bounds the call.
CONNECT_ATTEMPT_MS = 3000
RECONNECT_OPTIONS: list[tuple[str, int]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", CONNECT_ATTEMPT_MS),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class GrpcTransport:
    """The client's gRPC channels (``kv.connections``): every call, and ranges as messages."""

    def __init__(
        self,
        target: str,
        cfg: KVClientConfig,
        credentials: grpc.ChannelCredentials | None,
        attempts: Attempts,
    ) -> None:
        self.target = target
        self.attempts = attempts
        self.metadata = ((CLIENT_ID_METADATA_KEY, cfg.client_id),)
        self._channels = [self._channel(i, credentials) for i in range(cfg.connections)]

    def _channel(self, i: int, creds: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
        # A distinct option per channel keeps each on its own TCP connection.
        options = [*CHANNEL_OPTIONS, *RECONNECT_OPTIONS, ("pdx.connection", i)]
        if creds is None:
            return grpc.aio.insecure_channel(self.target, options=options)
        return grpc.aio.secure_channel(self.target, creds, options=options)

    def rpc(self, i: int, kind: str, name: str, **kw: Any) -> Any:
        """The multi-callable of method ``name`` on channel ``i`` (modulo their number)."""
        ch = self._channels[i % len(self._channels)]
        return getattr(ch, kind)(f"/{SERVICE_NAME}/{name}", **kw)

    async def close(self) -> None:
        """Close every channel."""
        for ch in self._channels:
            await ch.close()

    async def unary(self, req: Request, name: str, request: Any, reply: Any) -> Any:
        """A unary call, retried under ``req``'s deadline and budgets."""
        call = self.rpc(
            0,
            "unary_unary",
            name,
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=reply.FromString,
        )

        async def once(timeout_s: float) -> Any:
            t0 = time.perf_counter()
            reply = await call(request, timeout=timeout_s, metadata=self.metadata)
            # An upper bound of the RTT (the first call also sets up the channel: a cold
            # client's deadline errs on the long side until TCP itself measures the path).
            self.attempts.path.observe_rtt((time.perf_counter() - t0) * 1e3)
            return reply

        while True:
            try:
                return await self.attempts.attempt(req, once)
            except KVError as exc:
                await self.attempts.before_retry(req, exc)

    async def put_range(
        self,
        req: Request,
        k: int,
        header: pb.PutHeader,
        view: memoryview,
        first: int,
        end: int,
        timeout_s: float,
    ) -> pb.PutResponse:
        """A Put stream on channel ``k``."""
        call = self.rpc(k, "stream_unary", "Put", response_deserializer=pb.PutResponse.FromString)
        messages = _put_messages(header, view, first, end)
        left = max(req.remaining_s(), 0.001)
        reply: pb.PutResponse = await call(messages, timeout=left, metadata=self.metadata)
        return reply

    async def get_range(
        self,
        req: Request,
        k: int,
        got: Assembly,
        state: dict[str, int],
        end: int,
        timeout_s: float,
    ) -> None:
        """A Get stream on channel ``k``."""
        call = self.rpc(
            k, "unary_stream", "Get", request_serializer=pb.GetRequest.SerializeToString
        )
        request = pb.GetRequest(kv_id=got.kv_id, from_chunk=state["next"], to_chunk=end)
        left = max(req.remaining_s(), 0.001)
        stream = call(request, timeout=left, metadata=self.metadata)
        try:
            await _receive(stream, got, state)
        finally:
            stream.cancel()

    async def get_streamed(
        self, req: Request, got: StreamAssembly, state: dict[str, int], idle_s: float
    ) -> None:
        """A Get stream of an object that may still be written (channel 0).

        While the writer writes, the deadline follows it: each message re-arms it ``idle_s``
        ahead (the store itself ends a writer that stops making progress: KV_INCOMPLETE). From
        the closed info on, the bytes still missing must arrive within the request's derived
        deadline, counted from that moment. A prefill that computes for seconds is therefore
        never a KV_TIMEOUT while its layers keep coming; a store that stops answering is.
        """
        call = self.rpc(
            0, "unary_stream", "Get", request_serializer=pb.GetRequest.SerializeToString
        )
        request = pb.GetRequest(kv_id=got.kv_id, from_chunk=state["next"], to_chunk=0)
        stream = call(request, metadata=self.metadata)  # timed per message below
        messages = stream.__aiter__()
        ms = req.deadline.ms if req.deadline is not None else 0.0
        first = True
        try:
            while True:
                writing = got.info is None or (got.info.writing and got.closed is None)
                if writing:
                    req.deadline_s = time.monotonic() + idle_s
                left = req.remaining_s()
                if left <= 0:
                    raise TimeoutError
                try:
                    raw = await asyncio.wait_for(messages.__anext__(), timeout=left)
                except StopAsyncIteration:
                    return
                _take(raw, got, state, first)
                first = False
                if writing and got.info is not None and not (got.info.writing and
                                                             got.closed is None):  # fmt: skip
                    req.deadline_s = time.monotonic() + ms / 1000
        finally:
            stream.cancel()


async def _put_messages(
    header: pb.PutHeader, view: memoryview, first: int, end: int
) -> AsyncIterator[bytes]:
    """A Put stream: header, chunks ``first .. end-1``, and the trailer if announced.

    Each chunk is hashed just before it is copied into its message, so its bytes are
    read from memory once for both; with ``digest_in_trailer`` the object digest grows
    from the same, still cached, chunk.
    """
    yield pb.PutRequest(header=header).SerializeToString()
    size = header.chunk_size_bytes
    whole = xxhash.xxh3_64() if header.digest_in_trailer else None
    for i in range(first, end):
        part = view[i * size : (i + 1) * size]
        if whole is not None:
            whole.update(part)
        yield encode_chunk(i, part)
    if whole is not None:
        trailer = pb.PutTrailer(object_digest=whole.intdigest())
        yield pb.PutRequest(trailer=trailer).SerializeToString()


async def _receive(stream: Any, got: Assembly, state: dict[str, int]) -> None:
    first = True
    async for raw in stream:
        _take(raw, got, state, first)
        first = False


def _take(raw: bytes, got: Assembly, state: dict[str, int], first: bool) -> None:
    """One Get message: the info first, chunks, and a streamed Get's closed info last."""
    if first or not is_chunk_message(raw):
        got.accept_info(pb.GetResponse.FromString(raw).info)
        if isinstance(got, StreamAssembly):
            now = time.perf_counter()
            got.first_s = got.first_s or now
            if got.closed is not None:
                got.closed_s = now
        return
    got.add(state["next"], raw)
    state["next"] += 1
