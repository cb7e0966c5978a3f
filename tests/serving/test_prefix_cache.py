"""Prefix caches in pdx's own pair: hashed blocks, suffix-only KV, and the uncached-length policy.

Real tiny-model forward passes, real gRPC and HTTP on loopback, in this process.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import pytest
import pytest_asyncio
import torch

from pdx._proto import serving_pb2
from pdx.serving.gateway import Gateway
from pdx.serving.prefix_cache import PrefixCache, block_hashes, reusable_blocks
from tests.serving.inprocess_pair import greedy_reference, inprocess_pair

aio = pytest.mark.asyncio(loop_scope="module")

BYTES_PER_TOKEN = 512  # tiny-llama: 2 layers x (K + V) x 2 KV heads x 16 dims x 4 B
SETS = ["kv.kv_transfer_timeout_ms=10000", "router.offload.threshold_tokens=32",
        "router.offload.policy=uncached", "router.breaker_min_samples=1000",
        "prefix_cache.block_tokens=16"]  # fmt: skip


def ids(n: int, seed: int) -> list[int]:
    return [4 + (seed * 7919 + i * 31) % 250 for i in range(n)]


# --- blocks, hashes, eviction ------------------------------------------------------------


def test_block_hashes_chain_over_the_whole_prefix() -> None:
    a, b = ids(40, 1), ids(40, 2)
    assert len(block_hashes(a, 16)) == 2  # whole blocks only
    assert block_hashes(a + b, 16)[:2] == block_hashes(a, 16)
    changed = [a[0] + 1, *a[1:]]
    assert block_hashes(changed, 16)[1] != block_hashes(a, 16)[1]  # a chain: block 0 counts
    assert block_hashes(a, 8)[:1] != block_hashes(a, 16)[:1]
    assert reusable_blocks(32, 16) == 1  # the last token is always computed
    assert reusable_blocks(33, 16) == 2


def test_cache_evicts_least_recent_tails_first_and_never_pinned_blocks() -> None:
    limit = [10 * 64]
    cache = PrefixCache(4, lambda: limit[0])
    tensor = torch.zeros(1, 40, 16, dtype=torch.uint8)  # 16 B per token: 64 B per block
    first, second = ids(20, 1), ids(20, 2)
    events = cache.subscribe()
    cache.insert(cache.hashes(first), [tensor], [1])
    cache.insert(cache.hashes(second), [tensor], [1])
    assert cache.bytes == 10 * 64 and len(cache.blocks) == 10
    pinned = cache.pin(cache.hashes(first)[:2])
    limit[0] = 4 * 64
    cache.fit()
    kept = set(cache.blocks)
    # second's chain was touched last: its root stays; first's tail went before its root
    assert cache.hashes(second)[0] in kept and cache.hashes(first)[4] not in kept
    assert all(b.hash in kept for b in pinned)
    limit[0] = 0
    cache.unpin(pinned)
    assert not cache.blocks and cache.bytes == 0
    snapshot = events.get_nowait()
    assert snapshot is not None and snapshot.cleared and not snapshot.stored
    seen: set[int] = set()
    while not events.empty():
        ev = events.get_nowait()
        assert ev is not None
        seen |= set(ev.stored)
        seen -= set(ev.removed)
    assert seen == set()  # stored then removed: a watcher ends with what the cache holds


# --- the pair -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference() -> Any:
    """The same model built in this process: what plain local greedy decoding produces."""
    return greedy_reference()


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=[False, True],
                        ids=["whole", "streamed"])  # fmt: skip
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Gateway, Any, Any]]:
    async with inprocess_pair([*SETS, f"kv.streaming={str(request.param).lower()}"]) as p:
        yield p


async def post(
    gw: Gateway, prompt: list[int], route: str = "auto", n: int = 8, status: int = 200, **extra: Any
) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": n, "pdx_route": route, "return_token_ids": True,
            "ignore_eos": True, **extra}  # fmt: skip
    url = f"http://127.0.0.1:{gw.port}/v1/completions"
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == status, await r.text()
        data: dict[str, Any] = await r.json()
        return data


async def router_sees(gw: Gateway, prompt: list[int], tokens: int) -> None:
    """Wait (bounded) until the gateway's view of decode-0 holds ``tokens`` of ``prompt``."""
    d = gw.router.decodes[0]
    for _ in range(200):
        if d.block_tokens and d.cached_tokens(block_hashes(prompt, 16), len(prompt)) >= tokens:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"decode's cache events never showed {tokens} tokens")


