"""A vLLM decode that recomputes quietly is caught: the silent-fallback gate from decode's own
KV-load failure records.

With ``kv_load_failure_policy: recompute`` a decode whose NIXL pull fails recomputes the
prompt itself and answers normally: the gateway sees a first token and labels the request
disaggregated, not degraded. Decode's KV-load failure records (the engine hook behind
``PDX_VLLM_KV_FAILURES``, written under ``kv.audit_dir``) name those requests, and the
gate fails on them. A pair of its own (about a minute to start on two cores).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from vllm_helpers import engine_gateway, side_channel_cut, unique_prompt, vllm_deployment

from pdx.accept.judge.criteria import judge_step
from pdx.accept.judge.gates import engine_silent_fallback
from pdx.accept.judge.stats import derive_rates
from pdx.accept.playbook import Criteria
from pdx.accept.steps import Step
from pdx.serving.supervisor import Deployment

pytestmark = [pytest.mark.slow, pytest.mark.alone, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def recomputing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Deployment, Path]]:
    audit = tmp_path_factory.mktemp("kv-audit")
    settings = ["vllm.kv_load_failure_policy=recompute", f"kv.audit_dir={audit}"]
    with vllm_deployment(settings) as dep:
        yield dep, audit


async def _complete(s: aiohttp.ClientSession, url: str, seed: int) -> dict[str, Any]:
    body = {"prompt": unique_prompt(300, seed), "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "pdx_route": "disaggregated"}  # fmt: skip
    async with s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        out: dict[str, Any] = await r.json()
    return {"ok": True, "output_tokens": out["usage"]["completion_tokens"], "pdx": out["pdx"]}


def _judged(rows: list[dict[str, Any]], audit: Path) -> tuple[dict[str, Any], str]:
    facts = engine_silent_fallback(rows, [audit])
    assert isinstance(facts, dict), facts
    summary: dict[str, Any] = {"requests": len(rows), "ok": len(rows), **facts}
    derive_rates(summary, {})
    only = Criteria.model_validate(
        {name: None for name in Criteria.model_fields} | {"silent_fallback_max": 0}
    )
    # A sample this small bounds "none observed" only loosely: 0.9 lets 2 clean requests pass.
    step = Step(0, 300, 8, 1, None, "normal", 15.0)
    (result,) = judge_step(step, summary, only, {}, 0.95, zero_rate_bound=0.9)
    return facts, result.result


async def test_a_quiet_recompute_is_found_and_fails_the_gate(
    recomputing: tuple[Deployment, Path],
) -> None:
    dep, audit = recomputing
    ep = dep.endpoints()
    prefill, decode, model = ep.prefill[0]["url"], ep.decode[0]["url"], str(ep.model["model"])
    async with aiohttp.ClientSession() as s:
        # The pair as deployed: KV pulled over NIXL, no failure, nothing silent.
        clean = [await _complete(s, ep.gateway, seed) for seed in (1, 2)]
        assert _judged(clean, audit) == ({"labelled_disaggregated": 2, "silent_fallback": 0},
                                         "pass")  # fmt: skip
        # Decode sent to a side channel nobody listens on: every pull fails, vLLM recomputes.
        async with side_channel_cut(prefill) as relay:
            gw = engine_gateway(relay, decode, model)
            await gw.start("127.0.0.1", 0)
            try:
                quiet = [await _complete(s, f"http://127.0.0.1:{gw.port}", seed)
                         for seed in (3, 4, 5)]  # fmt: skip
            finally:
                await gw.stop()
    # The gateway saw nothing wrong: labelled disaggregated, the transfer "ok", not degraded.
    for row in quiet:
        p = row["pdx"]
        assert (p["route"], p["transfer_outcome"], p["degraded"]) == ("disaggregated", "ok", False)
    facts, result = _judged(clean + quiet, audit)
    assert facts == {"labelled_disaggregated": 5, "silent_fallback": 3}
    assert result == "fail"
