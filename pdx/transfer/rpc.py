"""Where the KV contract meets gRPC: the service name, channel options, and error mapping.

Domain errors (:class:`KVError`) become a gRPC status plus the ``pdx-kv-error`` trailing
metadata in exactly one place on the server (:class:`ErrorMappingInterceptor`), and a
gRPC failure becomes a :class:`KVError` in exactly one place on the client
(:func:`map_rpc_error`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from pdx._proto import kv_transfer_pb2 as pb
from pdx.transfer.contract import (
    ERROR_METADATA_KEY,
    GRPC_STATUS,
    RESUME_METADATA_KEY,
    KVError,
    KVErrorCode,
)

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVStore"].full_name
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# Large HTTP/2 frames and write buffers: fewer syscalls and frame headers per chunk.
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.max_frame_size", 16 * 1024 * 1024 - 1),
    ("grpc.http2.write_buffer_size", 8 * 1024 * 1024),
]


def _abort_args(exc: KVError) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    status = getattr(grpc.StatusCode, GRPC_STATUS[exc.code])
    meta: tuple[tuple[str, str], ...] = ((ERROR_METADATA_KEY, exc.code.value),)
    if exc.resume_chunk is not None:
        meta += ((RESUME_METADATA_KEY, str(exc.resume_chunk)),)
    return status, str(exc), meta


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    if not isinstance(exc, KVError):
        log.exception("internal error in KV service", exc_info=exc)
        exc = KVError(KVErrorCode.KV_INTERNAL, f"{type(exc).__name__}: {exc}")
    status, details, meta = _abort_args(exc)
    await context.abort(status, details, trailing_metadata=meta)


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """The one place where domain errors become gRPC status + ``pdx-kv-error`` metadata."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = getattr(handler_call_details, "method", "")
        if handler is None or not method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        kw = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_wrap_call(handler.unary_unary), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(_wrap_call(handler.stream_unary), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_wrap_stream(handler.unary_stream), **kw)
        return handler


def _passthrough(exc: BaseException) -> bool:
    """gRPC's own control flow (abort, cancellation, server stopping) is not ours to map."""
    return isinstance(exc, asyncio.CancelledError | grpc.aio.AbortError) or type(
        exc
    ).__module__.startswith("grpc")


def _wrap_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(request, context)
        except (KVError, Exception) as exc:
            if _passthrough(exc):
                raise
            await _abort(context, exc)

    return call


def _wrap_stream(fn: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in fn(request, context):
                yield item
        except (KVError, Exception) as exc:
            if _passthrough(exc):
                raise
            await _abort(context, exc)

    return stream


_FROM_STATUS: dict[grpc.StatusCode, KVErrorCode] = {
    grpc.StatusCode.NOT_FOUND: KVErrorCode.KV_NOT_FOUND,
    grpc.StatusCode.DATA_LOSS: KVErrorCode.KV_CORRUPT,
    grpc.StatusCode.DEADLINE_EXCEEDED: KVErrorCode.KV_TIMEOUT,
    grpc.StatusCode.RESOURCE_EXHAUSTED: KVErrorCode.KV_OVERLOADED,
    grpc.StatusCode.INVALID_ARGUMENT: KVErrorCode.KV_INVALID,
    grpc.StatusCode.UNAVAILABLE: KVErrorCode.KV_UNAVAILABLE,
    grpc.StatusCode.CANCELLED: KVErrorCode.KV_UNAVAILABLE,
    grpc.StatusCode.UNAUTHENTICATED: KVErrorCode.KV_UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED: KVErrorCode.KV_UNAUTHENTICATED,
    grpc.StatusCode.INTERNAL: KVErrorCode.KV_INTERNAL,
    grpc.StatusCode.ABORTED: KVErrorCode.KV_INCOMPLETE,
}


def _lost_status(exc: grpc.aio.AioRpcError) -> bool:
    """The client's own write failure standing in for the status the server sent."""
    return (
        exc.code() is grpc.StatusCode.INTERNAL
        and exc.details() == "Internal error from Core"
        and "SendMessageOperation" in (exc.debug_error_string() or "")
    )


def map_rpc_error(exc: grpc.aio.AioRpcError, kv_id: str = "") -> KVError:
    """The one mapping from a gRPC failure to a contract error (metadata first, status second)."""
    if _lost_status(exc):
        # grpc.aio (grpc/grpc#36066): when a server ends a client stream (a refused Put)
        # while a write is in flight, the failed write replaces the server's status with
        # INTERNAL. The stream closed under us and its answer is lost: retryable, so the
        # retry (under the budget) hears the server's own code.
        return KVError(KVErrorCode.KV_UNAVAILABLE, "stream closed during a write; status lost",
                       kv_id=kv_id)  # fmt: skip
    meta = {k: v for k, v in (exc.trailing_metadata() or ())}
    name = meta.get(ERROR_METADATA_KEY)
    if isinstance(name, str) and name in KVErrorCode.__members__:
        code = KVErrorCode(name)
    else:
        code = _FROM_STATUS.get(exc.code(), KVErrorCode.KV_INTERNAL)
    resume = meta.get(RESUME_METADATA_KEY)
    details = exc.details() or exc.code().name
    prefix = f"{code.value}: "
    message = details.removeprefix(prefix).split(" [kv1.")[0]
    return KVError(
        code,
        message,
        kv_id=kv_id,
        resume_chunk=int(resume)
        if isinstance(resume, str) and resume.isascii() and resume.isdigit()
        else None,
    )