@aio
async def test_second_turn_ships_only_its_new_suffix(
    pair: tuple[Gateway, Any, Any], reference: Any
) -> None:
    gw, _prefill, decode = pair
    turn1 = ids(80, 3)
    turn2 = turn1 + ids(40, 4)
    first = await post(gw, turn1, "disaggregated")
    assert first["pdx"]["kv_start_token"] == 0 and first["pdx"]["cached_tokens"] == 0
    assert 79 * BYTES_PER_TOKEN < first["pdx"]["kv_bytes"] < 82 * BYTES_PER_TOKEN
    await router_sees(gw, turn2, 80)
    second = await post(gw, turn2, "disaggregated")
    pdx = second["pdx"]
    assert pdx["route"] == "disaggregated" and not pdx["degraded"], pdx
    assert pdx["offload"]["cached_tokens"] == 80 and pdx["kv_start_token"] == 80
    assert pdx["cached_tokens"] == 80  # decode stitched its 80 with the 40 received
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 80}  # as OpenAI names it
    assert pdx["prefill_cached_tokens"] == 80  # and prefill computed only the 40 new ones
    assert 40 * BYTES_PER_TOKEN <= pdx["kv_bytes"] < 42 * BYTES_PER_TOKEN
    assert second["choices"][0]["token_ids"] == reference(turn2, 8)
    assert first["choices"][0]["token_ids"] == reference(turn1, 8)
    assert decode.engine.cache.describe()["hit_tokens"] >= 80


@aio
async def test_local_prefill_reuses_decode_cache_with_identical_tokens(
    pair: tuple[Gateway, Any, Any], reference: Any
) -> None:
    gw, _, _ = pair
    base = ids(64, 5)
    await post(gw, base, "local")
    longer = base + ids(20, 6)
    again = await post(gw, longer, "local")
    assert again["pdx"]["cached_tokens"] == 64 and again["pdx"]["route"] == "local"
    assert again["choices"][0]["token_ids"] == reference(longer, 8)


@aio
async def test_uncached_policy_keeps_a_cached_prompt_local(pair: tuple[Gateway, Any, Any]) -> None:
    gw, _, _ = pair
    prompt = ids(100, 7)
    offload = gw.router.cfg.offload
    try:
        first = await post(gw, prompt)
        assert first["pdx"]["route"] == "disaggregated"  # nothing cached: 100 >= 32
        await router_sees(gw, prompt, 96)
        again = await post(gw, prompt)
        assert again["pdx"]["route"] == "local" and not again["pdx"]["degraded"]
        assert again["pdx"]["offload"] == {"policy": "uncached", "threshold_tokens": 32,
                                           "cached_tokens": 96, "uncached_tokens": 4,
                                           "predicted_remote_ms": None,
                                           "predicted_local_ms": None, "explore": None,
                                           "path": "local"}  # fmt: skip
        # the request's own policy: the rule before caches, 100 >= 32 ships the whole prompt
        length = await post(gw, prompt, pdx_offload={"policy": "length"})
        assert length["pdx"]["route"] == "disaggregated" and length["pdx"]["kv_start_token"] == 0
        assert length["pdx"]["offload"]["cached_tokens"] == 96  # known, not used by the rule
        assert length["pdx"]["offload"]["policy"] == "length"
        assert length["pdx"]["kv_bytes"] >= 100 * BYTES_PER_TOKEN
        offload.policy = "length"  # and the deploy's: a request may ask for uncached instead
        own = await post(gw, prompt, pdx_offload={"policy": "uncached", "threshold_tokens": 4})
        assert own["pdx"]["offload"]["policy"] == "uncached"
        assert own["pdx"]["route"] == "disaggregated" and own["pdx"]["kv_start_token"] == 96
        assert own["pdx"]["kv_bytes"] < 6 * BYTES_PER_TOKEN  # the 4 tokens decode lacks
    finally:
        offload.policy = "uncached"
    for bad, field in (({"policy": "cheapest"}, "policy"), ({"threshold": 3}, "threshold"),
                       ({"threshold_tokens": -1}, "threshold_tokens")):  # fmt: skip
        err = await post(gw, prompt, status=400, pdx_offload=bad)
        assert field in err["error"]["message"] and "pdx_offload" in err["error"]["message"], err


@aio
async def test_a_cache_salt_shares_no_blocks_with_other_salts(
    pair: tuple[Gateway, Any, Any], reference: Any
) -> None:
    gw, _, _ = pair
    prompt = ids(70, 11)
    await post(gw, prompt, "local", cache_salt="tenant-a")
    same = await post(gw, prompt, "local", cache_salt="tenant-a")
    other = await post(gw, prompt, "local", cache_salt="tenant-b")
    plain = await post(gw, prompt, "local")
    assert same["pdx"]["cached_tokens"] == 64
    assert other["pdx"]["cached_tokens"] == 0 and plain["pdx"]["cached_tokens"] == 0
    # the router looks the salted prompt up with its salt too, and prefill keeps salts apart
    assert gw.router._cached(prompt, len(prompt), "tenant-a") == {"decode-0": 64}
    shipped = await post(gw, prompt + ids(20, 12), "disaggregated", cache_salt="tenant-b")
    assert shipped["pdx"]["kv_start_token"] == 64 and shipped["pdx"]["prefill_cached_tokens"] == 0
    assert shipped["choices"][0]["token_ids"] == reference(prompt + ids(20, 12), 8)


