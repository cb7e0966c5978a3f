"""TTFT and TPOT of the disaggregated pair vs colocated serving of the same tiny model, same run.

Three paths, one request at a time (latency, not throughput), the same prompts:
  colocated   the model in this process: TTFT = prefill forward; TPOT = one decode step.
  local       pdx deploy, ``pdx_route: local``: gateway → decode, which prefills itself.
  disagg      pdx deploy, ``pdx_route: disaggregated``: gateway → prefill (KV put) → decode
              (KV get over mutual TLS, rebuild) → tokens.
TTFT is measured by the client to the first streamed token; TPOT = (E2E - TTFT) / (tokens - 1).
The disaggregated TTFT overhead is broken down from the per-request ``pdx`` timings: prefill
queueing, prefill, KV store (encode + put), transfer (get + rebuild, before the first decode
step), first decode step. Goal: TTFT overhead vs local <= transfer time + 5 ms.

Usage: python benchmarks/bench_serving.py [--prompt-tokens 512] [--max-tokens 32]
       [--requests 15] [--codec raw] [--no-tls] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

GOAL_SLACK_MS = 5.0


def median(values: list[float]) -> float:
    """Median, NaN when empty."""
    return statistics.median(values) if values else float("nan")


class Colocated:
    """The same model in this process: no network, no serialization."""

    def __init__(self) -> None:
        from pdx.serving.backends import BackendConfig, create_backend

        self.backend = create_backend(BackendConfig())

    def once(self, prompt: list[int], max_tokens: int) -> dict[str, float]:
        """TTFT = prefill forward + pick; TPOT = mean decode step."""
        from pdx.serving.backends.sampling import pick_token

        t0 = time.perf_counter()
        state, logits = self.backend.prefill(prompt)
        tokens = [pick_token(logits, 0, 0, 0)]
        t1 = time.perf_counter()
        while len(tokens) < max_tokens:
            (state,), logits = self.backend.decode_step([state], [tokens[-1]])
            tokens.append(pick_token(logits[0], 0, 0, 0))
        t2 = time.perf_counter()
        return {"ttft_ms": (t1 - t0) * 1e3, "tpot_ms": (t2 - t1) * 1e3 / (max_tokens - 1)}


async def one_request(session: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """Stream one completion; client-side TTFT/TPOT plus the server's pdx timings."""
    t0 = time.perf_counter()
    first = None
    last: dict[str, Any] = {}
    n = 0
    async with session.post(url, json=body) as r:
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            n += len(event["choices"][0].get("token_ids", []))
            if first is None and n:
                first = time.perf_counter()
            last = event
    end = time.perf_counter()
    assert first is not None and "pdx" in last, last
    return {
        "ttft_ms": (first - t0) * 1e3,
        "tpot_ms": (end - first) * 1e3 / max(1, n - 1),
        "pdx": last["pdx"],
        "tokens": n,
    }


async def served(args: argparse.Namespace, prompt: list[int]) -> dict[str, Any]:
    import aiohttp

    from pdx.serving.deploy_config import load_deploy_config
    from pdx.serving.supervisor import Deployment

    sets = ["gateway.port=0", "kv.kv_transfer_timeout_ms=5000", f"kv.codec={args.codec}"]
    if args.no_tls:
        sets.append("tls.enabled=false")
    dep = Deployment(load_deploy_config(dotted=sets))
    await dep.start()
    url = dep.endpoints().gateway + "/v1/completions"
    colo = Colocated()
    out: dict[str, list[dict[str, Any]]] = {"colocated": [], "local": [], "disaggregated": []}
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(3):  # warm-up: connections, TLS handshakes, allocator
                colo.once(prompt, args.max_tokens)
                for route in ("local", "disaggregated"):
                    await one_request(session, url, _body(prompt, args, route))
            for _ in range(args.requests):  # interleaved, so drift hits every path alike
                out["colocated"].append(colo.once(prompt, args.max_tokens))
                for route in ("local", "disaggregated"):
                    out[route].append(await one_request(session, url, _body(prompt, args, route)))
    finally:
        await dep.stop()
    return out


