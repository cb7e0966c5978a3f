"""Loading validated configuration: YAML < environment < command line, built once at the edge.

Each capability defines its own pydantic model; this module turns YAML files and
``--set``-style overrides into that model and turns validation failures into a
:class:`~pdx.errors.ConfigError` with one line per problem (path, value, reason).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from pdx.errors import ConfigError, InputError

M = TypeVar("M", bound=BaseModel)


def error_path(loc: tuple[int | str, ...]) -> str:
    """Render a pydantic error location as ``matrix.concurrency[2]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(root)"


def validation_problems(exc: ValidationError) -> list[str]:
    """One line per problem: ``path: message (got value)``."""
    lines = []
    for err in exc.errors():
        path = error_path(tuple(err["loc"]))
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        got = err.get("input")
        suffix = "" if isinstance(got, dict | list) or got is None else f" (got {got!r})"
        lines.append(f"{path}: {msg}{suffix}")
    return lines


def read_yaml(path: Path | str) -> dict[str, Any]:
    """Read a YAML mapping, with clear errors for a missing file or bad syntax."""
    p = Path(path)
    if not p.is_file():
        raise InputError("config", str(p), "an existing YAML file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(str(p), [f"YAML syntax error{where}: {exc}"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(str(p), [f"(root): expected a mapping, got {type(data).__name__}"])
    return data


def yaml_value(field: str, text: str) -> Any:
    """One plain YAML value (number, bool, list, ...); a tag or a syntax error is an InputError.

    ``safe_load`` already refuses ``!!python/object``; this turns its exception into the one-line
    error every CLI prints, instead of a traceback.
    """
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        reason = str(getattr(exc, "problem", None) or "not valid YAML").strip()
        raise InputError(field, text, f"a plain YAML value ({reason})") from None


def _dotted_parts(dotted: str) -> list[str | int]:
    parts: list[str | int] = []
    for piece in dotted.split("."):
        name, _, rest = piece.partition("[")
        if name:
            parts.append(name)
        elif not rest:
            raise InputError("--set", dotted, "a dotted path such as kv.streams or a.b[0].c")
        while rest:
            idx, sep, rest = rest.partition("]")
            if not sep or not (idx.strip().isascii() and idx.strip().isdigit()):
                raise InputError("--set", dotted, "list indexes as [N] with N a whole number")
            parts.append(int(idx))
            rest = rest.lstrip("[")
    if not parts:
        raise InputError("--set", dotted, "a dotted path such as kv.streams")
    return parts


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``a.b[2].c`` style paths in nested dicts/lists, creating dicts as needed."""
    parts = _dotted_parts(dotted)
    node: Any = data
    try:
        for key, nxt in itertools.pairwise(parts):
            if isinstance(key, int):
                node = node[key]
            else:
                if key not in node or node[key] is None:
                    node[key] = [] if isinstance(nxt, int) else {}
                node = node[key]
        node[parts[-1]] = value
    except (IndexError, KeyError, TypeError):
        raise InputError("--set", dotted, "a path that exists in the configuration") from None


def parse_override(text: str) -> tuple[str, Any]:
    """Parse ``key.path=value`` where value is YAML (so numbers, lists, bools work)."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise InputError("--set", text, "key.path=value")
    return key.strip(), yaml_value(f"--set {key.strip()}", raw)


def env_overrides(prefix: str) -> dict[str, Any]:
    """``PDX_SIM_LINK_BYTES_PER_S=2e10`` → ``{"link_bytes_per_s": 2e10}`` (prefix ``PDX_SIM_``)."""
    out: dict[str, Any] = {}
    for name, raw in os.environ.items():
        if name.startswith(prefix):
            out[name[len(prefix) :].lower()] = yaml_value(name, raw)
    return out


def build_config(
    model: type[M],
    *,
    source: str,
    base: dict[str, Any] | None = None,
    overrides: dict[str, Any] | None = None,
    dotted: list[str] | None = None,
) -> M:
    """Validate ``base`` (from YAML) updated by ``overrides`` and ``--set`` paths into ``model``."""
    data: dict[str, Any] = dict(base or {})
    for k, v in (overrides or {}).items():
        if v is not None:
            data[k] = v
    for item in dotted or []:
        key, value = parse_override(item)
        set_dotted(data, key, value)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, validation_problems(exc)) from None
