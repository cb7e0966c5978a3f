"""Pre-flight measurements included in the report: measure-kv on the deployed model.

The model is the one the deploy really serves (its deploy config: backend, preset or
checkpoint), sized with the ``pdx.kv`` library; a ``preflight.model_preset`` overrides it.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from pdx.accept.playbook import Playbook, Target
from pdx.accept.steps import expand_steps
from pdx.errors import PdxError
from pdx.serving.backends.presets import TINY_PRESETS, tiny_config_json


def deployed_model(pb: Playbook, playbook_dir: Path) -> tuple[Any, str, str]:
    """(``ModelSource``, KV dtype, how it was found) for the model the deploy serves.

    Tiny transformers presets are built from the backend's own config dict; synthetic models
    use the measure-kv preset they are named after; checkpoints their ``config.json``.
    """
    from pdx.kv.source import ModelSource, load_model_dir, load_preset

    if pb.preflight.model_preset:
        return load_preset(pb.preflight.model_preset), "bf16", "preflight.model_preset"
    cfg = deploy_config(pb.target, playbook_dir)
    if cfg.engine == "vllm":  # the engine's model, in the KV dtype vLLM keeps (bf16 here)
        name = cfg.vllm.model
        if name in TINY_PRESETS:
            return (
                ModelSource(name=name, config=tiny_config_json(name)),
                "bf16",
                "deploy vllm.model",
            )
        return load_model_dir(Path(name)), "bf16", "deploy vllm.model (checkpoint)"
    model = cfg.model
    if model.checkpoint:
        # The CPU backend loads checkpoints in fp32 (bf16 on CUDA); KV travels in that dtype.
        return load_model_dir(Path(model.checkpoint)), "fp32", "deploy model.checkpoint"
    if model.backend == "transformers" and model.preset in TINY_PRESETS:
        source = ModelSource(name=model.preset, config=tiny_config_json(model.preset))
        return source, "fp32", "deploy model.preset (tiny transformers config)"
    if model.preset == "tiny-llama":  # synthetic twin of the tiny preset: same layout, fp32
        source = ModelSource(name="tiny-llama", config=tiny_config_json("tiny-llama"))
        return source, "fp32", "deploy synthetic tiny-llama"
    return load_preset(model.preset), "bf16", "deploy model.preset (measure-kv preset)"


def deploy_config(target: Target, playbook_dir: Path) -> Any:
    """The deploy config the run starts (embedded default or YAML, with ``deploy_set``)."""
    from pdx.serving.deploy_config import load_deploy_config

    path = None
    if target.deploy not in (None, "default"):
        path = Path(str(target.deploy))
        path = path if path.is_absolute() else playbook_dir / path
    return load_deploy_config(path, dotted=list(target.deploy_set))


def measure_kv(pb: Playbook, playbook_dir: Path, qps: float) -> dict[str, Any]:
    """KV bytes per token / per request at the playbook's input lengths, and the link budget.

    A failure is reported in the result, never raised: pre-flight informs the reviewer, it
    does not judge.
    """
    from pdx.kv.budget import LinkParams
    from pdx.kv.report import MeasureOptions
    from pdx.kv.report import measure_kv as run_measure

    try:
        source, dtype, how = deployed_model(pb, playbook_dir)
        seqs = tuple(sorted({s.input_tokens for s in expand_steps(pb)}))
        link = LinkParams(
            qps=max(qps, 0.001), link_gbps=pb.preflight.link_gbps, prefill_tflops=400.0
        )
        opts = MeasureOptions(
            dtype=dtype, seqs=seqs, link=link, **_engine_options(pb, playbook_dir)
        )
        result = asdict(run_measure(source, opts))
    except PdxError as exc:
        return {"error": str(exc)}
    result.pop("layers", None)  # per-layer detail: `pdx measure-kv` prints it
    return {"model": source.name, "dtype": dtype, "model_from": how, "result": result}


def kv_bytes_at(pb: Playbook, playbook_dir: Path, seqs: list[int]) -> dict[int, int]:
    """KV bytes of one request of each length in ``seqs`` (analytic measure-kv on the deployed
    model, as :func:`measure_kv` sizes it)."""
    from pdx.kv.report import MeasureOptions
    from pdx.kv.report import measure_kv as run_measure

    source, dtype, _ = deployed_model(pb, playbook_dir)
    opts = MeasureOptions(dtype=dtype, seqs=tuple(seqs), **_engine_options(pb, playbook_dir))
    return {int(r["seq"]): int(r["kv_bytes"]) for r in run_measure(source, opts).requests}


def _engine_options(pb: Playbook, playbook_dir: Path) -> dict[str, Any]:
    """measure-kv's --engine/--device/--block-size for a vLLM deploy: the bytes NIXL moves."""
    if pb.preflight.model_preset or pb.target.deploy is None:
        return {}
    cfg = deploy_config(pb.target, playbook_dir)
    if cfg.engine != "vllm":
        return {}
    device = "gpu" if cfg.vllm.device == "cuda" else "cpu"
    return {"engine": "vllm", "device": device, "block_size": cfg.vllm.block_size}


def kv_bytes_per_request(measured: dict[str, Any] | None) -> tuple[int, int] | None:
    """(input tokens, KV bytes) of the largest request row of a pre-flight measure-kv."""
    rows = ((measured or {}).get("result") or {}).get("requests") or []
    if not rows:
        return None
    top = max(rows, key=lambda r: int(r.get("kv_bytes", 0)))
    return int(top["seq"]), int(top["kv_bytes"])


def transfer_deadline_s(
    fixed_ms: float | None, probe: dict[str, Any], preflight: dict[str, Any] | None
) -> float:
    """The deploy's transfer deadline: fixed, or derived as its KV clients derive it for the
    largest request's KV (the pre-flight's ``_kv``) at the probed RTT and goodput
    (pdx.transfer.path)."""
    if fixed_ms is not None:
        return fixed_ms / 1e3
    from pdx.transfer.path import ASSUMED_GOODPUT_BPS, derived_deadline_ms

    kv = kv_bytes_per_request((preflight or {}).get("_kv"))
    goodput = float(probe.get("down_gbps") or 0.0) * 1e9 or ASSUMED_GOODPUT_BPS
    rtt_ms = float(probe.get("rtt_p99_ms") or 0.0)
    return derived_deadline_ms(kv[1] if kv else 0, rtt_ms, goodput, cold=False) / 1e3
