"""Router: documented score, early rejection, stickiness, local threshold, circuit breaker."""

from __future__ import annotations

import time

from pdx.serving.deploy_config import RouterConfig
from pdx.serving.router import CircuitBreaker, DecodeInstance, PrefillInstance, Router


def decode(name: str, free: int = 100, queue: int = 0, in_flight: int = 0) -> DecodeInstance:
    return DecodeInstance(
        name, "127.0.0.1:1", healthy=True, queue_depth=queue, max_batch=2, max_queue=2,
        kv_budget_bytes=100, kv_free_bytes=free, in_flight=in_flight,
    )  # fmt: skip


def router(*decodes: DecodeInstance, threshold: int = 16, **cfg: object) -> Router:
    r = Router(RouterConfig.model_validate(cfg), threshold, list(decodes))
    r.prefills = [PrefillInstance("prefill-0", "127.0.0.1:2")]
    return r


def test_score_prefers_free_memory_and_short_queue() -> None:
    a, b = decode("a", free=20), decode("b", free=90)
    assert router(a, b).pick_decode(None) is b
    c, d = decode("c", queue=3), decode("d", queue=0)
    assert router(c, d).pick_decode(None) is d
    assert d.score() == 1.0 and c.score() == 1.0 - 3 / 4


def test_no_capacity_means_rejection_not_queueing() -> None:
    full = decode("a", in_flight=4)
    sick = decode("b")
    sick.healthy = False
    assert router(full, sick).decide("auto", 100, None) is None


def test_user_sticks_to_its_instance_while_it_has_room() -> None:
    a, b = decode("a", free=50), decode("b", free=90)
    r = router(a, b)
    assert r.pick_decode("alice") is b
    b.kv_free_bytes = 10  # b is now the worse choice, but alice's KV lives there
    assert r.pick_decode("alice") is b
    assert r.pick_decode("bob") is a
    b.in_flight = 4  # full: stickiness yields to capacity
    assert r.pick_decode("alice") is a


def test_a_request_goes_where_its_kv_fits_now() -> None:
    """Candidacy and score count this request's reservation: 1 byte per token here."""
    busy, roomy = decode("busy", free=10), decode("roomy", free=60)
    busy.kv_bytes_per_token = roomy.kv_bytes_per_token = 1.0
    busy.polled(100, 10)  # others hold 90 there, 40 on roomy (this gateway: nothing yet)
    roomy.polled(100, 60)
    r = router(busy, roomy)
    assert busy.score(8) is not None and busy.score(11) is None  # 8 fit in 10, 11 do not
    assert r.decide("local", 40, None, max_tokens=10).decode is roomy  # 50 only fit roomy
    assert roomy.score(50) == (60 - 50) / 100
    assert r.decide("local", 50, None, max_tokens=20) is None  # 70 fit nowhere now: 429
    assert r.too_large(70) is None  # ... but fit a whole budget: waiting would help
    assert r.too_large(101) == (101, 100)  # larger than every budget: refused outright
    sticky = router(busy, roomy)
    sticky.sticky["alice"] = "busy"
    assert sticky.pick_decode("alice", 30) is roomy  # her instance cannot take this one


def test_free_kv_counts_this_gateways_own_requests_between_polls() -> None:
    """A poll lags: this gateway's own sends and ends count at once, others' at the poll."""
    d = decode("d")
    d.kv_bytes_per_token = 1.0
    d.polled(100, 70)  # 30 held by others
    assert d.kv_free_now() == 70 and d.score(70) is not None and d.score(71) is None
    d.kv_reserved_here += 50  # sent a request that reserves 50
    assert d.kv_free_now() == 20  # counted at once, before any poll
    d.polled(100, 70)  # a poll before decode reserved it reads others low (decode still
    assert d.kv_others == 0 and d.kv_free_now() == 50  # holds its budget) until the next one
    d.polled(100, 20)  # decode reserved it: 30 by others again
    assert d.kv_others == 30 and d.kv_free_now() == 20
    d.kv_reserved_here -= 50  # it ended: free at once, before the next poll
    assert d.kv_free_now() == 70


def test_sticky_map_is_bounded() -> None:
    r = router(decode("a"), sticky_entries=3)
    for i in range(10):
        r.pick_decode(f"user-{i}")
    assert list(r.sticky) == ["user-7", "user-8", "user-9"]


def test_short_prompts_prefill_locally_long_ones_ship() -> None:
    r = router(decode("a"), threshold=16)
    assert r.decide("auto", 15, None).route == "local"  # type: ignore[union-attr]
    assert r.decide("auto", 16, None).route == "disaggregated"  # type: ignore[union-attr]
    assert r.decide("disaggregated", 1, None).route == "disaggregated"  # type: ignore[union-attr]
    assert r.decide("local", 5000, None).route == "local"  # type: ignore[union-attr]


def test_no_prefill_instance_degrades_to_local() -> None:
    r = router(decode("a"))
    r.prefills[0].healthy = False
    d = r.decide("auto", 100, None)
    assert d is not None and d.route == "local" and d.degrade_reason == "prefill_unavailable"


def test_breaker_opens_on_success_rate_and_routes_local() -> None:
    r = router(decode("a"), breaker_min_samples=10, success_rate_threshold=0.9)
    for i in range(10):
        r.breaker.record(ok=i % 3 != 0, transfer_ms=1.0)  # 6/10 ok
    assert r.breaker.state == "open" and r.breaker.reason == "success_rate"
    d = r.decide("auto", 100, None)
    assert d is not None and d.route == "local"
    assert d.degrade_reason == "circuit_open:success_rate"
    # A forced path is still honoured (tests compare paths with it).
    assert r.decide("disaggregated", 100, None).route == "disaggregated"  # type: ignore[union-attr]


