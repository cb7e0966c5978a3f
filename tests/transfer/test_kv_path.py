"""Deadlines that fit the link: the documented formula, what the client measures, records."""

from __future__ import annotations

import pytest

from pdx.link.probe import recommend
from pdx.serving.deploy_config import load_deploy_config
from pdx.transfer.client import RECONNECT_OPTIONS, KVClient
from pdx.transfer.path import (
    ASSUMED_GOODPUT_BPS,
    COLD_SETUP_MS,
    DEADLINE_FLOOR_MS,
    MAX_REGRANT_MS,
    PathEstimate,
    derived_deadline_ms,
    regranted_ms,
)


def test_the_formula() -> None:
    # 300 MB at 1 Gbit/s over 50 ms RTT, warm: 300 + 10 x 50 + 2 x 2400 ms
    assert derived_deadline_ms(300_000_000, 50.0, 1e9, cold=False) == pytest.approx(5600.0)
    # a cold client adds the connection set-up allowance
    assert derived_deadline_ms(0, 0.0, 1e9, cold=True) == DEADLINE_FLOOR_MS + COLD_SETUP_MS
    # loopback, small object: the contract's 300 ms floor
    assert derived_deadline_ms(24_576, 0.05, 10e9, cold=False) == pytest.approx(300.5, abs=0.1)


def test_the_estimate_learns_rtt_and_goodput_and_an_explicit_timeout_wins() -> None:
    path = PathEstimate()
    cold = path.deadline(10 << 20, None)
    assert cold.source == "derived" and cold.rtt_ms is None
    expected = derived_deadline_ms(10 << 20, 0.0, ASSUMED_GOODPUT_BPS, cold=True)
    assert cold.ms == pytest.approx(expected, abs=0.1)
    path.observe_rtt(120.0)  # a first call that also set up the channel
    path.observe_rtt(50.0)  # TCP's own handshake RTT
    path.observe_rtt(0.0)  # ignored
    path.observe_success(100 << 20, 1.0)  # 0.84 Gbit/s
    path.observe_success(1000, 0.001)  # too small to measure goodput
    warm = path.deadline(100 << 20, None)
    assert warm.rtt_ms == 50.0 and warm.goodput_gbps == pytest.approx(0.8389, abs=1e-3)
    assert warm.ms == pytest.approx(
        derived_deadline_ms(100 << 20, 50.0, (100 << 20) * 8, False), abs=0.1
    )
    assert path.deadline(None, None).ms == warm.ms  # unknown size: the largest seen
    fixed = path.deadline(100 << 20, 300)
    assert (fixed.ms, fixed.source) == (300.0, "explicit")
    hinted = PathEstimate(link_gbps=10.0).deadline(1 << 30, None)
    assert hinted.goodput_gbps == 10.0


def test_a_timeout_lowers_the_estimate_and_a_dripping_peer_cannot_stretch_the_deadline() -> None:
    path = PathEstimate()
    path.observe_success(100 << 20, 0.1)  # 8.4 Gbit/s
    path.observe_timeout(0, 1.0)  # nothing moved: a dead link teaches nothing
    assert path.goodput_bps == pytest.approx((100 << 20) * 80)
    path.observe_timeout(5_000_000, 1.0)  # 40 Mbit/s is all it got
    assert path.goodput_bps == pytest.approx(40e6)
    path.observe_timeout(50_000_000, 1.0)  # a faster timed-out sample never raises it
    assert path.goodput_bps == pytest.approx(40e6)
    assert regranted_ms(1000.0, 1) == 1000.0 and regranted_ms(1000.0, 3) == 4000.0
    # A store dripping 64 KiB a minute: 8 Mbit of KV would derive hours; the store cuts at 300 s.
    path.observe_timeout(65_536, 60.0)
    drip = path.deadline(1 << 30, None).ms
    assert drip > 1e7 and regranted_ms(drip, 1) == MAX_REGRANT_MS


