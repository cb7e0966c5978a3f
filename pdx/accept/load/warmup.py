"""Warm-up requests before the first measured step (first passes and connections are slow)."""

from __future__ import annotations

import random
import time
from typing import Any

from pdx.accept.playbook import Load, Target
from pdx.accept.steps import Step


async def warm_up(
    url: str, step: Step, count: int, *, load: Load, target: Target, seed: int
) -> list[dict[str, Any]]:
    """Send ``count`` streamed requests one after another; return what each did (not judged)."""
    import aiohttp

    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    timeout = aiohttp.ClientTimeout(total=load.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for _ in range(count):
            body: dict[str, Any] = {
                "prompt": [rng.randint(1, load.token_id_max) for _ in range(step.input_tokens)],
                "max_tokens": step.output_tokens,
                "stream": True,
                **({"model": target.model} if target.model else {}),
                **target.extra_body,
            }
            t0 = time.perf_counter()
            try:
                async with session.post(url + "/v1/completions", json=body) as resp:
                    raw = await resp.read()
                    ok = resp.status == 200 and b"[DONE]" in raw and b'"error"' not in raw
                    out.append(
                        {"status": resp.status, "ok": ok, "ms": (time.perf_counter() - t0) * 1e3}
                    )
            except (aiohttp.ClientError, TimeoutError) as exc:
                out.append({"status": None, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
    return out
