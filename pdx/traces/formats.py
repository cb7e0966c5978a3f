"""Reading request traces: Mooncake JSONL, BurstGPT CSV and pdx's own JSONL, one loader.

Every format becomes the same :class:`Trace`: requests sorted by arrival, each with its line in
the file, arrival time (seconds from the trace's first request), input and output lengths, the
hash ids of its prompt's blocks (where the format has them: requests sharing their first k ids
share their first k blocks of tokens) and a session key (where the format has one).

- ``mooncake``: ``{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}``, one
  per line (the FAST'25 traces), blocks of 512 tokens unless told otherwise;
- ``burstgpt``: the BurstGPT CSV (``Timestamp`` in s, ``Request tokens``, ``Response tokens``,
  other columns ignored); no reuse information, so every prompt is its own;
- ``pdx``: ``{"arrival_s", "prompt_tokens", "output_tokens"}`` (what ``pdx simulate --workload``
  has read), with optional ``session`` and ``hash_ids`` (and ``block_size`` on any line).

Every bad line is named by its number and field (the first :data:`MAX_PROBLEMS`). Plain code
over the standard library and orjson: the Locust process imports this module too.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson

from pdx.errors import ConfigError, InputError

Format = Literal["mooncake", "burstgpt", "pdx"]
FORMATS: tuple[str, ...] = ("mooncake", "burstgpt", "pdx")
MOONCAKE_BLOCK = 512
MAX_PROBLEMS = 10


@dataclass(slots=True)
class TraceRequest:
    """One request of a trace."""

    line: int  # in the file, from 1
    arrival_s: float  # from the trace's first request
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()  # one per block of the prompt (empty: no reuse known)
    session: str | None = None


@dataclass
class Trace:
    """A trace's requests sorted by arrival, with the block size its hash ids count in."""

    requests: list[TraceRequest]
    block_size: int
    format: str
    source: str
    notes: list[str] = field(default_factory=list)

    @property
    def duration_s(self) -> float:
        """First to last arrival."""
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0

    @property
    def has_reuse(self) -> bool:
        """Whether the trace says which prompts share blocks."""
        return any(r.hash_ids for r in self.requests)


def read_trace(
    path: Path | str, fmt: str = "auto", *, block_size: int | None = None, field_name: str = "trace"
) -> Trace:
    """Read a trace file (``fmt`` auto: from the extension, else the first line)."""
    p = Path(path)
    if not p.is_file():
        raise InputError(
            field_name, str(p), "an existing JSONL trace (Mooncake or pdx) or BurstGPT CSV file"
        )
    if fmt == "auto":
        fmt = detect_format(p)
    if fmt not in FORMATS:
        raise InputError("format", fmt, f"one of auto, {', '.join(FORMATS)}")
    if block_size is not None and block_size <= 0:
        raise InputError("block_size", block_size, "a positive number of tokens")
    problems: list[str] = []
    if fmt == "burstgpt":
        rows = list(_burstgpt(p, problems))
        size = block_size or MOONCAKE_BLOCK
    else:
        rows, found_size = _jsonl(p, fmt, problems)
        size = block_size or found_size or MOONCAKE_BLOCK
    if problems:
        raise ConfigError(str(p), problems[:MAX_PROBLEMS])
    if not rows:
        raise ConfigError(str(p), ["the trace holds no requests"])
    rows.sort(key=lambda r: (r.arrival_s, r.line))
    trace = Trace(rows, size, fmt, p.name)
    _check_blocks(trace, problems)
    if problems:
        raise ConfigError(str(p), problems[:MAX_PROBLEMS])
    return trace


def detect_format(path: Path) -> str:
    """``burstgpt`` for a .csv, else by the keys of the first JSON line."""
    if path.suffix.lower() == ".csv":
        return "burstgpt"
    with path.open("rb") as fh:
        for raw in fh:
            if raw.strip():
                try:
                    first = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    break
                if isinstance(first, dict) and "input_length" in first:
                    return "mooncake"
                if isinstance(first, dict) and "prompt_tokens" in first:
                    return "pdx"
                break
    raise InputError("format", "auto", "mooncake, burstgpt or pdx (the file's form is not one "
                     "of them: say which with --format)")  # fmt: skip


