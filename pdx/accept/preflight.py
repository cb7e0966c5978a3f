"""Pre-flight measurements included in the report: ``pdx measure-kv`` on the model under test."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from pdx.accept.playbook import Playbook


async def measure_kv(pb: Playbook, model_name: str | None, qps: float) -> dict[str, Any]:
    """Analytic KV bytes per token / per request and link demand, from ``pdx measure-kv --json``.

    Runs the command as a subprocess (the same numbers a user gets by hand); a failure is
    reported in the result, never raised: pre-flight informs the reviewer, it does not judge.
    """
    preset = pb.preflight.model_preset or model_name
    if not preset:
        return {"measure_kv": None, "note": "no model known: set preflight.model_preset"}
    seqs = ",".join(str(n) for n in sorted(set(pb.matrix.input_tokens)))
    args = [
        "measure-kv",
        "--preset",
        preset,
        "--seq",
        seqs,
        "--codecs",
        "none",
        "--json",
        "--qps",
        f"{max(qps, 0.001):g}",
        "--link-gbps",
        f"{pb.preflight.link_gbps:g}",
    ]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "from pdx.cli.main import main; main()",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    if proc.returncode != 0:
        return {"command": ["pdx", *args], "error": err.decode(errors="replace").strip()[-500:]}
    result = json.loads(out)
    result.pop("layers", None)  # per-layer detail: available from the command itself
    return {"command": ["pdx", *args], "result": result}
