"""OpenAI response bodies: a whole completion, or its server-sent events.

Non-streaming bodies are built through the response models of :mod:`.protocol` (what the
OpenAPI document describes). Streams send one event per generated token and choice, then a
last event per choice with its ``finish_reason`` and the ``pdx`` object, then (with
``stream_options.include_usage``) one event with ``choices: []`` and the ``usage``, then
``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import orjson
from aiohttp import web

from pdx._proto import serving_pb2
from pdx.serving.backends.tokenizer import Tokenizer
from pdx.serving.gateway.flow import Flow, Outcome
from pdx.serving.gateway.protocol import (
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    HTTPProblem,
)


def usage(req: CompletionRequest, flows: list[Flow]) -> dict[str, Any]:
    """The OpenAI ``usage`` object: completion tokens summed over the choices, and
    ``prompt_tokens_details.cached_tokens`` where the engine said (pdx's decode: the prompt
    tokens its prefix cache supplied)."""
    prompt, completion = len(req.prompt_ids), sum(len(f.outcome.tokens) for f in flows)
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion}  # fmt: skip
    cached = flows[0].outcome.pdx.get("cached_tokens") if flows else None
    if isinstance(cached, int):
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def token_text(tokenizer: Tokenizer, token: int) -> tuple[str, list[int]]:
    """A token's string for logprobs (``bytes:\\xNN`` when it is part of a character)."""
    raw = tokenizer.token_bytes(token)
    try:
        return raw.decode("utf-8"), list(raw)
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)


