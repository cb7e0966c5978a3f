"""Which connection between the sites is the KV's, and its RTT over a step, from ``ss`` readings
(:func:`pdx.accept.target.netns.busiest_during`): readings shaped as ``tcp_connections`` parses
them; the real ones are taken by the netns and vLLM cross-site tests."""

from __future__ import annotations

from typing import Any

from pdx.accept.target.netns import busiest_during

OLD = ("10.77.1.1:4000", "10.77.2.1:5000")  # busy before the step, idle during it
KV = ("10.77.1.1:4001", "10.77.2.1:5001")
NEW = ("10.77.1.1:4002", "10.77.2.1:5002")


def conn(which: tuple[str, str], acked: int, min_rtt: float, rtt: float = 45.0) -> dict[str, Any]:
    return {"local": which[0], "peer": which[1], "bytes_acked": acked, "min_rtt_ms": min_rtt,
            "rtt_ms": rtt}  # fmt: skip


def test_the_connection_that_moved_most_during_the_step_and_its_median_window() -> None:
    readings = [
        [conn(OLD, 10_000_000, 40.2), conn(KV, 1_000, 40.1)],
        [conn(OLD, 10_000_000, 40.2), conn(KV, 2_000_000, 40.3)],
        [conn(OLD, 10_000_000, 40.2), conn(KV, 4_000_000, 40.6)],
        # a cut: the window after it carries the retransmissions' samples
        [conn(OLD, 10_000_000, 40.2), conn(KV, 4_100_000, 232.0, rtt=2630.0)],
        [conn(OLD, 10_000_000, 40.2), conn(KV, 6_000_000, 41.0)],
        # no bytes moved in the last window: its reading says nothing of this window
        [conn(OLD, 10_000_000, 40.2), conn(KV, 6_000_000, 300.0, rtt=2630.0)],
    ]
    kv = busiest_during(readings)
    assert kv is not None and (kv["local"], kv["peer"]) == KV
    assert kv["bytes_acked_step"] == 6_000_000 - 1_000
    assert kv["min_rtt_windows_ms"] == [40.3, 40.6, 232.0, 41.0]
    assert kv["min_rtt_step_ms"] == (40.6 + 41.0) / 2
    assert kv["rtt_ms"] == 2630.0 and kv["min_rtt_ms"] == 300.0  # the end reading's own


def test_a_connection_opened_during_the_step_counts_from_zero() -> None:
    readings = [
        [conn(OLD, 10_000_000, 40.2)],
        [conn(OLD, 11_000_000, 40.2), conn(NEW, 1_500_000, 40.4)],
        [conn(OLD, 11_000_000, 40.2), conn(NEW, 3_000_000, 40.8)],
    ]
    kv = busiest_during(readings)
    assert kv is not None and (kv["local"], kv["peer"]) == NEW
    assert kv["bytes_acked_step"] == 3_000_000 and kv["min_rtt_windows_ms"] == [40.4, 40.8]


def test_nothing_moved_or_nothing_read() -> None:
    assert busiest_during([]) is None and busiest_during([[], []]) is None
    idle = busiest_during([[conn(KV, 5, 40.0)], [conn(KV, 5, 40.0)]])
    assert idle is not None and idle["min_rtt_step_ms"] is None and idle["min_rtt_windows_ms"] == []
