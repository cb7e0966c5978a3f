"""Streaming OpenAI-compatible completions, timed per token; no locust or gevent imports here.

The locustfile drives these functions; tests import them directly. Definitions (stated in every
pdx report too):

- TTFT = time of the first SSE event carrying content − intended send time (a stream with no
  content at all, e.g. a first token that is EOS, is a success with 0 content events: its TTFT
  is the first event carrying a choice)
- E2E  = time the stream ended (``data: [DONE]``) − intended send time
- TPOT = (E2E − TTFT) / (output tokens − 1), output tokens from the server's ``usage``
- ITL  = gap between consecutive content-carrying SSE events (one value per gap)
- queue = actual send time − intended send time (non-zero only in open loop, when the
  client had to wait for an in-flight slot; keeping it in TTFT/E2E avoids coordinated omission)
- elapsed = time the client stopped waiting (answer, error, its own abort, or the end of the
  step) − intended send time; it is what an overdue check compares with the deadline
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class LengthSpec:
    """A token count: fixed (``128``) or uniform in an inclusive range (``64:256``)."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> LengthSpec:
        """Parse ``N`` or ``LOW:HIGH``; raise ValueError with the expected form."""
        low_s, sep, high_s = str(text).partition(":")
        try:
            low = int(low_s)
            high = int(high_s) if sep else low
        except ValueError:
            raise ValueError(f"length {text!r}: expected N or LOW:HIGH (integers)") from None
        if low < 1 or high < low:
            raise ValueError(f"length {text!r}: expected 1 <= LOW <= HIGH")
        return cls(low, high)

    def sample(self, rng: random.Random) -> int:
        """Draw one length."""
        return self.low if self.low == self.high else rng.randint(self.low, self.high)


@dataclass
class PromptSample:
    """One request's prompt (token ids or text) and requested output length."""

    prompt: list[int] | str
    input_len: int
    output_len: int


def load_lengths_file(path: str | Path) -> list[dict[str, Any]]:
    """Rows from a JSONL file (``{"input_len": N, "output_len": M}`` or ``{"prompt": ...}``)
    or a CSV-like file of ``input_len,output_len`` lines."""
    rows: list[dict[str, Any]] = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("{"):
            row = json.loads(line)
        else:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != 2 or not all(p.isascii() and p.isdigit() for p in parts):
                raise ValueError(f"{path}:{lineno}: expected 'input_len,output_len' or JSON")
            row = {"input_len": int(parts[0]), "output_len": int(parts[1])}
        if "output_len" not in row and "max_tokens" not in row:
            raise ValueError(f"{path}:{lineno}: missing output_len")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


class PromptSource:
    """Draws prompts: token-id lists (exact lengths) or filler text (approximate)."""

    def __init__(
        self,
        input_len: LengthSpec,
        output_len: LengthSpec,
        *,
        kind: str = "ids",
        token_id_max: int = 250,
        rows: list[dict[str, Any]] | None = None,
        seed: int | None = None,
    ) -> None:
        self.input_len = input_len
        self.output_len = output_len
        self.kind = kind
        self.token_id_max = token_id_max
        self.rows = rows
        self.rng = random.Random(seed)

    def _prompt(self, n: int) -> list[int] | str:
        if self.kind == "text":
            return " ".join(self.rng.choice(("alpha", "beta", "gamma", "delta")) for _ in range(n))
        return [self.rng.randint(1, self.token_id_max) for _ in range(n)]

    def next(self) -> PromptSample:
        """The next request's prompt and output length."""
        if self.rows:
            row = self.rng.choice(self.rows)
            out = int(row.get("output_len", row.get("max_tokens", 1)))
            if "prompt" in row:
                prompt = row["prompt"]
                n = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
                return PromptSample(prompt, n, out)
            n = int(row["input_len"])
            return PromptSample(self._prompt(n), n, out)
        n = self.input_len.sample(self.rng)
        return PromptSample(self._prompt(n), n, self.output_len.sample(self.rng))


@dataclass
class RequestRecord:
    """Everything measured about one streamed request (one JSONL line)."""

    t_intended_s: float
    mode: str
    input_len: int
    output_len_requested: int
    ok: bool = False
    error: str | None = None
    http_status: int | None = None
    queue_ms: float = 0.0
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    tpot_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    output_tokens: int | None = None
    prompt_tokens: int | None = None
    usage_source: str | None = None
    content_events: int = 0
    pdx: dict[str, Any] | None = None
    worker_pid: int = field(default_factory=os.getpid)
    elapsed_ms: float | None = None
    response_id: str | None = None
    aborted: bool = False  # the client cancelled it after the first token (by design)
    unfinished: bool = False  # still waiting when the load stopped
    output_ids: list[int] | None = None  # token ids the server streamed (return_token_ids)
    prompt_ids: list[int] | None = None  # kept for a sample of requests (output replay)
    # a replayed trace: the request's line, its session, the prefix an ideal cache would
    # hold for it (tokens), and the cached prompt tokens the server reported
    # (usage.prompt_tokens_details.cached_tokens where it does, else pdx.cached_tokens)
    trace_line: int | None = None
    session: str | None = None
    ideal_cached_tokens: int | None = None
    cached_tokens: int | None = None

    def to_json(self) -> str:
        """One JSONL line."""
        return json.dumps(asdict(self), separators=(",", ":"))


def _field_value(line: str) -> str:
    value = line[5:]
    return value[1:] if value.startswith(" ") else value


