"""vLLM's two-step P/D protocol over HTTP, and the small reads the gateway polls.

Step 1, prefill: ``POST /v1/completions`` with the prompt's token ids, ``max_tokens: 1`` and
``kv_transfer_params: {"do_remote_decode": true}``; the reply's ``kv_transfer_params`` say
where the prompt's KV blocks wait (``remote_block_ids``, ``remote_engine_id``,
``remote_host``/``remote_port`` of the NIXL side channel, ``remote_num_tokens``, ...).
Step 2, decode: the same prompt with the request's own sampling parameters and those
``kv_transfer_params`` unchanged; decode pulls the blocks (NIXL), recomputes only the last
prompt token and streams every output token. Prefill's one sampled token is not used: the
output is decode's, so greedy output equals a single instance's.

Errors are two exceptions: :class:`EngineUnreachable` (connection refused or reset, a
timeout: the instance may be down) and :class:`EngineHTTPError` (it answered with an error
status, with vLLM's message).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from pdx.errors import ServingError
from pdx.serving.engines.http1 import HTTP1Client, HTTPConnectionError, Origin, origin_of

log = logging.getLogger(__name__)


class EngineUnreachable(ServingError):
    """No answer: connection refused or reset, or the time ran out."""


class EngineHTTPError(ServingError):
    """The engine answered with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


@dataclass(frozen=True)
class PrefillResult:
    """Step 1's answer: where the KV waits, and what it cost."""

    kv_transfer_params: dict[str, Any]
    elapsed_ms: float
    first_token: int | None

    @property
    def remote_tokens(self) -> int:
        """Prompt tokens whose KV prefill offers (``remote_num_tokens``)."""
        return int(self.kv_transfer_params.get("remote_num_tokens") or 0)

    @property
    def remote_blocks(self) -> int:
        """KV blocks prefill holds for decode (every KV cache group counted)."""
        groups = self.kv_transfer_params.get("remote_block_ids") or []
        if groups and isinstance(groups[0], list):
            return sum(len(g) for g in groups)
        return len(groups)

    @property
    def remote_request_id(self) -> str | None:
        """Prefill's own id of the request (names the KV on the prefill side)."""
        rid = self.kv_transfer_params.get("remote_request_id")
        return str(rid) if rid else None