def _body(prompt: list[int], args: argparse.Namespace, route: str) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": args.max_tokens, "stream": True, "ignore_eos": True,
            "return_token_ids": True, "pdx_route": route}  # fmt: skip


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians per path, the disaggregated breakdown, and the goal check."""
    paths: dict[str, Any] = {}
    for route, rs in runs.items():
        paths[route] = {"ttft_ms": median([r["ttft_ms"] for r in rs]),
                        "tpot_ms": median([r["tpot_ms"] for r in rs])}  # fmt: skip
    dis = runs["disaggregated"]
    assert all(not r["pdx"]["degraded"] for r in dis), "a disaggregated request degraded"

    def t(key: str) -> float:
        return median([float(r["pdx"]["timings_ms"][key] or 0.0) for r in dis])

    transfer = median([float(r["pdx"]["transfer_ms"]) for r in dis])
    breakdown = {
        "prefill_queue_ms": t("prefill_queue"),
        "prefill_ms": t("prefill"),
        "kv_store_ms": t("kv_store"),
        "transfer_ms": transfer,
        "kv_ready_ms": t("decode_kv_ready"),
        "first_decode_step_ms": t("first_decode_step"),
    }
    overhead_local = paths["disaggregated"]["ttft_ms"] - paths["local"]["ttft_ms"]
    overhead_colo = paths["disaggregated"]["ttft_ms"] - paths["colocated"]["ttft_ms"]
    return {
        "paths": paths,
        "disaggregated_breakdown_ms": breakdown,
        "kv_bytes": int(median([float(r["pdx"]["kv_bytes"]) for r in dis])),
        "ttft_overhead_vs_local_ms": overhead_local,
        "ttft_overhead_vs_colocated_ms": overhead_colo,
        "goal_ms": transfer + GOAL_SLACK_MS,
        "goal_met_vs_local": overhead_local <= transfer + GOAL_SLACK_MS,
        "goal_met_vs_colocated": overhead_colo <= transfer + GOAL_SLACK_MS,
        "tpot_ratio_disagg_to_local": paths["disaggregated"]["tpot_ms"] / paths["local"]["tpot_ms"],
    }


def main() -> None:
    """Run the three paths and print medians, the breakdown and the goal check."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=15)
    p.add_argument("--codec", default="raw")
    p.add_argument("--no-tls", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    prompt = [4 + (i * 37) % 256 for i in range(args.prompt_tokens)]
    runs = asyncio.run(served(args, prompt))
    result = {"prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
              "requests": args.requests, "codec": args.codec, "tls": not args.no_tls,
              **summarize(runs)}  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for name, v in result["paths"].items():
        print(f"{name:>14}: TTFT {v['ttft_ms']:8.2f} ms   TPOT {v['tpot_ms']:7.2f} ms (median)")
    print(f"KV per request {result['kv_bytes']} B, codec {args.codec}, TLS {result['tls']}")
    print("disaggregated breakdown (median ms): " + ", ".join(
        f"{k.removesuffix('_ms')} {v:.2f}" for k, v in result["disaggregated_breakdown_ms"].items()
    ))  # fmt: skip
    verdict = {True: "MET", False: "NOT MET"}
    print(f"goal: TTFT overhead <= transfer + {GOAL_SLACK_MS:.0f} ms = {result['goal_ms']:.2f} ms")
    print(
        f"  vs local (same gateway, decode prefills): "
        f"{result['ttft_overhead_vs_local_ms']:.2f} ms {verdict[result['goal_met_vs_local']]}"
    )
    print(f"  vs colocated (model in one process, no RPC): "
          f"{result['ttft_overhead_vs_colocated_ms']:.2f} ms "
          f"{verdict[result['goal_met_vs_colocated']]}")  # fmt: skip
    print(f"TPOT ratio disaggregated / local: {result['tpot_ratio_disagg_to_local']:.3f}")


if __name__ == "__main__":
    main()