def test_breaker_opens_on_p99_and_half_open_probe_closes_it() -> None:
    cfg = RouterConfig(breaker_min_samples=10, degrade_p99_ms=50, breaker_open_s=0.05)
    br = CircuitBreaker(cfg)
    for _ in range(9):
        br.record(True, 5.0)
    assert br.state == "closed"
    br.record(True, 80.0)  # p99 of 10 samples is the slowest one
    assert br.state == "open" and br.reason == "transfer_p99"
    assert not br.allow()
    time.sleep(0.06)
    assert br.allow()  # the one half-open probe
    assert not br.allow()  # only one at a time
    br.record(True, 5.0)
    assert br.state == "closed" and len(br.window) == 0


def test_the_breaker_bound_is_a_share_of_the_ttft_budget_unless_given() -> None:
    assert RouterConfig().breaker_p99_ms == 400.0  # 0.2 x 2000 ms, not a loopback figure
    assert RouterConfig(ttft_budget_ms=5000).breaker_p99_ms == 1000.0
    assert RouterConfig(degrade_share_of_ttft=0.1, ttft_budget_ms=5000).breaker_p99_ms == 500.0
    assert RouterConfig(degrade_p99_ms=50, ttft_budget_ms=5000).breaker_p99_ms == 50.0
    # what pdx deploy runs with no config file: the embedded default YAML names no bound
    from pdx.serving.deploy_config import load_deploy_config

    assert load_deploy_config().router.breaker_p99_ms == 400.0
    sets = ["router.ttft_budget_ms=8000"]  # what pdx accept passes for an 8 s TTFT criterion
    assert load_deploy_config(dotted=sets).router.breaker_p99_ms == 1600.0
    br = CircuitBreaker(RouterConfig(breaker_min_samples=5, ttft_budget_ms=1000))
    for _ in range(5):
        br.record(True, 150.0)  # a WAN transfer well inside 20 % of a 1 s TTFT
    assert br.state == "closed"
    br.record(True, 250.0)
    assert br.state == "open" and br.reason == "transfer_p99"


def test_failed_probe_reopens() -> None:
    br = CircuitBreaker(RouterConfig(breaker_min_samples=5, breaker_open_s=0.01))
    for _ in range(5):
        br.record(False, 0.0)
    assert br.state == "open"
    time.sleep(0.02)
    assert br.allow()
    br.record(False, 0.0)
    assert br.state == "open" and br.reason == "probe_failed"


def test_a_probe_that_never_reports_is_given_back_not_held_forever() -> None:
    r = router(decode("a"), breaker_min_samples=5, breaker_open_s=0.01)
    for _ in range(5):
        r.breaker.record(False, 0.0)
    time.sleep(0.02)
    probe = r.decide("auto", 100, None)
    assert probe is not None and probe.route == "disaggregated" and probe.breaker_probe
    held = r.decide("auto", 100, None)  # only one probe at a time
    assert held is not None and held.route == "local" and not held.breaker_probe
    r.breaker.abandon(probe.breaker_probe - 1)  # an older grant's release changes nothing
    assert r.decide("auto", 100, None).route == "local"  # type: ignore[union-attr]
    r.breaker.abandon(probe.breaker_probe)  # its client left before any transfer outcome
    again = r.decide("auto", 100, None)
    assert again is not None and again.route == "disaggregated"
    assert again.breaker_probe == probe.breaker_probe + 1
    r.breaker.record(True, 1.0)
    assert r.breaker.state == "closed"
    r.breaker.abandon(again.breaker_probe)  # after its outcome: nothing to give back
    assert r.breaker.state == "closed" and r.decide("auto", 100, None).breaker_probe == 0  # type: ignore[union-attr]


def test_local_threshold_is_the_measure_kv_break_even_of_the_deployed_model() -> None:
    from pdx.serving.deploy_config import NEVER_SHIP, load_deploy_config, local_prefill_threshold

    tiny = load_deploy_config()
    # At the configured 50 TFLOP/s a 100k-parameter model recomputes faster than any transfer;
    # at what a CPU measures for it (0.01 TFLOP/s) a prompt of a few dozen tokens ships.
    assert local_prefill_threshold(tiny) == NEVER_SHIP
    measured = local_prefill_threshold(tiny, prefill_tflops=0.01)
    assert 20 < measured < 200
    unknown = load_deploy_config(dotted=["model.backend=synthetic", "model.preset=nosuch"])
    assert local_prefill_threshold(unknown) == 1024
    assert (
        local_prefill_threshold(load_deploy_config(dotted=["router.local_prefill_max_tokens=7"]))
        == 7
    )
    sets = ["model.backend=synthetic", "model.preset=llama-3.1-70b", "router.link_gbps=10",
            "model.prefill_tflops=400", "router.transfer_overhead_ms=1"]  # fmt: skip
    seq = local_prefill_threshold(load_deploy_config(dotted=sets))

    def ships(n: int) -> bool:  # transfer (1 ms + bytes / 10 Gbps) beats recompute (2·n·P / FLOP/s)
        kv_bytes = n * 327_680  # Llama-3.1-70B bf16
        params = 70.55e9  # active parameters measure-kv counts for the preset
        return 1e-3 + kv_bytes * 8 / 10e9 < 2 * n * params / 400e12

    assert ships(seq) and not ships(seq - 1)
