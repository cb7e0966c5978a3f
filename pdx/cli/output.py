"""The one output sink: rich on a terminal, JSON for scripts, no colour when not a TTY.

Commands build data (dataclasses, pydantic models, dicts) and hand it here with a
renderer; logic never prints.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from rich.console import Console

_stdout: Console | None = None
_stderr: Console | None = None


def console() -> Console:
    """Console for results (stdout)."""
    global _stdout
    if _stdout is None or _stdout.file is not sys.stdout:
        # Not a terminal (a pipe, a log, CI): wide enough that tables are not cut to 80 columns.
        width = None if sys.stdout.isatty() else 160
        _stdout = Console(file=sys.stdout, highlight=False, soft_wrap=False, width=width)
    return _stdout


def err_console() -> Console:
    """Console for progress and errors (stderr), so stdout stays clean for ``--json``."""
    global _stderr
    if _stderr is None or _stderr.file is not sys.stderr:
        _stderr = Console(file=sys.stderr, highlight=False)
    return _stderr


def to_jsonable(obj: Any) -> Any:
    """Convert dataclasses, pydantic models, enums, paths and NaN/inf into plain JSON types."""
    if isinstance(obj, BaseModel):
        return to_jsonable(obj.model_dump(mode="python"))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple | set | frozenset):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars
        return to_jsonable(obj.item())
    return obj


def dumps(data: Any) -> str:
    """The JSON text ``--json`` prints."""
    return json.dumps(to_jsonable(data), indent=2, allow_nan=False)


def emit(data: Any, *, as_json: bool, render: Callable[[Console, Any], None]) -> None:
    """Print ``data`` as one JSON document, or render it for a human."""
    if as_json:
        sys.stdout.write(dumps(data) + "\n")
        sys.stdout.flush()
    else:
        render(console(), data)