def sse_events(chunks: Iterable[bytes]) -> Iterator[str]:
    """Yield the ``data`` payload of each server-sent event as bytes arrive (WHATWG SSE framing)."""
    buf = b""
    data_lines: list[str] = []
    for chunk in chunks:
        buf += chunk
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                break
            line = buf[:nl].rstrip(b"\r").decode("utf-8", errors="replace")
            buf = buf[nl + 1 :]
            if not line:
                if data_lines:
                    yield "\n".join(data_lines)
                    data_lines = []
            elif line.startswith("data:"):
                data_lines.append(_field_value(line))
    tail = buf.decode("utf-8", errors="replace").rstrip("\r")
    if tail.startswith("data:"):
        data_lines.append(_field_value(tail))
    if data_lines:
        yield "\n".join(data_lines)


def _token_ids(event: dict[str, Any]) -> list[int]:
    return [int(t) for c in event.get("choices") or [] for t in c.get("token_ids") or []]


def event_content(event: dict[str, Any]) -> bool:
    """Whether a completion/chat chunk carries generated content (text or token ids)."""
    for choice in event.get("choices") or []:
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
        if choice.get("token_ids"):
            return True
    return False


def finish_record(
    rec: RequestRecord,
    t0: float,
    content_times: list[float],
    t_end: float,
    first_choice: float | None = None,
) -> None:
    """Derive TTFT, E2E, ITL and TPOT from the event times (perf_counter seconds, t0 = intended).

    ``first_choice``: when the first event carrying a choice arrived (TTFT of a stream that
    carried no content).
    """
    rec.e2e_ms = (t_end - t0) * 1e3
    if content_times:
        rec.ttft_ms = (content_times[0] - t0) * 1e3
        rec.itl_ms = [(b - a) * 1e3 for a, b in itertools.pairwise(content_times)]
    elif first_choice is not None:
        rec.ttft_ms = (first_choice - t0) * 1e3
    rec.content_events = len(content_times)
    if rec.output_tokens is None:
        rec.output_tokens = len(content_times)
        rec.usage_source = "chunks"
    if content_times and rec.ttft_ms is not None and rec.output_tokens and rec.output_tokens > 1:
        rec.tpot_ms = (rec.e2e_ms - rec.ttft_ms) / (rec.output_tokens - 1)


def build_body(sample: PromptSample, model: str | None, extra: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI ``/v1/completions`` body for one streamed request."""
    body: dict[str, Any] = {
        "prompt": sample.prompt,
        "max_tokens": sample.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    if model:
        body["model"] = model
    body.update(extra)
    return body


def _absorb(rec: RequestRecord, event: dict[str, Any]) -> None:
    usage = event.get("usage")
    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
        rec.output_tokens = int(usage["completion_tokens"])
        rec.prompt_tokens = usage.get("prompt_tokens")
        rec.usage_source = "server"
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            rec.cached_tokens = int(details["cached_tokens"])
    if isinstance(event.get("pdx"), dict):
        rec.pdx = event["pdx"]
        cached = rec.pdx.get("cached_tokens")  # pdx's engine: decode's own prefix-cache hit
        if rec.cached_tokens is None and isinstance(cached, int):
            rec.cached_tokens = cached
    if rec.response_id is None and isinstance(event.get("id"), str):
        rec.response_id = event["id"]
    ids = _token_ids(event)
    if ids:
        rec.output_ids = (rec.output_ids or []) + ids
    if event.get("error"):
        err = event["error"]
        rec.error = str(err.get("message", err) if isinstance(err, dict) else err)[:300]


def stream_completion(
    session: Any,
    url: str,
    body: dict[str, Any],
    rec: RequestRecord,
    t_intended: float,
    timeout_s: float,
    *,
    abort_after_first: bool = False,
) -> RequestRecord:
    """POST one streaming request with a ``requests``-like session and time every event.

    ``t_intended`` is a ``time.perf_counter()`` stamp; all latencies are measured from it.
    ``abort_after_first``: close the stream as soon as the first content event arrives (a client
    that gives up mid-stream); the record is ``aborted`` with its TTFT, neither ok nor failed.
    """
    rec.queue_ms = (time.perf_counter() - t_intended) * 1e3
    try:
        return _stream(session, url, body, rec, t_intended, timeout_s, abort_after_first)
    finally:
        rec.elapsed_ms = (time.perf_counter() - t_intended) * 1e3


def _stream(
    session: Any,
    url: str,
    body: dict[str, Any],
    rec: RequestRecord,
    t_intended: float,
    timeout_s: float,
    abort_after_first: bool,
) -> RequestRecord:
    content_times: list[float] = []
    first_choice: float | None = None
    done = False
    t_end = 0.0
    try:
        with session.post(url, json=body, stream=True, timeout=timeout_s) as resp:
            rec.http_status = resp.status_code
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                return rec
            for data in sse_events(resp.iter_content(chunk_size=None)):
                now = time.perf_counter()
                if data.strip() == "[DONE]":
                    done, t_end = True, now
                    break
                event = json.loads(data)
                _absorb(rec, event)
                if first_choice is None and event.get("choices"):
                    first_choice = now
                if event_content(event):
                    content_times.append(now)
                    if abort_after_first and rec.error is None:
                        rec.aborted = True
                        rec.ttft_ms = (now - t_intended) * 1e3
                        resp.close()  # the connection goes away mid-stream, as a leaving client's
                        return rec
    except Exception as exc:  # any transport/protocol failure is a failed request, with its cause
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
        return rec
    if rec.error is None and not done:
        rec.error = "stream ended without data: [DONE]"
    if rec.error is None and first_choice is None:
        rec.error = "the stream carried no choice"
    if rec.error is not None:
        return rec
    finish_record(rec, t_intended, content_times, t_end, first_choice)
    rec.ok = True
    return rec
