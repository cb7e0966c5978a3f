"""Append-only audit log (JSONL): who touched which KV, when, how much, and the outcome.

Every put/get/release/renew/stat, every expiry and eviction, and every rejected call
gets one line. Deletions carry their reason and the object digest, so the
log doubles as the deletion record.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

MAX_FIELD_CHARS = 256  # a field a peer controls (a kv_id, a reason) is cut to this


def bounded(value: Any) -> Any:
    """``value``, with a long string cut (so a peer cannot grow the log by sending one)."""
    if isinstance(value, str) and len(value) > MAX_FIELD_CHARS:
        return value[:MAX_FIELD_CHARS] + f"...(+{len(value) - MAX_FIELD_CHARS} chars)"
    return value


class AuditLog:
    """Appends one JSON object per line; ``path=None`` keeps records in memory only.

    Memory is bounded: the last ``keep_in_memory`` records, each field of them cut to
    :data:`MAX_FIELD_CHARS` characters.
    """

    def __init__(self, path: Path | str | None = None, *, keep_in_memory: int = 10_000) -> None:
        self.path = Path(path) if path is not None else None
        self._keep = keep_in_memory
        self._recent: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._fd: int | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # O_APPEND: each line is one write at the end, even with several writers.
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def record(self, event: str, **fields: Any) -> dict[str, Any]:
        """Write one record: ``event`` (put, get, expire, ...) plus who/kv_id/bytes/outcome."""
        now_ns = time.time_ns()
        rec: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now_ns / 1e9))
            + f".{now_ns // 1_000_000 % 1000:03d}Z",
            "event": event,
            **{k: bounded(v) for k, v in fields.items() if v is not None},
        }
        line = (json.dumps(rec, separators=(",", ":"), default=str) + "\n").encode()
        with self._lock:
            if self._fd is not None:
                os.write(self._fd, line)
            self._recent.append(rec)
            if len(self._recent) > self._keep:
                del self._recent[: len(self._recent) - self._keep]
        return rec

    def records(self, **match: Any) -> list[dict[str, Any]]:
        """Recent records whose fields equal every ``match`` item (for reports and tests)."""
        with self._lock:
            recent = list(self._recent)
        return [r for r in recent if all(r.get(k) == v for k, v in match.items())]

    def close(self) -> None:
        """Close the file (records already written stay)."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def read_audit(path: Path | str) -> list[dict[str, Any]]:
    """Every record of an audit file, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def digest_hex(digest: int) -> str:
    """A 64-bit digest as 16 hex digits, the form the audit log uses."""
    return f"{digest:016x}"