class LogprobFormatter:
    """Turns TokenLogprob messages into OpenAI's completion or chat logprobs objects."""

    def __init__(self, tokenizer: Tokenizer, req: CompletionRequest) -> None:
        self.tokenizer, self.req = tokenizer, req

    def _text(self, token: int) -> tuple[str, list[int]]:
        """The token as logprobs name it: its text, or ``token_id:N`` when the request set
        vLLM's ``return_tokens_as_token_ids`` (exact where text is ambiguous)."""
        if self.req.tokens_as_ids:
            return f"token_id:{token}", list(self.tokenizer.token_bytes(token))
        return token_text(self.tokenizer, token)

    def chat(self, lps: list[serving_pb2.TokenLogprob | None]) -> dict[str, Any]:
        """``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
        content = []
        for lp in lps:
            if lp is None:
                continue
            text, raw = self._text(lp.token_id)
            top = []
            for tid, value in zip(lp.top_ids, lp.top_logprobs, strict=True):
                t_text, t_raw = self._text(tid)
                top.append({"token": t_text, "logprob": value, "bytes": t_raw})
            content.append({"token": text, "logprob": lp.logprob, "bytes": raw,
                            "top_logprobs": top})  # fmt: skip
        return {"content": content, "refusal": None}

    def completion(self, lps: list[serving_pb2.TokenLogprob | None], offset: int) -> dict[str, Any]:
        """``{tokens, token_logprobs, top_logprobs, text_offset}``; offsets start at ``offset``."""
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for lp in lps:
            if lp is None:
                continue
            text, _ = self._text(lp.token_id)
            tokens.append(text)
            values.append(lp.logprob)
            offsets.append(offset)
            offset += len(self.tokenizer.decode([lp.token_id]))
            tops.append({self._text(t)[0]: v
                         for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)})  # fmt: skip
        return {"tokens": tokens, "token_logprobs": values,
                "top_logprobs": tops if self.req.logprobs else None,
                "text_offset": offsets}  # fmt: skip


def prompt_text(tokenizer: Tokenizer, req: CompletionRequest) -> str:
    """The prompt as text (for echo)."""
    return req.prompt_text or tokenizer.decode(req.prompt_ids)


def completion_body(
    tokenizer: Tokenizer, req: CompletionRequest, flows: list[Flow], rid: str, created: int
) -> dict[str, Any]:
    """The non-streaming response (``text_completion`` or ``chat.completion``)."""
    fmt = LogprobFormatter(tokenizer, req)
    echo = prompt_text(tokenizer, req) if req.echo else ""
    choices: list[dict[str, Any]] = []
    for flow in flows:
        out = flow.outcome
        choice: dict[str, Any] = {"index": flow.index, "finish_reason": out.finish_reason}
        if req.chat:
            choice["message"] = {"role": "assistant", "content": out.text}
            choice["logprobs"] = fmt.chat(out.logprobs) if req.logprobs is not None else None
        else:
            choice["text"] = echo + out.text
            choice["logprobs"] = (
                fmt.completion(out.logprobs, len(echo)) if req.logprobs is not None else None
            )
        if req.return_token_ids:
            choice["token_ids"] = out.tokens
            choice["prompt_token_ids"] = req.prompt_ids
        choices.append(choice)
    body = {
        "id": rid,
        "object": "chat.completion" if req.chat else "text_completion",
        "created": created,
        "model": req.model,
        "choices": choices,
        "usage": usage(req, flows),
        "pdx": flows[0].outcome.pdx,
    }
    model = ChatCompletionResponse if req.chat else CompletionResponse
    return model.model_validate(body).model_dump(mode="json", exclude_none=False)


class SSEResponse(web.StreamResponse):
    """A streamed response whose headers go out with its first events, in one send (aiohttp's
    opt-in: a plain StreamResponse sends them alone at ``prepare``). The response is prepared
    once the first token is at hand, and that token's event is written before anything is
    awaited upstream, so no byte waits longer than before: one syscall fewer per request."""

    _send_headers_immediately = False


class SSEWriter:
    """Writes one request's server-sent events (every choice) with incremental text."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        req: CompletionRequest,
        flows: list[Flow],
        rid: str,
        created: int,
        resp: web.StreamResponse,
    ) -> None:
        self.tokenizer, self.req, self.flows, self.resp = tokenizer, req, flows, resp
        self.rid, self.created = rid, created
        self.obj = "chat.completion.chunk" if req.chat else "text_completion"
        self.sent_text = [""] * len(flows)
        self.sent_events = [0] * len(flows)
        self.fmt = LogprobFormatter(tokenizer, req)
        self.echo = prompt_text(tokenizer, req) if req.echo else ""
        head = {"id": rid, "object": self.obj, "created": created, "model": req.model}
        self._head = b"data: " + orjson.dumps(head)[:-1] + b',"choices":['
        # Events not yet written: held while the next token is already here, so a burst of
        # tokens (one upstream read) costs one send, not one per token. Nothing waits on I/O
        # while held: the buffer is written before the writer next awaits an upstream.
        self._out: list[bytes] = []
        self._queue: asyncio.Queue[Any] | None = None  # several choices: their shared queue

    async def _send(
        self, choice: dict[str, Any] | None, *, hold: bool = False, **extra: Any
    ) -> None:
        # The event is {id, object, created, model, choices[, usage], **extra}; the fields
        # every event repeats are encoded once per stream (self._head), not once per token.
        parts = [self._head, orjson.dumps(choice) if choice is not None else b"", b"]"]
        if self.req.include_usage or "usage" in extra:
            use = extra.pop("usage", self._usage() if self.req.continuous_usage else None)
            parts += [b',"usage":', orjson.dumps(use)]
        for key, value in extra.items():
            parts += [b',"', key.encode(), b'":', orjson.dumps(value)]
        parts.append(b"}\n\n")
        self._out.append(b"".join(parts))
        if not hold and not self._held():
            await self.flush()

    def _held(self) -> bool:
        """Whether the next event is already at hand (written together with this one)."""
        if self._queue is not None:
            return not self._queue.empty()
        flow = self.flows[0]
        return len(self.flows) == 1 and flow.more_ready and not flow.outcome.finish_reason

    async def flush(self, *, eof: bool = False) -> None:
        """Write every held event at once (``eof``: with the chunked terminator, one send)."""
        data = b"".join(self._out)
        self._out.clear()
        if eof:
            await self.resp.write_eof(data)
        elif data:
            await self.resp.write(data)

    def _usage(self) -> dict[str, Any]:
        return usage(self.req, self.flows)

    def _choice(self, flow: Flow, text: str, lps: list[Any], finish: str | None) -> dict[str, Any]:
        i = flow.index
        first = self.sent_events[i] == 0
        self.sent_events[i] += 1
        choice: dict[str, Any] = {"index": i}
        if self.req.chat:
            choice["delta"] = {"role": "assistant", "content": text} if first else {
                "content": text}  # fmt: skip
            choice["logprobs"] = self.fmt.chat(lps) if self.req.logprobs is not None else None
        else:
            if first and self.echo:
                text = self.echo + text
            offset = len(self.echo) + len(self.sent_text[i])
            choice["text"] = text
            choice["logprobs"] = (
                self.fmt.completion(lps, offset) if self.req.logprobs is not None else None
            )
        choice["finish_reason"] = finish
        return choice

    async def token(self, flow: Flow, token: int) -> None:
        """One token of one choice: the text it completes (held back while it may be partial)."""
        out, i = flow.outcome, flow.index
        text = flow.text.sendable(out, final=bool(out.finish_reason))[len(self.sent_text[i]) :]
        self.sent_text[i] += text
        lps = out.logprobs[-1:] if out.logprobs else []
        choice = self._choice(flow, text, lps, None)
        if self.req.return_token_ids:
            choice["token_ids"] = [token]
        await self._send(choice)

    async def finish(self, flow: Flow, *, hold: bool = False) -> None:
        """The last event of one choice: the rest of its text, finish reason, the pdx object
        (``hold``: written with what follows, when nothing upstream is awaited before it)."""
        out, i = flow.outcome, flow.index
        rest = out.text[len(self.sent_text[i]) :]
        self.sent_text[i] = out.text
        await self._send(self._choice(flow, rest, [], out.finish_reason), hold=hold, pdx=out.pdx)

    async def run(self, firsts: list[int | None], events: Sequence[AsyncIterator[int]]) -> None:
        """Every event of the stream, then ``data: [DONE]``; a failure becomes an error event."""
        try:
            if len(self.flows) == 1:
                await self._one(self.flows[0], firsts[0], events[0])
            else:
                await self._many(firsts, events)
            if self.req.include_usage:
                await self._send(None, hold=True, usage=self._usage())
        except HTTPProblem as exc:
            self.error(exc)
        # The held end (last choice's event, usage, [DONE]) and the chunked terminator in
        # one send: each send is a syscall, and at the end nothing upstream is waited for.
        self._out.append(b"data: [DONE]\n\n")
        await self.flush(eof=True)

    async def _one(self, flow: Flow, first: int | None, events: AsyncIterator[int]) -> None:
        if first is not None:
            await self.token(flow, first)
        async for token in events:
            await self.token(flow, token)
        await self.finish(flow, hold=True)

    async def _many(self, firsts: list[int | None], events: Sequence[AsyncIterator[int]]) -> None:
        # Choices generate concurrently; their events are written as they come, one at a time.
        queue: asyncio.Queue[tuple[Flow, int | None, BaseException | None]] = asyncio.Queue()
        self._queue = queue

        async def pump(flow: Flow, first: int | None, it: AsyncIterator[int]) -> None:
            try:
                if first is not None:
                    await queue.put((flow, first, None))
                async for token in it:
                    await queue.put((flow, token, None))
                await queue.put((flow, None, None))
            except BaseException as exc:  # handed to the writer, which raises it
                await queue.put((flow, None, exc))
                raise

        tasks = [asyncio.create_task(pump(f, t, it))
                 for f, t, it in zip(self.flows, firsts, events, strict=True)]  # fmt: skip
        try:
            left = len(tasks)
            while left:
                flow, token, exc = await queue.get()
                if exc is not None:
                    raise exc
                if token is None:
                    await self.finish(flow)
                    left -= 1
                else:
                    await self.token(flow, token)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task

    def error(self, exc: HTTPProblem) -> None:
        """An error after streaming began: one error event, written with the stream's end."""
        self._out.append(f"data: {json.dumps(exc.body())}\n\n".encode())


def created_now() -> int:
    """``created``: Unix seconds."""
    return int(time.time())


__all__ = ["Outcome", "SSEResponse", "SSEWriter", "completion_body", "created_now"]
