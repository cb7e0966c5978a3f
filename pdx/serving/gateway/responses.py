"""OpenAI response bodies: a whole completion, or its server-sent events."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from pdx.serving.backends.tokenizer import Tokenizer
from pdx.serving.gateway.flow import Flow, Outcome
from pdx.serving.gateway.protocol import CompletionRequest, HTTPProblem, usage


def completion_body(
    tokenizer: Tokenizer, req: CompletionRequest, flow: Flow, out: Outcome, obj: str
) -> dict[str, Any]:
    """The non-streaming response of ``obj`` kind (``text_completion`` or ``chat.completion``)."""
    text = tokenizer.decode(out.tokens)
    choice: dict[str, Any] = {"index": 0, "finish_reason": out.finish_reason, "logprobs": None}
    if obj == "chat.completion":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    if req.return_token_ids:
        choice["token_ids"] = out.tokens
        choice["prompt_token_ids"] = req.prompt_ids
    return {
        "id": flow.id,
        "object": obj,
        "created": int(time.time()),
        "model": req.model,
        "choices": [choice],
        "usage": usage(req, len(out.tokens)),
        "pdx": out.pdx,
    }


class SSEWriter:
    """Writes one request's server-sent events with incremental text."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        req: CompletionRequest,
        flow: Flow,
        obj: str,
        resp: web.StreamResponse,
    ) -> None:
        self.tokenizer, self.req, self.flow, self.resp = tokenizer, req, flow, resp
        self.obj = "chat.completion.chunk" if obj == "chat.completion" else obj
        self.chat = obj == "chat.completion"
        self.sent_text = ""

    async def _send(self, choice: dict[str, Any], **extra: Any) -> None:
        chunk = {
            "id": self.flow.id,
            "object": self.obj,
            "created": int(time.time()),
            "model": self.req.model,
            "choices": [choice],
            **extra,
        }
        await self.resp.write(f"data: {json.dumps(chunk)}\n\n".encode())

    def _delta(self, text: str) -> dict[str, Any]:
        return {"delta": {"content": text}} if self.chat else {"text": text}

    async def tokens(self, token: int) -> None:
        """One token: the text it completes (held back while a UTF-8 character is partial)."""
        full = self.tokenizer.decode(self.flow.outcome.tokens)
        text = "" if full.endswith("\ufffd") else full[len(self.sent_text) :]
        self.sent_text += text
        choice: dict[str, Any] = {"index": 0, **self._delta(text), "finish_reason": None}
        if self.req.return_token_ids:
            choice["token_ids"] = [token]
        await self._send(choice)

    async def finish(self) -> None:
        """The last event: finish reason, usage and the pdx object."""
        out = self.flow.outcome
        rest = self.tokenizer.decode(out.tokens)[len(self.sent_text) :]
        choice = {"index": 0, **self._delta(rest), "finish_reason": out.finish_reason}
        await self._send(choice, usage=usage(self.req, len(out.tokens)), pdx=out.pdx)

    async def run(self, first: int | None, events: AsyncIterator[int]) -> None:
        """Every event of the stream, then ``data: [DONE]``; a failure becomes an error event."""
        try:
            if first is not None:
                await self.tokens(first)
            async for token in events:
                await self.tokens(token)
            await self.finish()
        except HTTPProblem as exc:
            await self.error(exc)
        await self.resp.write(b"data: [DONE]\n\n")
        await self.resp.write_eof()

    async def error(self, exc: HTTPProblem) -> None:
        """An error after streaming began: one error event (the stream then ends)."""
        body = {"error": {"message": exc.message, "type": exc.kind, "code": exc.status}}
        await self.resp.write(f"data: {json.dumps(body)}\n\n".encode())
