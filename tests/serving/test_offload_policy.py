"""Offload policies in the router: uncached length, and break_even on rates measured live."""

from __future__ import annotations

from pdx.serving.deploy_config import RouterConfig
from pdx.serving.offload_rates import LiveRates
from pdx.serving.prefix_cache import block_hashes
from pdx.serving.router import DecodeInstance, PrefillInstance, Router


def decode(name: str, blocks: list[int] | None = None) -> DecodeInstance:
    d = DecodeInstance(name, "127.0.0.1:1", healthy=True, max_batch=4, max_queue=4,
                       kv_budget_bytes=10**9, kv_free_bytes=10**9,
                       kv_bytes_per_token=1000.0)  # fmt: skip
    d.block_tokens, d.cached_blocks = 16, set(blocks or [])
    return d


def router(policy: str, *decodes: DecodeInstance, threshold: int = 32) -> Router:
    r = Router(RouterConfig.model_validate({"offload": {"policy": policy}}), threshold,
               list(decodes))  # fmt: skip
    r.prefills = [PrefillInstance("prefill-0", "127.0.0.1:2")]
    return r


PROMPT = list(range(4, 104))  # 100 tokens: 6 whole blocks of 16


def test_uncached_picks_the_decode_that_holds_the_prompt_and_ships_the_rest() -> None:
    held = decode("b", block_hashes(PROMPT, 16)[:4])  # 64 tokens
    r = router("uncached", decode("a"), held)
    d = r.decide("auto", 100, None, 8, PROMPT)
    assert d is not None and d.decode is held and d.route == "disaggregated"
    assert (d.cached_tokens, d.uncached_tokens, d.kv_start_token) == (64, 36, 64)
    length = router("length", decode("a"), decode("b", block_hashes(PROMPT, 16)[:4]))
    d = length.decide("auto", 100, None, 8, PROMPT)
    assert d is not None and d.kv_start_token == 0 and d.route == "disaggregated"
    assert d.decode.name == "a"  # load alone: the first of two equal scores


def test_a_prefix_broken_in_the_middle_counts_only_up_to_the_break() -> None:
    hashes = block_hashes(PROMPT, 16)
    d = decode("a", [hashes[0], hashes[2], hashes[3]])
    assert d.cached_tokens(hashes, 100) == 16
    assert decode("a", hashes).cached_tokens(hashes, 96) == 80  # the last token is computed


def feed(rates: LiveRates, goodput_bytes_per_ms: float, n: int = 8) -> None:
    for _ in range(n):  # 20 ms RTT, 1 ms per token at prefill, 100,000 B per transfer
        rates.observe_remote(prefill_ms=32.0, queue_ms=0.0, computed_tokens=32,
                             first_event_ms=52.0, kv_bytes=100_000,
                             transfer_ms=20.0 + 100_000 / goodput_bytes_per_ms)  # fmt: skip


def test_live_rates_follow_a_link_that_halves() -> None:
    rates = LiveRates()
    assert rates.predict(32, 32_000) is None and rates.stale() == "local"
    feed(rates, 1000.0)
    rates.observe_local(local_prefill_ms=160.0, computed_tokens=32)  # 5 ms per token
    assert rates.rtt_ms.value == 20.0 and rates.goodput_bytes_per_ms.value == 1000.0
    fast = rates.predict(32, 32_000)
    assert fast is not None and fast.remote  # 32 + 40 + 32 = 104 ms < 160 ms
    feed(rates, 250.0, n=8)  # a quarter of the rate: 8 transfers move the estimate
    slow = rates.predict(32, 32_000)
    assert slow is not None and not slow.remote and slow.remote_ms > 160


def test_break_even_explores_a_stale_path_once_then_decides_on_the_prediction() -> None:
    r = router("break_even", decode("a"))
    first = r.decide("auto", 100, None, 8, PROMPT)
    assert first is not None and first.explore == "local" and first.route == "local"
    second = r.decide("auto", 100, None, 8, PROMPT)  # one exploration at a time: the rule
    assert second is not None and not second.explore and second.route == "disaggregated"
    r.rates.exploring = ""
    feed(r.rates, 1000.0)
    r.rates.observe_local(local_prefill_ms=500.0, computed_tokens=100)
    d = r.decide("auto", 100, None, 8, PROMPT)
    assert d is not None and d.route == "disaggregated" and d.predicted is not None
    assert d.offload()["predicted_local_ms"] == 500.0
    r.rates.observe_local(local_prefill_ms=10.0, computed_tokens=100)  # decode got fast
    for _ in range(10):
        r.rates.observe_local(local_prefill_ms=10.0, computed_tokens=100)
    d = r.decide("auto", 100, None, 8, PROMPT)
    assert d is not None and d.route == "local" and d.offload()["path"] == "local"


def test_decode_s_own_queue_of_local_prefills_counts_against_local() -> None:
    rates = LiveRates()
    feed(rates, 1000.0)
    rates.observe_local(local_prefill_ms=96.0, computed_tokens=32)  # 3 ms per token
    idle = rates.predict(32, 32_000)
    busy = rates.predict(32, 32_000, pending_tokens=64)  # two local prefills ahead of it
    assert idle is not None and busy is not None
    assert idle.local_ms == 96.0 and busy.local_ms == 288.0
    assert not idle.remote and busy.remote  # remote: 32 + 40 + 32 = 104 ms