def _jsonl(path: Path, fmt: str, problems: list[str]) -> tuple[list[TraceRequest], int | None]:
    keys = (
        ("timestamp", "input_length", "output_length")
        if fmt == "mooncake"
        else ("arrival_s", "prompt_tokens", "output_tokens")
    )
    scale = 1e-3 if fmt == "mooncake" else 1.0
    rows: list[TraceRequest] = []
    size: int | None = None
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                rec = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                problems.append(f"line {lineno}: not JSON ({exc})")
                if len(problems) >= MAX_PROBLEMS:
                    break
                continue
            req = _request(rec, lineno, keys, scale, problems)
            if req is not None:
                rows.append(req)
                if fmt == "pdx" and "block_size" in rec:
                    size = _int_field(rec, "block_size", lineno, problems, low=1) or size
            if len(problems) >= MAX_PROBLEMS:
                break
    return rows, size


def _request(
    rec: Any, lineno: int, keys: tuple[str, str, str], scale: float, problems: list[str]
) -> TraceRequest | None:
    if not isinstance(rec, dict):
        problems.append(f"line {lineno}: expected a JSON object, got {type(rec).__name__}")
        return None
    t_key, in_key, out_key = keys
    t = rec.get(t_key)
    if t_key not in rec:
        problems.append(f"line {lineno}: {t_key}: Field required")
    elif isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
        problems.append(f"line {lineno}: {t_key}: got {t!r}, expected a number >= 0")
        t = None
    n_in = _int_field(rec, in_key, lineno, problems, low=1)
    n_out = _int_field(rec, out_key, lineno, problems, low=1)
    ids = rec.get("hash_ids", [])
    if not isinstance(ids, list) or not all(type(h) is int for h in ids):
        problems.append(f"line {lineno}: hash_ids: expected a list of integers")
        ids = []
    session = rec.get("session")
    if session is not None and not isinstance(session, str | int):
        problems.append(f"line {lineno}: session: got {session!r}, expected a string")
        session = None
    if t is None or n_in is None or n_out is None:
        return None
    return TraceRequest(lineno, float(t) * scale, n_in, n_out, tuple(ids),
                        None if session is None else str(session))  # fmt: skip


def _int_field(
    rec: dict[str, Any], key: str, lineno: int, problems: list[str], *, low: int
) -> int | None:
    if key not in rec:
        problems.append(f"line {lineno}: {key}: Field required")
        return None
    value = rec[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        problems.append(f"line {lineno}: {key}: got {value!r}, expected an integer >= {low}")
        return None
    return value


BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")


def _burstgpt(path: Path, problems: list[str]) -> Iterator[TraceRequest]:
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in BURSTGPT_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            problems.append(f"line 1: missing column(s) {', '.join(missing)} "
                            f"(BurstGPT's are {', '.join(BURSTGPT_COLUMNS)}, ...)")  # fmt: skip
            return
        for lineno, row in enumerate(reader, start=2):
            try:
                t = float(row["Timestamp"])
                if not math.isfinite(t) or t < 0:
                    raise ValueError
            except (TypeError, ValueError):
                problems.append(
                    f"line {lineno}: Timestamp: got {row['Timestamp']!r}, expected a number >= 0"
                )
                t = -1.0
            n = [_csv_int(row, c, lineno, problems) for c in BURSTGPT_COLUMNS[1:]]
            if len(problems) >= MAX_PROBLEMS:
                return
            if t >= 0 and n[0] and n[1]:
                yield TraceRequest(lineno, t, n[0], n[1])
            # BurstGPT logs failed requests with 0 response tokens: they are not load to replay


def _csv_int(row: dict[str, str], col: str, lineno: int, problems: list[str]) -> int | None:
    try:
        value = int(row[col])
    except (TypeError, ValueError):
        problems.append(f"line {lineno}: {col}: got {row[col]!r}, expected an integer")
        return None
    if value < 0:
        problems.append(f"line {lineno}: {col}: got {value}, expected an integer >= 0")
        return None
    return value or None


def _check_blocks(trace: Trace, problems: list[str]) -> None:
    """Hash ids, where given, are one per block of the prompt (the last one partial)."""
    for r in trace.requests:
        if r.hash_ids and len(r.hash_ids) != math.ceil(r.input_tokens / trace.block_size):
            problems.append(
                f"line {r.line}: hash_ids: got {len(r.hash_ids)} ids for input of "
                f"{r.input_tokens} tokens, expected {math.ceil(r.input_tokens / trace.block_size)}"
                f" (blocks of {trace.block_size} tokens; set block_size if the trace uses others)"
            )
            if len(problems) >= MAX_PROBLEMS:
                return
