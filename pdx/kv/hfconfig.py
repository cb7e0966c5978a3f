"""Read a ``config.json`` through transformers' own configuration classes.

Derived ``layer_types``, nested text configs and field aliases then come from the library that
defines the model. Its class defaults do not stand in for fields the file lacks: the payload
names the class, its aliases, and the fields missing from the file that the class's derived
layer pattern depends on, so that the sizing (:mod:`pdx.kv.families`) can refuse a value only
a default supplied. Importing transformers' configuration code also imports torch whenever
torch is installed (its RoPE helpers do so at module level), so when torch is not loaded yet
the classes are run in a short child process that hides torch from them; the result (plain
JSON) is cached on disk per transformers version and config, so only the first reading of a
config pays for the child. Model types transformers does not know are read from the raw dict.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

from pdx.errors import UnsupportedModelError

#: Keys that never affect sizing and that strict config classes may reject or convert.
_IGNORED = (
    "_source", "_name_or_path", "_note", "auto_map", "quantization_config", "torch_dtype", "dtype"
)  # fmt: skip
#: Attributes read with ``getattr`` (properties or derived values that ``to_dict`` omits).
_DERIVED_ATTRS = (
    "layer_types",
    "sliding_window",
    "attention_chunk_size",
    "head_dim",
    "kv_sharing_modes",
    "num_hidden_layers",
)
#: Attributes the configuration classes derive from other fields (a per-layer pattern).
CLASS_DERIVED = ("layer_types", "kv_sharing_modes")
#: Knobs some classes pop from their keyword arguments (so ``to_dict`` never shows them).
_KWARG_KNOBS = ("sliding_window_pattern", "full_attention_interval", "global_attn_every_n_layers")
_MAX_DROPS = 8
_CHILD_TIMEOUT_S = 120
#: Bumped whenever the payload changes shape, so cached payloads of older pdx are not reused.
_PAYLOAD_VERSION = 3


class RejectedConfig(UnsupportedModelError):
    """transformers' configuration class refused the whole config (no field it names).

    ``reason`` is its message on one line; :func:`blame` finds the fields it is about.
    """

    def __init__(self, model_type: str, reason: str) -> None:
        self.model_type = model_type
        self.reason = reason
        super().__init__(f"model_type {model_type!r}: transformers rejects this config: {reason}")


def blame(text: dict[str, Any], reason: str) -> list[str]:
    """The fields of ``text`` a foreign error message is about: those it names, else those
    whose value it quotes (``The hidden size (8192) is not a multiple of ... (65)``)."""
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", reason))
    scalar = {k: v for k, v in text.items() if isinstance(v, int | float | str)}
    named = [k for k in scalar if k in words]
    if named:
        return named
    numbers = set(re.findall(r"(?<![\w.])-?\d+(?:\.\d+)?(?![\w.])", reason))
    return [
        k for k, v in scalar.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and abs(v) >= 2
        and str(v) in numbers
    ]  # fmt: skip


@dataclass(frozen=True)
class ResolvedConfig:
    """The decoder's config as transformers read it (or the raw dict, ``library=None``).

    ``raw_text`` is the decoder part of the file as written; ``dropped`` maps fields the
    configuration class rejected to its message (left out, so the class used its default;
    sizing refuses a dropped field it needs). ``aliases`` maps standard names to the class's
    own (GPT-2's ``n_layer``); ``derived_inputs`` maps each attribute in :data:`CLASS_DERIVED`
    the class derived to the fields missing from the file whose defaults it used.
    """

    model_type: str
    text: dict[str, Any]
    library: str | None
    raw_text: dict[str, Any]
    dropped: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    class_name: str | None = None
    aliases: dict[str, str] = field(default_factory=dict)
    derived_inputs: dict[str, dict[str, Any]] = field(default_factory=dict)

    def file_key(self, key: str) -> str | None:
        """The name under which the file sets ``key`` (itself or the class's alias), if it does."""
        for name in (key, self.aliases.get(key)):
            if name is not None and self.raw_text.get(name) is not None:
                return name
        return None

    def in_file(self, key: str) -> bool:
        """Whether the file itself sets ``key`` (not null), under its name or an alias."""
        return self.file_key(key) is not None

    def file_value(self, key: str) -> Any:
        """The value the file gives ``key`` (None when it does not)."""
        name = self.file_key(key)
        return None if name is None else self.raw_text[name]


def raw_text_config(config: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The decoder part of a raw config and its model_type (wrappers hand over ``text_config``)."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise UnsupportedModelError(
            "config has no 'model_type'; is this a Hugging Face config.json?"
        )
    inner = config.get("text_config")
    if isinstance(inner, dict) and "num_hidden_layers" not in config:
        return inner, str(inner.get("model_type") or f"{model_type}_text")
    return config, model_type


def transformers_version() -> str | None:
    """The installed transformers version, read without importing it."""
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def resolve_config(config: dict[str, Any], *, allow_torch: bool = False) -> ResolvedConfig:
    """The decoder config as transformers reads it; the raw dict for unknown model types.

    ``allow_torch`` (or torch already being loaded) reads it in this process; otherwise a
    child process without torch does (cached on disk, see the module docstring).
    """
    raw_text, raw_type = raw_text_config(config)
    version = transformers_version()
    if version is None:
        return _raw(raw_text, raw_type, "transformers is not installed")
    clean = _without_ignored(config)
    key = json.dumps(clean, sort_keys=True, default=str)
    if allow_torch or "torch" in sys.modules:
        payload = resolve_in_process(clean)
    else:
        payload = _resolve_cached(key, version)
    if payload.get("unknown"):
        return _raw(raw_text, raw_type, f"transformers {version} does not know it")
    if payload.get("rejected"):
        raise RejectedConfig(raw_type, str(payload["error"]))
    if payload.get("error"):
        raise UnsupportedModelError(f"model_type {raw_type!r}: {payload['error']}")
    return ResolvedConfig(
        model_type=str(payload["model_type"]),
        text=payload["text"],
        library=f"transformers {version}",
        raw_text=raw_text,
        dropped=payload.get("dropped", {}),
        class_name=payload.get("class_name"),
        aliases=payload.get("aliases", {}),
        derived_inputs=payload.get("derived_inputs", {}),
    )


def _raw(raw_text: dict[str, Any], raw_type: str, why: str) -> ResolvedConfig:
    note = f"model_type {raw_type!r} read from the config's own fields ({why})"
    return ResolvedConfig(raw_type, dict(raw_text), None, raw_text, notes=[note])


def _without_ignored(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_ignored(v) for k, v in value.items() if k not in _IGNORED}
    return value


def build_hf_config(config: dict[str, Any]) -> tuple[Any, dict[str, str]]:
    """transformers' configuration object for a config dict, and the fields it rejected.

    A field a strict configuration class rejects (Llama 4's published
    ``attn_temperature_tuning: 4`` where the class wants a bool) is left out and named.
    """
    from transformers import CONFIG_MAPPING

    model_type = config["model_type"]
    work = json.loads(json.dumps(_without_ignored(config)))
    dropped: dict[str, str] = {}
    for _ in range(_MAX_DROPS + 1):
        try:
            fields = {k: v for k, v in work.items() if k != "model_type"}
            return CONFIG_MAPPING[model_type](**fields), dropped
        except Exception as exc:  # strict dataclass validation, ValueError, TypeError
            name = _rejected_field(exc)
            if name is None or name in dropped or not _drop(work, name):
                raise RejectedConfig(model_type, _reason(exc)) from None
            dropped[name] = one_line(exc)
    raise UnsupportedModelError(
        f"model_type {model_type!r}: transformers rejects too many fields: {', '.join(dropped)}"
    )


def resolve_in_process(config: dict[str, Any]) -> dict[str, Any]:
    """Run the configuration class here; a JSON-able payload (see :func:`resolve_config`)."""
    from transformers import CONFIG_MAPPING
    from transformers.utils import logging

    logging.set_verbosity_error()
    if config.get("model_type") not in CONFIG_MAPPING:
        return {"unknown": True}
    if not _may_be_decoder(str(config["model_type"])):
        return {"error": _not_decoder(str(config["model_type"]))}
    try:
        hf, dropped = build_hf_config(config)
    except RejectedConfig as exc:
        return {"error": exc.reason, "rejected": True}
    except UnsupportedModelError as exc:
        return {"error": str(exc).split(": ", 1)[-1]}
    text = hf.get_text_config(decoder=True)
    if not _is_decoder(hf, text):
        return {"error": _not_decoder(text.model_type)}
    aliases = {str(k): str(v) for k, v in (getattr(text, "attribute_map", None) or {}).items()}
    data = text.to_dict()
    for attr in (*_DERIVED_ATTRS, *aliases):
        value = getattr(text, attr, None)
        if value is not None:
            data[attr] = list(value) if isinstance(value, list | tuple) else value
    data = json.loads(json.dumps(data, default=str))
    return {
        "model_type": text.model_type,
        "text": data,
        "dropped": dropped,
        "class_name": type(text).__name__,
        "aliases": aliases,
        "derived_inputs": derived_inputs(config, text, set(dropped), aliases),
    }


def derived_inputs(
    config: dict[str, Any], text: Any, dropped: set[str], aliases: dict[str, str]
) -> dict[str, dict[str, Any]]:
    """For each attribute in :data:`CLASS_DERIVED` the class derived (the file does not list
    it), the fields it depends on that the file does not set (or that were dropped), with
    the class's value. Found by trying other values of each such field and watching the
    derived attribute change; fields defaulting to null or false (a feature left off) are
    not tried."""
    config = json.loads(json.dumps(config))
    for name in dropped:  # the trials run on what the class accepted
        _drop(config, name)
    given, _ = raw_text_config(config)
    present = set(given)
    wanted = [
        a for a in CLASS_DERIVED if _plain(getattr(text, a, None)) is not None
        and not {a, aliases.get(a)} & present
    ]  # fmt: skip
    if not wanted:
        return {}
    base = {a: _plain(getattr(text, a, None)) for a in wanted}
    knobs = {k: v for k, v in text.to_dict().items() if not k.startswith("_")}
    knobs.update({k: getattr(text, f"_{k}", getattr(text, k, None)) for k in _KWARG_KNOBS})
    found: dict[str, dict[str, Any]] = {}
    for knob, default in knobs.items():
        if knob in present or knob in wanted or {knob, aliases.get(knob)} & present:
            continue
        for attr in _changed_by(config, knob, default, base):
            found.setdefault(attr, {})[knob] = default
    return found


def _changed_by(config: dict[str, Any], knob: str, default: Any, base: dict[str, Any]) -> set[str]:
    """The derived attributes that change when ``knob`` takes another value."""
    from transformers import CONFIG_MAPPING

    changed: set[str] = set()
    for value in _trial_values(default, knob in _KWARG_KNOBS):
        trial = json.loads(json.dumps(config))
        raw_text_config(trial)[0][knob] = value
        try:
            fields = {k: v for k, v in trial.items() if k != "model_type"}
            text = CONFIG_MAPPING[trial["model_type"]](**fields).get_text_config(decoder=True)
        except Exception:  # a value the class refuses tells nothing
            continue
        changed |= {a for a, v in base.items() if _plain(getattr(text, a, None)) != v}
    return changed


def _trial_values(default: Any, kwarg_knob: bool) -> list[Any]:
    if kwarg_knob:
        return [2, 3]
    if isinstance(default, bool):
        return [False] if default else []
    if isinstance(default, int):
        return [v for v in dict.fromkeys((default + 1, 1, 2)) if v != default]
    return []


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, list | tuple) else value


def _not_decoder(model_type: str) -> str:
    return (
        f"{model_type!r} is not a decoder-only language model (encoder or encoder-decoder); "
        "pdx sizes the KV cache of decoders"
    )


def _may_be_decoder(model_type: str) -> bool:
    """A causal LM, or a wrapper (image-text-to-text) around one."""
    # imported by module path: the lazy ``transformers.models.auto`` attribute is a
    # placeholder that raises when torch is absent, the module itself only holds name tables
    modeling_auto = importlib.import_module("transformers.models.auto.modeling_auto")
    names = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES")
    return any(model_type in getattr(modeling_auto, n, {}) for n in names)


def _is_decoder(hf: Any, text: Any) -> bool:
    modeling_auto = importlib.import_module("transformers.models.auto.modeling_auto")
    causal = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    masked = modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
    if getattr(hf, "is_encoder_decoder", False) or getattr(text, "is_encoder_decoder", False):
        return False
    kind = text.model_type
    if kind not in causal:
        return False
    return kind not in masked or bool(getattr(text, "is_decoder", 0))


def _rejected_field(exc: Exception) -> str | None:
    name = getattr(exc, "field", None) or getattr(exc, "field_name", None)
    if isinstance(name, str):
        return name
    found = re.search(r"field '([A-Za-z0-9_]+)'", str(exc))
    return found.group(1) if found else None


def _drop(config: dict[str, Any], name: str) -> bool:
    hit = name in config
    config.pop(name, None)
    for value in config.values():
        if isinstance(value, dict):
            hit = _drop(value, name) or hit
    return hit


def _reason(exc: Exception) -> str:
    """A configuration class's refusal, without the validation wrapper's preamble."""
    text = re.sub(r"^Class validation error for validator '\w+': ", "", one_line(exc, 1000))
    return one_line(text, 200)


def one_line(exc: Exception | str, limit: int = 240) -> str:
    """A foreign error message on one line, cut at a word boundary when long."""
    text = " ".join(str(exc).split())
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0] + " ..."


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdx" / "hfconfig"


