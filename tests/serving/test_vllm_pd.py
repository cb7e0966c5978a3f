"""pdx in front of a real vLLM prefill/decode pair (NixlConnector, KV over UCX/TCP).

One pair for the whole module (eager, see vllm_helpers.PAIR_SETTINGS: about a minute to
start on two cores). Prompts are unique per test: decode keeps pulled KV in its
prefix cache, and a repeated prompt would be served from there instead of over NIXL.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from typer.testing import CliRunner
from vllm_helpers import (
    engine_gateway,
    metrics_text,
    post,
    side_channel_cut,
    unique_prompt,
    vllm_deployment,
)

from pdx.serving.engines.metrics import engine_counters, sample_sum
from pdx.serving.supervisor import Deployment

pytestmark = [pytest.mark.slow, pytest.mark.alone, pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def pair() -> Iterator[Deployment]:
    with vllm_deployment(["decode.max_batch=4", "decode.max_queue=2"]) as dep:
        yield dep


def _urls(dep: Deployment) -> tuple[str, str, str, str]:
    ep = dep.endpoints()
    return ep.gateway, ep.prefill[0]["url"], ep.decode[0]["url"], str(ep.model["model"])


def _measure_kv_bytes(model_path: str, tokens: int) -> int:
    """`pdx measure-kv --engine vllm` for this prompt length, as a user would run it."""
    from pdx.cli.main import app

    args = ["measure-kv", "--model-path", model_path, "--engine", "vllm", "--device", "cpu",
            "--seq", str(tokens), "--codecs", "none", "--json"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return int(json.loads(result.stdout)["requests"][0]["kv_bytes"])


@pytest.mark.parametrize("length", [311, 128, 13])
def test_greedy_through_pdx_and_nixl_equals_one_instance(pair: Deployment, length: int) -> None:
    gw, prefill, decode, model = _urls(pair)
    prompt = unique_prompt(length, seed=1)
    # The reference: one vLLM instance computing the whole prompt by itself.
    ref_body = {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    status, ref = post(prefill + "/v1/completions", ref_body)
    assert status == 200, ref
    before = engine_counters(metrics_text(decode))
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "pdx_route": "disaggregated"}  # fmt: skip
    status, out = post(gw + "/v1/completions", body)
    assert status == 200, out
    after = engine_counters(metrics_text(decode))
    pdx = out["pdx"]
    assert out["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    assert pdx["route"] == "disaggregated" and pdx["transfer_outcome"] == "ok", pdx
    assert not pdx["degraded"] and pdx["remote_tokens"] == length
    # The KV really moved: decode's p2p counter rose by the prompt, NIXL moved whole blocks,
    # exactly what measure-kv predicts for vLLM and what the gateway reported.
    assert after["p2p_cached_tokens"] - before["p2p_cached_tokens"] == length
    moved = after["nixl_bytes_transferred"] - before["nixl_bytes_transferred"]
    assert moved == _measure_kv_bytes(pair.endpoints().model["model_path"], length)
    assert moved == pdx["kv_bytes"] and after["nixl_transfers"] - before["nixl_transfers"] == 1


def test_streaming_matches_and_local_route_recomputes(pair: Deployment) -> None:
    gw, _, decode, _ = _urls(pair)
    prompt = unique_prompt(200, seed=2)
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "pdx_route": "disaggregated"}  # fmt: skip
    _, whole = post(gw + "/v1/completions", body)
    streamed = asyncio.run(_stream(gw, {**body, "prompt": prompt, "stream": True}))
    assert streamed["token_ids"] == whole["choices"][0]["token_ids"]
    assert streamed["pdx"]["route"] == "disaggregated"
    before = engine_counters(metrics_text(decode))
    _, local = post(gw + "/v1/completions", {**body, "prompt": unique_prompt(200, 3),
                                             "pdx_route": "local"})  # fmt: skip
    after = engine_counters(metrics_text(decode))
    assert local["pdx"]["route"] == "local" and local["pdx"]["kv_bytes"] == 0
    assert local["pdx"]["timings_ms"]["local_prefill"] > 0
    assert after["p2p_cached_tokens"] == before["p2p_cached_tokens"]  # nothing pulled


def test_a_salted_local_replay_prefills_instead_of_reading_the_pulled_blocks(
    pair: Deployment,
) -> None:
    """decode keeps the blocks it pulled in its prefix cache: the same prompt sent again on the
    local route reads them (no prefill at all); with a cache_salt of its own it prefills."""
    gw, _, decode, _ = _urls(pair)
    body = {"prompt": unique_prompt(200, seed=21), "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    status, shipped = post(gw + "/v1/completions", {**body, "pdx_route": "disaggregated"})
    assert status == 200 and shipped["pdx"]["route"] == "disaggregated"
    before = engine_counters(metrics_text(decode))
    _, plain = post(gw + "/v1/completions", {**body, "pdx_route": "local"})
    mid = engine_counters(metrics_text(decode))
    _, salted = post(gw + "/v1/completions", {**body, "pdx_route": "local", "cache_salt": "r1"})
    after = engine_counters(metrics_text(decode))
    # the full blocks of the pulled prompt (128 of its 200 tokens with the CPU block size)
    assert mid["device_cached_tokens"] - before["device_cached_tokens"] >= 100
    assert after["device_cached_tokens"] == mid["device_cached_tokens"]  # prefilled for real
    ids = [r["choices"][0]["token_ids"] for r in (shipped, plain, salted)]
    assert ids[0] == ids[1] == ids[2]


def _known_blocks(gw: str) -> float:
    """Blocks the gateway knows decode-0 holds (from its KV events)."""
    return sample_sum(metrics_text(gw), "pdx_gateway_decode_cached_blocks", instance="decode-0")


def test_decode_s_kv_events_tell_the_gateway_what_vllm_itself_counts_as_cached(
    pair: Deployment,
) -> None:
    """The gateway follows decode's KV events (a Unix socket, re-hashed with pdx's chain): its
    cached prefix of each request is vLLM's own ``cached_tokens``, salt included, and under
    ``uncached`` it decides on the rest, which is all NIXL moves."""
    gw, _, decode, _ = _urls(pair)
    assert pair.endpoints().decode[0]["kv_events"].startswith("ipc://")
    first = unique_prompt(300, seed=31)  # two whole 128-token blocks
    body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "pdx_route": "local"}

    def send(prompt: list[int], **extra: Any) -> dict[str, Any]:
        status, out = post(gw + "/v1/completions", {**body, "prompt": prompt, **extra})
        assert status == 200, out
        return dict(out["pdx"])

    known = _known_blocks(gw)
    cold = send(first)
    assert cold["offload"]["cached_tokens"] == cold["cached_tokens"] == 0
    for _ in range(100):  # the events arrive within milliseconds; a bound all the same
        if _known_blocks(gw) >= known + 2:
            break
        time.sleep(0.05)
    assert _known_blocks(gw) >= known + 2
    second = first[:280] + unique_prompt(120, seed=32)
    warm = send(second)
    assert warm["offload"]["cached_tokens"] == warm["cached_tokens"] == 256, warm
    salted = send(second, cache_salt="another-tenant")
    assert salted["offload"]["cached_tokens"] == salted["cached_tokens"] == 0, salted
    # uncached decides on what decode lacks: 64 uncached tokens stay local under a threshold
    # of 100, 164 go to prefill, and NIXL pulls only those
    near = send(first + unique_prompt(20, seed=33), pdx_route="auto",
                pdx_offload={"policy": "uncached", "threshold_tokens": 100})  # fmt: skip
    assert near["route"] == "local" and near["offload"]["uncached_tokens"] == 64, near
    before = engine_counters(metrics_text(decode))
    far = send(first + unique_prompt(120, seed=34), pdx_route="auto",
               pdx_offload={"policy": "uncached", "threshold_tokens": 100})  # fmt: skip
    after = engine_counters(metrics_text(decode))
    assert far["route"] == "disaggregated" and far["offload"]["uncached_tokens"] == 164, far
    assert far["offload"]["cached_tokens"] == 256
    # with pulled KV vLLM reports prefill's own hits (none: prefill never saw this prompt)
    assert far["cached_tokens"] is None and far["prefill_cached_tokens"] == 0, far
    assert after["p2p_cached_tokens"] - before["p2p_cached_tokens"] == 164
    assert (far["remote_tokens"], far["pulled_tokens"]) == (420, 164)  # prefill's offer, the pull
    moved = after["nixl_bytes_transferred"] - before["nixl_bytes_transferred"]
    assert far["kv_bytes"] == moved == 2 * 262_144  # two 128-token blocks of the tiny model
    status, err = post(
        gw + "/v1/completions", {**body, "prompt": first, "pdx_offload": {"policy": "break_even"}}
    )
    assert status == 400 and "expected one of length, uncached" in err["error"]["message"]


async def _stream(gw: str, body: dict[str, Any]) -> dict[str, Any]:
    tokens: list[int] = []
    pdx: dict[str, Any] = {}
    async with aiohttp.ClientSession() as s, s.post(gw + "/v1/completions", json=body) as r:
        assert r.status == 200
        async for line in r.content:
            text = line.decode().strip()
            if not text.startswith("data: {"):
                continue
            data = json.loads(text[6:])
            for c in data.get("choices") or []:
                tokens += c.get("token_ids") or []
            pdx = data.get("pdx") or pdx
    return {"token_ids": tokens, "pdx": pdx}


def test_kv_of_another_prompt_changes_the_output(pair: Deployment) -> None:
    """The output depends on the pulled KV: decode given prompt B's blocks for prompt C."""
    _, prefill, decode, model = _urls(pair)
    b, c = unique_prompt(300, 4), unique_prompt(300, 5)
    step1 = {"model": model, "prompt": b, "max_tokens": 1, "ignore_eos": True,
             "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    _, pre_b = post(prefill + "/v1/completions", step1)
    body = {"model": model, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    _, ref_c = post(prefill + "/v1/completions", {**body, "prompt": c})
    wrong = {**body, "prompt": c, "kv_transfer_params": pre_b["kv_transfer_params"]}
    _, mixed = post(decode + "/v1/completions", wrong)
    assert mixed["choices"][0]["token_ids"] != ref_c["choices"][0]["token_ids"]


def test_metrics_merge_the_engines_own_series(pair: Deployment) -> None:
    gw, _, _, _ = _urls(pair)
    text = metrics_text(gw)
    assert "pdx_gateway_requests_total" in text and "pdx:time_to_first_token_seconds" in text
    for name in ("prefill-0", "decode-0"):
        assert sample_sum(text, "vllm:prompt_tokens_total", pdx_instance=name) >= 0
        assert f'pdx_instance="{name}"' in text
    assert sample_sum(text, "vllm:nixl_bytes_transferred_sum", pdx_instance="decode-0") > 0


def test_deploy_json_lists_each_instance(pair: Deployment) -> None:
    ep = pair.endpoints()
    assert ep.model["engine"] == "vllm" and os.path.isfile(f"{ep.model['model_path']}/config.json")
    for inst in [*ep.prefill, *ep.decode]:
        assert inst["url"].startswith("http://127.0.0.1:") and inst["pid"] > 0
        assert inst["model_path"] == ep.model["model_path"]
        assert metrics_text(inst["url"]).count("vllm:") > 10  # its /metrics is the engine's
    assert ep.prefill[0]["kv_endpoint"] == ep.prefill[0]["nixl_side_channel"]


async def _hold_streams(gw: str, n: int) -> tuple[list[int], list[Any]]:
    """Open ``n`` long streams at once; statuses, and the open responses (closed by the caller)."""
    session = aiohttp.ClientSession()
    body = {"prompt": unique_prompt(40, 6), "max_tokens": 900, "ignore_eos": True,
            "stream": True, "pdx_route": "local"}  # fmt: skip
    resps = await asyncio.gather(*(session.post(gw + "/v1/completions", json=body)
                                   for _ in range(n)))  # fmt: skip
    return [r.status for r in resps], [session, *resps]


def test_no_capacity_is_429_and_a_client_leaving_aborts_in_vllm(pair: Deployment) -> None:
    gw, _, decode, _ = _urls(pair)

    async def run() -> list[int]:
        statuses, held = await _hold_streams(gw, 7)  # capacity: max_batch 4 + max_queue 2
        session, resps = held[0], held[1:]
        for r in resps:
            r.close()
        await session.close()
        return statuses

    statuses = asyncio.run(run())
    assert Counter(statuses) == Counter({200: 6, 429: 1}), statuses
    t0 = time.monotonic()  # the closed streams are aborted inside vLLM, not run to the end
    while engine_counters(metrics_text(decode))["requests_running"] > 0:
        assert time.monotonic() - t0 < 10, "vLLM kept generating for clients that left"
        time.sleep(0.2)


@pytest.fixture
async def cut_side_channel(pair: Deployment) -> AsyncIterator[str]:
    """A relay in front of prefill that sends decode to a NIXL side channel nobody listens on."""
    async with side_channel_cut(pair.endpoints().prefill[0]["url"]) as url:
        yield url


async def test_a_failed_kv_load_is_recomputed_and_labelled(
    pair: Deployment, cut_side_channel: str
) -> None:
    _, _, decode, model = _urls(pair)
    gw = engine_gateway(cut_side_channel, decode, model)
    await gw.start("127.0.0.1", 0)
    try:
        prompt = unique_prompt(300, 7)
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "pdx_route": "disaggregated"}  # fmt: skip
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{gw.port}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                out = await r.json()
            local = {**body, "pdx_route": "local", "prompt": prompt}
            async with s.post(f"http://127.0.0.1:{gw.port}/v1/completions", json=local) as r:
                ref = await r.json()
        pdx = out["pdx"]
        assert pdx["degraded"] and pdx["degrade_reason"].startswith("kv_load_failed")
        assert pdx["route"] == "local" and pdx["transfer_outcome"] == "kv_load_failed"
        assert pdx["retries"] == 1 and pdx["kv_bytes"] == 0
        assert out["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
        text = (await gw.prom(None)).text or ""  # type: ignore[arg-type]
        assert sample_sum(text, "pdx_gateway_kv_transfers_total", outcome="kv_load_failed") == 1
    finally:
        await gw.stop()


def test_pdx_in_front_of_instances_it_did_not_start(pair: Deployment) -> None:
    """External endpoints: a second pdx deploy fronts the pair's instances and starts nothing."""
    _, prefill, decode, model = _urls(pair)
    path = str(pair.endpoints().model["model_path"])
    prompt = unique_prompt(200, seed=7)
    ref_body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    status, ref = post(prefill + "/v1/completions", ref_body)
    assert status == 200, ref
    fronting = [f"vllm.model={path}", f"vllm.prefill_urls=[{prefill}]",
                f"vllm.decode_urls=[{decode}]"]  # fmt: skip
    with vllm_deployment(fronting) as front:
        assert front.children == []  # nothing started
        ep = front.endpoints()
        assert [p["url"] for p in ep.prefill] == [prefill]
        assert [d["url"] for d in ep.decode] == [decode]
        before = engine_counters(metrics_text(decode))
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "pdx_route": "disaggregated"}  # fmt: skip
        status, out = post(ep.gateway + "/v1/completions", body)
        assert status == 200, out
        after = engine_counters(metrics_text(decode))
    assert out["model"] == model  # the name the instances serve, asked from decode
    assert out["pdx"]["route"] == "disaggregated" and out["pdx"]["transfer_outcome"] == "ok"
    assert out["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    assert after["p2p_cached_tokens"] - before["p2p_cached_tokens"] == len(prompt)
    # Stopping the fronting deploy left the pair's instances serving.
    assert post(decode + "/v1/completions", {**ref_body, "max_tokens": 1})[0] == 200


def test_prefill_killed_mid_run_degrades_then_recovers(pair: Deployment) -> None:
    """SIGKILL the prefill instance (its whole process group) under load: nothing fails."""
    gw, _, _, _ = _urls(pair)
    child = next(c for c in pair.children if c.name == "prefill-0")
    record = pair.board.children[child.name]  # the supervisor's restart count for it
    restarts = record.restarts
    before = metrics_text(gw)
    outcomes = asyncio.run(_load_with_kill(gw, child.info["pid"], seconds=12.0))
    assert outcomes["failed"] == 0, outcomes
    assert outcomes["degraded"] > 0 and outcomes["disaggregated"] > 0, outcomes
    after = metrics_text(gw)
    counted = sum(
        sample_sum(after, "pdx_gateway_degradations_total", reason=r)
        - sample_sum(before, "pdx_gateway_degradations_total", reason=r)
        for r in ("prefill_unavailable", "prefill_failed", "kv_load_failed", "prefill_timeout")
    )
    assert counted == outcomes["degraded"]
    # The supervisor restarts it on the same ports; disaggregated requests come back.
    t0 = time.monotonic()
    while True:
        status, out = post(gw + "/v1/completions", {"prompt": unique_prompt(150, 8 + int(
            time.monotonic())), "max_tokens": 2, "pdx_route": "disaggregated"})  # fmt: skip
        if status == 200 and out["pdx"]["transfer_outcome"] == "ok":
            break
        assert status == 200, out
        assert time.monotonic() - t0 < 330, _not_back(child, record.restarts - restarts)
        time.sleep(1.0)
    assert record.restarts == restarts + 1
    print(f"prefill back {time.monotonic() - t0:.1f} s after the load ended; {outcomes}")


def _not_back(child: Any, restarts_seen: int) -> str:
    """Why the test gave up: restarts seen and the end of the instance's own log."""
    tail = child.log_path.read_text(errors="replace")[-3000:] if child.log_path else "(no log)"
    return f"prefill did not come back: {restarts_seen} restart(s)\n{tail}"


async def _load_with_kill(gw: str, pid: int, seconds: float) -> dict[str, int]:
    """Two closed-loop users (bounded in time and count); the kill lands 2 s in."""
    counts: Counter[str] = Counter()
    deadline = time.monotonic() + seconds
    seq = iter(range(10_000))

    async def user(u: int) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            while time.monotonic() < deadline and counts["sent"] < 400:
                counts["sent"] += 1
                body = {"prompt": unique_prompt(150, 1000 + next(seq)), "max_tokens": 4,
                        "ignore_eos": True, "pdx_route": "disaggregated"}  # fmt: skip
                t0 = time.monotonic()
                try:
                    async with s.post(gw + "/v1/completions", json=body) as r:
                        data = await r.json()
                except TimeoutError:
                    counts["failed"] += 1
                    print(f"request hung {time.monotonic() - t0:.1f} s")
                    continue
                if r.status != 200:
                    counts["failed"] += 1
                    continue
                counts["degraded" if data["pdx"]["degraded"] else "disaggregated"] += 1

    async def kill() -> None:
        await asyncio.sleep(2.0)
        os.killpg(pid, signal.SIGKILL)

    await asyncio.gather(user(0), user(1), kill())
    return {k: counts[k] for k in ("sent", "failed", "degraded", "disaggregated")}