@aio
async def test_decode_degrades_when_the_prefix_it_was_sent_for_is_gone(
    pair: tuple[Gateway, Any, Any], reference: Any
) -> None:
    gw, _, decode = pair
    prompt = ids(50, 8)  # never seen: decode holds none of it
    stub = gw.router.decodes[0].stub
    req = serving_pb2.GenerateRequest(
        request_id="evicted", prompt_token_ids=prompt, kv_id="0" * 32,
        kv_endpoint=f"127.0.0.1:{decode.port}", kv_start_token=16,
        sampling=serving_pb2.SamplingParams(max_tokens=4, ignore_eos=True),
    )  # fmt: skip
    chunks = [c async for c in stub.Generate(req)]
    st = chunks[-1].stats
    assert st.degraded and st.degrade_reason == "decode_prefix_evicted" and st.route == "local"
    assert [t for c in chunks for t in c.token_ids] == reference(prompt, 4)
    bad = serving_pb2.GenerateRequest()
    bad.CopyFrom(req)
    bad.kv_start_token = 10  # not a whole number of blocks
    with pytest.raises(grpc.aio.AioRpcError) as err:
        _ = [c async for c in stub.Generate(bad)]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "multiple of the cache's 16-token blocks" in (err.value.details() or "")


@aio
async def test_kv_of_the_wrong_range_is_never_stitched(
    pair: tuple[Gateway, Any, Any], reference: Any
) -> None:
    gw, _, _ = pair
    prompt = ids(64, 9)
    await post(gw, prompt, "local")  # decode now holds its first 48 tokens
    await router_sees(gw, prompt, 48)
    sampling = serving_pb2.SamplingParams(max_tokens=4, ignore_eos=True)
    events = gw.router.prefills[0].stub.PrefillStream(serving_pb2.PrefillRequest(
        request_id="whole", token_ids=prompt, sampling=sampling))  # fmt: skip
    stored = [e.stored async for e in events if e.HasField("stored")].pop()  # the whole prompt
    req = serving_pb2.GenerateRequest(
        request_id="range", prompt_token_ids=prompt, sampling=sampling, kv_id=stored.kv_id,
        kv_endpoint=stored.kv_endpoint, kv_start_token=16,  # says: tokens 16.. only
    )  # fmt: skip
    chunks = [c async for c in gw.router.decodes[0].stub.Generate(req)]
    st = chunks[-1].stats
    assert st.degraded and st.degrade_reason == "kv_range_mismatch" and st.route == "local"
    assert [t for c in chunks for t in c.token_ids] == reference(prompt, 4)


@aio
async def test_break_even_measures_both_paths_then_predicts(pair: tuple[Gateway, Any, Any]) -> None:
    gw, _, _ = pair
    offload = gw.router.cfg.offload
    gw.router.rates.__init__()  # type: ignore[misc]  # nothing measured yet
    try:
        offload.policy = "break_even"
        got = [(await post(gw, ids(80, 20 + i)))["pdx"]["offload"] for i in range(4)]
    finally:
        offload.policy = "uncached"
    assert [o["explore"] for o in got[:2]] == ["local", "remote"]
    assert [o["path"] for o in got[:2]] == ["local", "disaggregated"]
    last = got[-1]
    assert last["explore"] is None and last["predicted_remote_ms"] > 0
    assert last["predicted_local_ms"] > 0
    chosen = (
        "disaggregated" if last["predicted_remote_ms"] < last["predicted_local_ms"] else "local"
    )
    assert last["path"] == chosen
    rates = gw.router.rates
    assert rates.rtt_ms.value is not None and 0 <= rates.rtt_ms.value < 1000


def test_a_large_cache_snapshot_is_sent_in_batches_and_a_lagging_watcher_dropped() -> None:
    from pdx.serving import prefix_cache as pc

    cache = PrefixCache(1, lambda: 10**9)
    tensor = torch.zeros(1, pc.SNAPSHOT_BATCH + 10, 1, dtype=torch.uint8)
    cache.insert(cache.hashes(list(range(pc.SNAPSHOT_BATCH + 10))), [tensor], [1])
    queue = cache.subscribe()
    first, second = queue.get_nowait(), queue.get_nowait()
    assert first is not None and second is not None and queue.empty()
    assert first.cleared and len(first.stored) == pc.SNAPSHOT_BATCH and len(second.stored) == 10
    for i in range(pc.EVENT_QUEUE_MAX + 1):  # nobody reads: dropped, told with None
        cache.insert([10**12 + i], [tensor], [1])
    assert cache.subscribers == 0
    items = [queue.get_nowait() for _ in range(queue.qsize())]
    assert items[-1] is None