@dataclass
class StreamChunk:
    """One server-sent event of a streamed completion."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    text: str | None = None  # the engine's own detokenized text (None: the event had none)
    more: bool = False  # another event arrived in the same read: it follows without a wait


MAX_EVENT_BYTES = 1 << 20  # one server-sent event line from an engine, at most
# A polled answer (/metrics, /v1/models), at most: vLLM's exposition is ~60 KB; one that says or
# turns out to be larger is not read into memory (an instance pdx did not start may be anything).
MAX_POLL_BYTES = 16 << 20


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def _error_message(text: str) -> str:
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip()[:300] or "(empty body)"
    err = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(err, dict):
        return str(err.get("message") or err)[:300]
    return str(err)[:300]


class EngineClient:
    """HTTP calls to vLLM instances: the two per request (prefill, decode's stream) over
    :class:`~pdx.serving.engines.http1.HTTP1Client`'s pooled connections, the polls (health,
    metrics, models) over one shared aiohttp session."""

    def __init__(
        self, session: aiohttp.ClientSession, model: str, http: HTTP1Client | None = None
    ) -> None:
        self.session = session
        self.model = model
        self.http = http or HTTP1Client()
        self._origins: dict[str, tuple[Origin, str]] = {}

    def _where(self, base_url: str) -> tuple[Origin, str]:
        """The instance's origin and the path prefix its API lives under (usually none)."""
        where = self._origins.get(base_url)
        if where is None:
            where = self._origins[base_url] = origin_of(base_url)
        return where

    async def close(self) -> None:
        """Close the request connections (the aiohttp session is its owner's to close)."""
        await self.http.close()

    def _timeout(self, total_s: float, connect_s: float = 3.0) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total_s, connect=min(connect_s, total_s))

    async def prefill(
        self, base_url: str, prompt_ids: list[int], *, request_id: str, timeout_s: float
    ) -> PrefillResult:
        """Step 1: prefill the prompt for a remote decode; its ``kv_transfer_params``."""
        body = {
            "model": self.model, "prompt": prompt_ids, "max_tokens": 1, "temperature": 0.0,
            # vLLM keeps blocks for a remote decode only when its request ended at max_tokens:
            # an EOS as the one token would free them, so EOS is ignored here.
            "ignore_eos": True, "stream": False, "request_id": request_id,
            "kv_transfer_params": {"do_remote_decode": True}, "return_token_ids": True,
        }  # fmt: skip
        t0 = time.perf_counter()
        data = await self._post_json(base_url + "/v1/completions", body, timeout_s)
        elapsed_ms = (time.perf_counter() - t0) * 1e3
        params = data.get("kv_transfer_params")
        if not isinstance(params, dict) or not params.get("remote_block_ids"):
            raise EngineHTTPError(200, "prefill answered without kv_transfer_params")
        ids = ((data.get("choices") or [{}])[0] or {}).get("token_ids") or []
        return PrefillResult(params, elapsed_ms, int(ids[0]) if ids else None)

    async def _post_json(self, url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        base, _, path = url.rpartition("/v1/")
        origin, prefix = self._where(base)
        try:
            async with self.http.post(
                origin, f"{prefix}/v1/{path}", orjson.dumps(body), timeout_s=timeout_s,
                connect_timeout_s=min(3.0, timeout_s),
            ) as r:  # fmt: skip
                raw = await r.read()
                if r.status != 200:
                    raise EngineHTTPError(r.status, _error_message(_text(raw)))
        except (HTTPConnectionError, TimeoutError) as exc:
            raise EngineUnreachable(f"{url}: {type(exc).__name__}: {exc}") from None
        try:
            data: dict[str, Any] = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise EngineHTTPError(200, f"not JSON: {_text(raw)[:200]}") from None
        return data

    async def stream(
        self, base_url: str, body: dict[str, Any], *, timeout_s: float
    ) -> AsyncGenerator[StreamChunk, None]:
        """Step 2 (or a plain request): ``POST /v1/completions`` streamed, chunk by chunk.

        Raises before the first chunk on an error status; a stream cut later raises
        EngineUnreachable. Closing the iterator closes the connection, which aborts the
        request inside vLLM.
        """
        url = base_url + "/v1/completions"
        body = {**body, "model": self.model, "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        origin, prefix = self._where(base_url)
        try:
            async with self.http.post(
                origin, prefix + "/v1/completions", orjson.dumps(body),
                timeout_s=timeout_s, connect_timeout_s=min(3.0, timeout_s),
            ) as r:  # fmt: skip
                if r.status != 200:
                    raise EngineHTTPError(
                        r.status, _error_message(_text(await r.read(MAX_EVENT_BYTES)))
                    )
                done, rest = False, b""
                try:
                    # Whatever arrived, split into lines here: one wake-up per read, not per
                    # line (every event is a data line and a blank one).
                    async for data in r.iter_any():
                        lines = (rest + data).split(b"\n")
                        rest = lines.pop()
                        if len(rest) > MAX_EVENT_BYTES:
                            raise EngineHTTPError(502, f"an event over {MAX_EVENT_BYTES} bytes")
                        events = [line for line in lines if len(line) >= 6]  # not blank lines
                        for k, line in enumerate(events):  # ("data:x" is 6)
                            chunk = _parse_event(line)
                            if chunk is _DONE:
                                done = True
                                return
                            if chunk is not None:
                                chunk.more = k < len(events) - 1
                                yield chunk
                    last = _parse_event(rest) if rest else None  # no newline after it
                    done = last is _DONE
                    if last is not None and not done:
                        yield last
                finally:
                    if not done:  # left early (client gone, stop string): abort it in vLLM
                        r.close()
        except (HTTPConnectionError, TimeoutError) as exc:
            raise EngineUnreachable(f"{url}: {type(exc).__name__}: {exc}") from None

    async def healthy(self, base_url: str, timeout_s: float = 1.0) -> bool:
        """``GET /health`` answers 200."""
        try:
            async with self.session.get(
                base_url + "/health", timeout=self._timeout(timeout_s)
            ) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def metrics_text(self, base_url: str, timeout_s: float = 2.0) -> str | None:
        """The instance's Prometheus text, or None when it does not answer (or answers more
        than MAX_POLL_BYTES)."""
        try:
            async with self.session.get(
                base_url + "/metrics", timeout=self._timeout(timeout_s)
            ) as r:
                raw = await _capped_body(r, base_url + "/metrics") if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError):
            return None
        return None if raw is None else raw.decode("utf-8", errors="replace")

    async def served_models(self, base_url: str, timeout_s: float = 3.0) -> list[str]:
        """Model ids from ``GET /v1/models`` (empty when it does not answer)."""
        try:
            async with self.session.get(
                base_url + "/v1/models", timeout=self._timeout(timeout_s)
            ) as r:
                raw = await _capped_body(r, base_url + "/v1/models") if r.status == 200 else None
            data = orjson.loads(raw) if raw else {}
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return []
        if not isinstance(data, dict) or not isinstance(data.get("data"), list):
            return []
        return [str(m["id"]) for m in data["data"] if isinstance(m, dict) and m.get("id")]


_OVERSIZED: set[str] = set()  # URLs already logged as answering too much (one line each)


async def _capped_body(r: aiohttp.ClientResponse, url: str) -> bytes | None:
    """A polled answer's body, or None (logged once per URL) past MAX_POLL_BYTES: checked
    against its Content-Length before reading and against what arrived while reading."""
    parts: list[bytes] = []
    size = 0
    if r.content_length is None or r.content_length <= MAX_POLL_BYTES:
        async for piece in r.content.iter_any():
            size += len(piece)
            if size > MAX_POLL_BYTES:
                break
            parts.append(piece)
        else:
            return b"".join(parts)
    if url not in _OVERSIZED:
        _OVERSIZED.add(url)
        log.warning("%s answered more than %d bytes: not read (polled answers are capped)",
                    url, MAX_POLL_BYTES)  # fmt: skip
    return None


_DONE = StreamChunk()


def _parse_event(raw: bytes) -> StreamChunk | None:
    """One SSE line: a chunk, ``_DONE`` for ``[DONE]``, None for blank/comment lines."""
    line = raw.strip()
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return _DONE
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:  # also invalid UTF-8: read it as the stdlib would
        try:
            data = json.loads(payload.decode("utf-8", errors="replace"))
        except ValueError:
            return None
    if isinstance(data, dict) and "error" in data and "choices" not in data:
        raise EngineHTTPError(500, _error_message(payload.decode("utf-8", errors="replace")))
    out = StreamChunk(usage=data.get("usage"))
    for choice in data.get("choices") or []:
        out.token_ids += [int(t) for t in choice.get("token_ids") or []]
        if isinstance(text := choice.get("text"), str):
            out.text = (out.text or "") + text
        out.finish_reason = choice.get("finish_reason") or out.finish_reason
        if choice.get("logprobs"):
            out.logprobs = choice["logprobs"]
    return out


def sampling_body(req: Any, seed: int) -> dict[str, Any]:
    """The request's sampling parameters in vLLM's names (a CompletionRequest, duck-typed)."""
    body: dict[str, Any] = {
        "max_tokens": req.max_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "top_k": req.top_k if req.top_k > 0 else -1, "min_p": req.min_p,
        "frequency_penalty": req.frequency_penalty, "presence_penalty": req.presence_penalty,
        "repetition_penalty": req.repetition_penalty, "min_tokens": req.min_tokens,
        "ignore_eos": req.ignore_eos, "seed": seed % 2**63,
    }  # fmt: skip
    if req.stop:
        body["stop"] = list(req.stop)
    if req.logit_bias:
        body["logit_bias"] = {str(k): v for k, v in req.logit_bias.items()}
    if req.logprobs is not None:
        body["logprobs"] = req.logprobs
        body["return_tokens_as_token_ids"] = True  # alternatives named by id, not text
    if req.cache_salt:
        body["cache_salt"] = req.cache_salt
    return body


def token_logprobs(lp: dict[str, Any]) -> list[tuple[int, float, list[int], list[float]]]:
    """vLLM's completion ``logprobs`` (tokens as ``token_id:N``) → (id, lp, top ids, top lps)."""
    out = []
    tokens = lp.get("tokens") or []
    values = lp.get("token_logprobs") or []
    tops = lp.get("top_logprobs") or []
    for i, tok in enumerate(tokens):
        top = tops[i] if i < len(tops) and tops[i] else {}
        ranked = sorted(top.items(), key=lambda kv: -float(kv[1]))
        out.append((
            _token_id(tok), float(values[i]) if i < len(values) and values[i] is not None else 0.0,
            [_token_id(t) for t, _ in ranked], [float(v) for _, v in ranked],
        ))  # fmt: skip
    return out


def _token_id(tok: str) -> int:
    return int(str(tok).rsplit(":", 1)[-1]) if ":" in str(tok) else -1
