"""Where a model config comes from: a config.json file, a checkpoint directory, or a preset,
plus the fields ``--set FIELD=VALUE`` adds to it.

Presets are the public ``config.json`` fields of well-known models, stored as JSON files in
``pdx/kv/presets/`` (``_source`` names the Hugging Face repository they come from).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from pdx.errors import InputError, PdxError


@dataclass(frozen=True)
class ModelSource:
    """A loaded config and where it came from (``model_dir`` only for checkpoints).

    ``overrides`` are the fields ``--set`` put into ``config`` (already applied).
    """

    name: str
    config: dict[str, Any]
    model_dir: Path | None = None
    overrides: dict[str, Any] = field(default_factory=dict)


def _preset_dir() -> Any:
    return resources.files("pdx.kv").joinpath("presets")


def preset_names() -> list[str]:
    """Names accepted by ``--preset``, sorted."""
    return sorted(
        p.name.removesuffix(".json") for p in _preset_dir().iterdir() if p.name.endswith(".json")
    )


def load_preset(name: str) -> ModelSource:
    """A built-in preset by name (case-insensitive)."""
    key = name.strip().lower()
    if key not in preset_names():
        raise InputError("--preset", name, f"one of {', '.join(preset_names())}")
    config = json.loads(_preset_dir().joinpath(f"{key}.json").read_text())
    return ModelSource(name=key, config=config)


def load_config_file(path: Path, field: str = "--config") -> ModelSource:
    """A Hugging Face config.json from disk."""
    if not path.is_file():
        raise InputError(field, str(path), "an existing config.json file")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(
            field, str(path), f"a JSON file ({exc.__class__.__name__}: {exc})"
        ) from None
    if not isinstance(config, dict):
        raise InputError(field, str(path), "a JSON object (a Hugging Face config.json)")
    return ModelSource(name=str(config.get("_name_or_path") or config_name(path)), config=config)


def config_name(path: Path) -> str:
    """What to call a model given by its config file: a checkpoint's ``config.json`` by its
    folder (``llama-3.1-70b/config.json``), any other file by its own name (``c.json`` → c)."""
    return path.parent.resolve().name if path.name == "config.json" else path.stem


def load_model_dir(path: Path) -> ModelSource:
    """A local checkpoint directory (must hold config.json)."""
    if not path.is_dir():
        raise InputError("--model-path", str(path), "an existing checkpoint directory")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise InputError("--model-path", str(path), "a directory containing config.json")
    loaded = load_config_file(config_path, field="--model-path")
    return ModelSource(name=path.name, config=loaded.config, model_dir=path)


def resolve_source(
    *, config: Path | None = None, model_path: Path | None = None, preset: str | None = None
) -> ModelSource:
    """Exactly one of ``config`` / ``model_path`` / ``preset``."""
    given = [
        k
        for k, v in (("--config", config), ("--model-path", model_path), ("--preset", preset))
        if v
    ]
    if len(given) != 1:
        raise InputError(
            "model source",
            " ".join(given) or "none",
            "exactly one of --config, --model-path, --preset",
        )
    if config is not None:
        return load_config_file(config)
    if model_path is not None:
        return load_model_dir(model_path)
    assert preset is not None
    return load_preset(preset)


_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``--set FIELD=VALUE`` (repeatable) → ``{field: value}``; the value is read as JSON
    (``80``, ``null``, ``true``, ``"x"``, ``[...]``), and as a plain string when it is not JSON."""
    out: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or not _FIELD_NAME.fullmatch(name):
            raise InputError("--set", item, "FIELD=VALUE with a config field name, e.g. "
                             "num_hidden_layers=80")  # fmt: skip
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        if isinstance(value, dict):
            raise InputError("--set", item, "a JSON number, string, true/false/null or list")
        out[name] = value
    return out


def apply_overrides(source: ModelSource, overrides: dict[str, Any]) -> ModelSource:
    """The source with ``overrides`` set in its decoder config (a wrapper's ``text_config``)."""
    if not overrides:
        return source
    from pdx.kv.hfconfig import raw_text_config

    config = copy.deepcopy(source.config)
    try:
        text, _ = raw_text_config(config)
    except PdxError:  # no model_type yet: it may be among the overrides
        text = config
    text.update(overrides)
    return dataclasses.replace(source, config=config, overrides=dict(overrides))
