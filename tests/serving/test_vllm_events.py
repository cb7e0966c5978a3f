"""vLLM's KV events followed by the gateway: vLLM's wire format over a real ZeroMQ socket,
re-hashed with pdx's chain so the router knows what a vLLM decode holds.

The messages are built here in vLLM's shape (``vllm/distributed/kv_events.py``: topic, 8-byte
big-endian sequence, msgpack ``[ts, [events], dp_rank]``, each event a map with its ``type``);
tests/serving/test_vllm_pd.py checks the same view against a running vLLM decode.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from pdx.errors import ConfigError
from pdx.serving.deploy_config import RouterConfig, load_deploy_config
from pdx.serving.gateway.metrics import GatewayMetrics
from pdx.serving.gateway.vllm_events import EventError, VLLMCacheView, follow_vllm_events
from pdx.serving.prefix_cache import block_hashes
from pdx.serving.router import DecodeInstance, PrefillInstance, Router

PROMPT = list(range(4, 104))  # 100 tokens: 6 whole blocks of 16


def _decode() -> DecodeInstance:
    return DecodeInstance("decode-0", "http://127.0.0.1:1", healthy=True, max_batch=4,
                          max_queue=4, kv_budget_bytes=10**6, kv_free_bytes=10**6)  # fmt: skip


def stored(
    ids: list[int], hashes: list[bytes], parent: bytes | None = None, salt: str = "",
    **extra: Any,
) -> dict[str, Any]:  # fmt: skip
    keys = [[salt] if salt and parent is None and i == 0 else None for i in range(len(hashes))]
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": ids, "block_size": 16, "lora_id": None, "medium": "GPU",
            "lora_name": None, "extra_keys": keys if any(keys) else None, "group_idx": 0,
            **extra}  # fmt: skip


def frames(seq: int, *events: dict[str, Any]) -> list[bytes]:
    payload = msgpack.packb([1.0, list(events), None], use_bin_type=True)
    return [b"kv-events", seq.to_bytes(8, "big"), payload]


def vh(i: int) -> bytes:
    """A vLLM block hash (opaque bytes to pdx)."""
    return i.to_bytes(32, "big")


def router_over(d: DecodeInstance) -> Router:
    r = Router(RouterConfig.model_validate({"offload": {"policy": "uncached"}}), 32, [d])
    r.prefills = [PrefillInstance("prefill-0", "http://127.0.0.1:2")]
    return r


def test_stored_blocks_become_the_router_s_cached_prefix_under_their_salt() -> None:
    d = _decode()
    view, r = VLLMCacheView(d), router_over(d)
    # Two events, the second chained to the first by vLLM's own parent hash.
    view.message(frames(0, stored(PROMPT[:32], [vh(1), vh(2)])))
    view.message(frames(1, stored(PROMPT[32:64], [vh(3), vh(4)], parent=vh(2))))
    assert d.block_tokens == 16 and d.cached_blocks == set(block_hashes(PROMPT, 16)[:4])
    assert r._cached(PROMPT, len(PROMPT)) == {"decode-0": 64}
    decision = r.decide("auto", len(PROMPT), None, 0, PROMPT)
    assert decision is not None and (decision.cached_tokens, decision.uncached_tokens) == (64, 36)
    # A salted chain is another chain: only requests with that salt find it.
    view.message(frames(2, stored(PROMPT[:16], [vh(9)], salt="tenant-a")))
    assert r._cached(PROMPT, len(PROMPT), "tenant-a") == {"decode-0": 16}
    assert r._cached(PROMPT, len(PROMPT), "tenant-b") == {"decode-0": 0}


def test_removed_cleared_and_reported_again() -> None:
    d = _decode()
    view = VLLMCacheView(d)
    view.message(frames(0, stored(PROMPT[:48], [vh(1), vh(2), vh(3)])))
    view.message(frames(1, stored(PROMPT[:16], [vh(1)])))  # a reused block reported again
    view.message(frames(2, {"type": "BlockRemoved", "block_hashes": [vh(3)], "medium": "GPU"}))
    assert d.cached_blocks == set(block_hashes(PROMPT, 16)[:2])
    view.message(frames(3, {"type": "BlockRemoved", "block_hashes": [vh(77)], "medium": "GPU"}))
    assert len(d.cached_blocks) == 2  # a hash it never recorded changes nothing
    view.message(frames(4, {"type": "AllBlocksCleared"}))
    assert not d.cached_blocks and not view.ours


@pytest.mark.parametrize(
    "event",
    [
        stored(PROMPT[16:32], [vh(2)], parent=vh(99)),  # a parent it never saw
        stored(PROMPT[:16], [vh(1)], lora_name="adapter-1"),
        stored(PROMPT[:16], [vh(1)], medium="CPU"),  # an offload tier, not the cache
        stored(PROMPT[:16], [vh(1)], group_idx=1),
        stored(PROMPT[:16], [vh(1)], extra_keys=[["mm-hash", 0]]),  # multimodal keys
        stored(PROMPT[:15], [vh(1)]),  # ids that are not whole blocks
    ],
    ids=["unknown-parent", "lora", "cpu-tier", "other-group", "multimodal", "short"],
)
def test_what_is_not_known_is_not_taken_as_cached(event: dict[str, Any]) -> None:
    d = _decode()
    view = VLLMCacheView(d)
    view.message(frames(0, event))
    assert not d.cached_blocks and view.skipped == 1


def test_a_gap_a_restart_or_a_bad_message_empties_the_view() -> None:
    d = _decode()
    view = VLLMCacheView(d)
    view.message(frames(5, stored(PROMPT[:16], [vh(1)])))  # first seen mid-stream: taken
    assert len(d.cached_blocks) == 1
    view.message(frames(7, stored(PROMPT[:16], [vh(1)])))  # seq 6 lost
    assert len(d.cached_blocks) == 1 and view.ours == {vh(1): block_hashes(PROMPT, 16)[0]}
    view.message(frames(8, stored(PROMPT[16:32], [vh(2)], parent=vh(1))))
    view.message(frames(0, stored(PROMPT[32:48], [vh(3)], parent=vh(2))))  # publisher restarted
    assert not d.cached_blocks  # its parent went with the restart: not known
    view.message(frames(1, stored(PROMPT[:16], [vh(1)])))
    with pytest.raises(EventError, match="seq 2"):
        view.message([b"kv-events", (2).to_bytes(8, "big"), b"\xc1 not msgpack"])
    assert not d.cached_blocks and view.seq is None
    with pytest.raises(EventError, match="frames"):
        view.message([b"kv-events", b"short"])
    view.message(frames(3, stored(PROMPT[:16], [vh(1)])))  # and it goes on after either
    assert len(d.cached_blocks) == 1


async def test_follows_a_publisher_over_zeromq_and_recovers_from_garbage(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/kv-events"
    pub = zmq.asyncio.Context.instance().socket(zmq.PUB)
    pub.bind(endpoint)
    d, metrics = _decode(), GatewayMetrics()
    task = asyncio.get_running_loop().create_task(
        follow_vllm_events(d, endpoint, metrics.cached_blocks_changed)
    )

    async def until(n: int) -> None:
        for _ in range(200):
            gauge = metrics.registry.get_sample_value(
                "pdx_gateway_decode_cached_blocks", {"instance": "decode-0"}
            )
            if gauge == n and len(d.cached_blocks) == n:
                return
            await asyncio.sleep(0.025)
        raise AssertionError(f"expected {n} blocks, have {len(d.cached_blocks)} (gauge {gauge})")

    try:
        # PUB drops what it sends before the subscriber joined: resend until it is seen.
        for seq in range(200):
            await pub.send_multipart(frames(seq, stored(PROMPT[:32], [vh(1), vh(2)])))
            await asyncio.sleep(0.025)
            if d.cached_blocks:
                break
        await until(2)
        await pub.send_multipart([b"kv-events", b"garbage"])
        await until(0)
        await pub.send_multipart(frames(1000, stored(PROMPT[:48], [vh(1), vh(2), vh(3)])))
        await until(3)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        pub.close(linger=0)
    assert not d.cached_blocks  # a follower that stopped claims nothing


def test_config_says_which_policies_vllm_can_run() -> None:
    cfg = load_deploy_config(dotted=["engine=vllm", "router.offload.policy=uncached"])
    assert cfg.vllm.kv_events and cfg.vllm.follows_caches
    cases = [
        (["vllm.kv_events=false"], "vllm.kv_events: true"),
        (["router.offload.policy=break_even"], "break_even needs engine: pdx"),
        (["vllm.decode_urls=[http://127.0.0.1:9]"], "vllm.decode_kv_events, one per"),
        (["vllm.decode_urls=[http://127.0.0.1:9]", "vllm.decode_kv_events=[tcp://*:5557]"],
         "tcp://HOST:PORT or ipc://PATH to connect to (got 'tcp://*:5557')"),
        (["vllm.decode_urls=[http://127.0.0.1:9]",
          "vllm.decode_kv_events=[tcp://127.0.0.1:5557, tcp://127.0.0.1:5558]"],
         "2 endpoints for 1 vllm.decode_urls"),
    ]  # fmt: skip
    for sets, message in cases:
        if "break_even" not in sets[0]:
            sets = ["router.offload.policy=uncached", *sets]
        with pytest.raises(ConfigError, match=r"router\.offload|vllm\.decode_kv_events") as exc:
            load_deploy_config(dotted=["engine=vllm", *sets])
        assert message in str(exc.value), (sets, str(exc.value))
    fronted = load_deploy_config(dotted=[
        "engine=vllm", "router.offload.policy=uncached", "vllm.decode_urls=[http://127.0.0.1:9]",
        "vllm.decode_kv_events=[tcp://127.0.0.1:5557]"])  # fmt: skip
    assert fronted.vllm.follows_caches