def test_a_connection_attempt_outlives_a_300ms_handshake() -> None:
    opts = dict(RECONNECT_OPTIONS)
    assert opts["grpc.min_reconnect_backoff_ms"] >= 4 * 300  # TCP + TLS + SETTINGS at 300 ms
    assert opts["grpc.initial_reconnect_backoff_ms"] <= 100  # a healed link is used again soon


async def test_records_say_how_each_transfer_travelled_and_its_deadline(
    kv_server_factory, kv_client_cfg
) -> None:
    _, target = await kv_server_factory()
    cfg = kv_client_cfg(kv_transfer_timeout_ms=None)
    async with KVClient(target, cfg) as kv:
        kv_id = await kv.put(b"z" * 3_000_000)
        await kv.get(kv_id, size_hint=3_000_000)
        await kv.release(kv_id)
    put, get, release = kv.records()
    for rec in (put, get):
        assert rec.transport == cfg.transport
        assert rec.deadline_source == "derived" and rec.deadline_ms >= DEADLINE_FLOOR_MS
        assert rec.streams == 1 and rec.connections == 1
        # the data plane's TCP measured the RTT; over gRPC only small calls do
        assert rec.rtt_ms is not None or cfg.transport == "grpc"
        assert rec.congestion_control  # the data plane's socket, or the system's for gRPC
    assert put.deadline_ms > get.deadline_ms  # cold first, then warm
    assert release.transport is None and release.deadline_source == "derived"
    sample = kv.metrics.value(
        "pdx_kv_transfers_total", op="put", outcome="ok", transport=cfg.transport,
        congestion_control=put.congestion_control,
    )  # fmt: skip
    assert sample == 1


def test_probe_recommendations_are_accepted_by_deploy_as_printed() -> None:
    measured = (("up", 1, 0.9), ("up", 4, 0.9), ("down", 1, 0.44), ("down", 4, 0.92))
    runs = [{"direction": d, "streams": n, "gbps": g, "ci95_gbps": [0.97 * g, 1.03 * g]}
            for d, n, g in measured]  # fmt: skip
    report = {
        "throughput": {"up_gbps": 0.9, "down_gbps": 0.92, "runs": runs},
        "chunk_recommended_bytes": 4 << 20,
        "tcp": {"single_stream": {
            "down": {"gbps": 0.44, "capped_by_buffers": True,
                     "cap": {"end": "server", "sysctl": "net.ipv4.tcp_wmem",
                             "would_not_cap_bytes": 12 << 20}},
            "up": {"gbps": 0.9, "capped_by_buffers": False, "cap": None}}},
    }  # fmt: skip
    rec = recommend(report)
    assert rec is not None
    # down needs the 4 streams it was measured with (one reaches 0.44 of 0.92 Gbit/s)
    assert rec["set"] == {"kv.streams": 4, "kv.link_gbps": 0.92, "kv.chunk_size_kb": 4096}
    assert rec["sysctl"] == {"server net.ipv4.tcp_wmem": f"4096 131072 {12 << 20}"}
    cfg = load_deploy_config(dotted=[f"{k}={v}" for k, v in rec["set"].items()])
    assert (cfg.kv.streams, cfg.kv.link_gbps, cfg.kv.chunk_size_kb) == (4, 0.92, 4096)


def test_a_path_whose_rtt_rose_is_judged_on_the_new_rtt() -> None:
    path = PathEstimate()
    for _ in range(20):
        path.observe_rtt(0.05)  # loopback-like, then the route changes to a far site
    path.observe_success(1000, 0.001)
    before = path.deadline(100_000, None)
    assert before.ms == pytest.approx(
        derived_deadline_ms(100_000, 0.05, ASSUMED_GOODPUT_BPS, cold=False), abs=0.1
    )
    path.observe_rtt(82.0)  # the first round trip on the new path
    after = path.deadline(100_000, None)
    assert after.rtt_ms == 82.0 and after.ms >= DEADLINE_FLOOR_MS + 10 * 82.0
    assert path.rtt_ms == 0.05  # the path's RTT: its min-RTT filter still holds the old floor