@lru_cache(maxsize=256)
def _resolve_cached(key: str, version: str) -> dict[str, Any]:
    digest = hashlib.sha256(f"{_PAYLOAD_VERSION}\n{version}\n{key}".encode()).hexdigest()
    path = _cache_dir() / f"{digest}.json"
    try:
        cached: dict[str, Any] = json.loads(path.read_text())
        return cached
    except (OSError, ValueError):
        pass
    payload = resolve_in_child(json.loads(key))
    if "error" not in payload:
        try:  # a cache that cannot be written only costs the next run a child process
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(payload))
            tmp.replace(path)
        except OSError:
            pass
    return payload


def resolve_in_child(config: dict[str, Any]) -> dict[str, Any]:
    """Run the configuration class in a child process where torch cannot be imported."""
    code = (
        "import json, sys\n"
        "sys.modules['torch'] = None\n"  # transformers then treats torch as absent
        "from pdx.kv.hfconfig import resolve_in_process\n"
        "print(json.dumps(resolve_in_process(json.load(sys.stdin))))\n"
    )
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
    try:
        out = subprocess.run(
            [sys.executable, "-c", code],
            input=json.dumps(config),
            capture_output=True,
            text=True,
            timeout=_CHILD_TIMEOUT_S,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": "reading the config through transformers timed out"}
    if out.returncode != 0:
        tail = out.stderr.strip().splitlines()[-1:] or ["no output"]
        return {"error": f"reading the config through transformers failed: {tail[0]}"}
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result
