"""The WAN emulator's pure parts: per-packet fates, the bottleneck, GSO splitting, netem args."""

from __future__ import annotations

import itertools
import random
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from pdx.errors import ConfigError, InputError
from pdx.faults.wan import netem, packets
from pdx.faults.wan.conditions import LinkConditions, make_conditions, parse_direction
from pdx.faults.wan.model import DirectionModel, geometric
from pdx.faults.wan.timeline import apply_event, parse_wan_timeline


def binomial_interval(n: int, p: float, conf: float = 0.95) -> tuple[int, int]:
    """Central interval of Binomial(n, p) holding ``conf`` of its mass."""
    lo, hi = stats.binom.interval(conf, n, p)
    return int(lo), int(hi)


def test_geometric_gaps_have_mean_one_over_p() -> None:
    rng = random.Random(1)
    gaps = [geometric(rng, 0.01) for _ in range(20_000)]
    mean = sum(gaps) / len(gaps)
    se = (0.99**0.5 / 0.01) / len(gaps) ** 0.5
    assert abs(mean - 100) < 4 * se
    assert geometric(rng, 1.0) == 1 and geometric(rng, 0.0) > 1e15


@pytest.mark.parametrize("n_per_read", [1, 7, 44])
def test_random_loss_per_wire_packet_is_binomial_whatever_the_read_size(n_per_read: int) -> None:
    model = DirectionModel(LinkConditions(loss=0.02), random.Random(3))
    reads = 60_000 // n_per_read
    lost = sum(len(model.fate(n_per_read).lost) for _ in range(reads))
    lo, hi = binomial_interval(reads * n_per_read, 0.02, 0.999)
    assert lo <= lost <= hi


def test_gilbert_loss_has_the_long_run_rate_and_mean_burst_asked_for() -> None:
    cond = LinkConditions(loss=0.05, loss_model="gilbert", loss_burst=8)
    model = DirectionModel(cond, random.Random(5))
    flags: list[bool] = []
    for _ in range(40_000):
        lost = set(model.fate(10).lost)
        flags += [i in lost for i in range(10)]
    rate = sum(flags) / len(flags)
    bursts, run = [], 0
    for f in flags:
        if f:
            run += 1
        elif run:
            bursts.append(run)
            run = 0
    assert 0.04 < rate < 0.06
    assert 6.5 < sum(bursts) / len(bursts) < 9.5


def test_a_lost_packet_is_never_also_duplicated_or_early() -> None:
    cond = LinkConditions(loss=0.3, duplicate=0.3, reorder=0.3, delay_ms=1)
    model = DirectionModel(cond, random.Random(7))
    for _ in range(2000):
        fate = model.fate(10)
        assert not set(fate.lost) & (set(fate.duplicated) | set(fate.early))
        assert all(0 <= i < 10 for i in fate.lost + fate.duplicated + fate.early)


def test_no_events_without_probabilities() -> None:
    model = DirectionModel(LinkConditions(delay_ms=5, jitter_ms=2), random.Random(0))
    assert all(model.fate(44).plain for _ in range(1000))


def test_the_bottleneck_paces_at_the_rate_and_tail_drops_past_the_queue() -> None:
    cond = LinkConditions(rate_mbit=100, queue_ms=10)  # 12.5 MB/s: 1514 B per 121.12 us
    model = DirectionModel(cond, random.Random(0))
    k, depart = model.bottleneck(0.0, 1, 1500, 1500)
    assert k == 1 and depart == pytest.approx(1514 * 8 / 100e6)
    # 44 more segments at the same instant: spaced by one frame time each
    k, depart = model.bottleneck(0.0, 44, 1500, 1000)
    assert k == 44
    assert depart == pytest.approx((44 * 1514 + 1014) * 8 / 100e6)
    # Backlog now ~5.5 ms; a burst of 100 segments fits only until 10 ms of backlog.
    backlog = model.backlog_s(0.0)
    k, _ = model.bottleneck(0.0, 100, 1500, 1500)
    assert k == int((0.010 - backlog) / (1514 * 8 / 100e6)) + 1 < 100
    assert model.bottleneck(0.0, 5, 1500, 1500)[0] == 0  # full: all tail-dropped
    assert model.bottleneck(1.0, 5, 1500, 1500)[0] == 5  # drained a second later


def test_jitter_never_reorders_and_has_the_asked_spread() -> None:
    model = DirectionModel(LinkConditions(delay_ms=20, jitter_ms=4), random.Random(11))
    dues = [model.due(i * 0.1) for i in range(4000)]  # arrivals far apart: jitter shows
    assert dues == sorted(dues)
    delays = [d - i * 0.1 for i, d in enumerate(dues)]
    mean = sum(delays) / len(delays)
    sd = (sum((x - mean) ** 2 for x in delays) / len(delays)) ** 0.5
    assert mean == pytest.approx(0.020, abs=0.0005)
    assert sd == pytest.approx(0.004, rel=0.08)


def _aggregate(payload: bytes, mss: int, flags: int = 0x18 | 0x01 | 0x80) -> bytes:
    """A TCP/IPv4 GSO aggregate as a TUN device with offloads hands it out."""
    src, dst = bytes([10, 77, 1, 1]), bytes([10, 77, 2, 1])
    tcp = bytearray(struct.pack("!HHIIBBHHH", 40000, 5201, 1_000_000, 77, 5 << 4, flags,
                                502, 0, 0))  # fmt: skip
    struct.pack_into("!H", tcp, 16, packets.tcp_pseudo_sum(src, dst, 20 + len(payload)))
    ip = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, 0, 40 + len(payload), 4242, 0x4000, 64,
                               6, 0, src, dst))  # fmt: skip
    struct.pack_into("!H", ip, 10, packets.ip_checksum(ip))
    hdr = packets.VNET.pack(packets.F_NEEDS_CSUM, packets.GSO_TCPV4, 40, mss, 20, 16)
    return hdr + bytes(ip) + bytes(tcp) + payload


def _ones_sum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return s


def _full_tcp_checksum(ip: bytes, tcp_segment: bytes) -> int:
    """Independent: the TCP checksum over pseudo-header + segment (check field zeroed)."""
    pseudo = ip[12:20] + struct.pack("!BBH", 0, 6, len(tcp_segment))
    zeroed = tcp_segment[:16] + b"\0\0" + tcp_segment[18:]
    return ~_ones_sum(pseudo + zeroed) & 0xFFFF


@settings(max_examples=60, deadline=None)
@given(
    payload_len=st.integers(min_value=1001, max_value=9000),
    mss=st.sampled_from([536, 1000, 1448]),
    cuts=st.sets(st.integers(min_value=0, max_value=20), max_size=5),
)
def test_split_makes_the_segments_the_kernel_would(
    payload_len: int, mss: int, cuts: set[int]
) -> None:
    payload = bytes(random.Random(payload_len).randbytes(payload_len))
    buf = _aggregate(payload, mss)
    agg = packets.parse(buf)
    if payload_len <= mss:
        assert agg is None
        return
    assert agg is not None
    n = agg.segments
    assert n == -(-payload_len // mss)
    bounds = sorted({0, n, *(c for c in cuts if 0 < c < n)})
    runs = list(itertools.pairwise(bounds))
    out = packets.split(buf, runs)
    assert b"".join(p[packets.VNET_LEN + 40 :] for p in out) == payload
    for (first, end), pkt in zip(runs, out, strict=True):
        flags, gso, hdr_len, gso_size, cs, co = packets.VNET.unpack_from(pkt)
        ip, tcp = pkt[packets.VNET_LEN : packets.VNET_LEN + 20], pkt[packets.VNET_LEN + 20 :]
        assert flags == packets.F_NEEDS_CSUM and (cs, co, hdr_len) == (20, 16, 40)
        assert (gso, gso_size) == ((packets.GSO_TCPV4, mss) if end - first > 1 else (0, 0))
        assert _ones_sum(ip) == 0xFFFF  # a valid IPv4 header checksum
        assert struct.unpack("!H", ip[2:4])[0] == len(pkt) - packets.VNET_LEN
        assert struct.unpack("!H", ip[4:6])[0] == 4242 + first
        assert struct.unpack("!I", tcp[4:8])[0] == 1_000_000 + first * mss
        tcp_flags = tcp[13]
        assert bool(tcp_flags & 0x80) == (first == 0)  # CWR only on the first segment
        assert bool(tcp_flags & 0x01) == (end == n) and bool(tcp_flags & 0x08) == (end == n)
        # The check field holds the pseudo-header sum: what the device then completes is
        # the correct checksum of this segment.
        completed = ~_ones_sum(tcp) & 0xFFFF
        assert completed == _full_tcp_checksum(ip, tcp)


def test_runs_without_drops_the_given_segments() -> None:
    assert packets.runs_without(6, {0, 3}) == [(1, 3), (4, 6)]
    assert packets.runs_without(3, set()) == [(0, 3)]
    assert packets.runs_without(2, {0, 1}) == []


def test_conditions_validate_with_one_line_per_field() -> None:
    with pytest.raises(ConfigError) as err:
        make_conditions({"loss": 1.5, "delay_ms": -1})
    text = str(err.value)
    assert "down.loss" in text and "down.delay_ms" in text
    with pytest.raises(ConfigError, match="reorder needs delay_ms > 0"):
        make_conditions({"reorder": 0.1})
    with pytest.raises(ConfigError, match="loss_burst > 1"):
        make_conditions({"loss": 0.01, "loss_model": "gilbert"})
    wan = make_conditions({"delay_ms": 25}, down={"rate_mbit": 200}, up={"delay_ms": 30})
    assert (wan.down.delay_ms, wan.down.rate_mbit, wan.up.delay_ms) == (25, 200, 30)
    assert wan.added_rtt_ms() == 55 and wan.needs_delay_line


def test_direction_overrides_parse_and_reject_unknown_keys() -> None:
    assert parse_direction("delay_ms=40, loss=0.001", "--up") == {"delay_ms": 40, "loss": 0.001}
    assert parse_direction("loss-model=gilbert", "--up") == {"loss_model": "gilbert"}
    with pytest.raises(InputError, match="--down: got 'latency'"):
        parse_direction("latency=4", "--down")
    with pytest.raises(InputError, match="KEY=VALUE"):
        parse_direction("delay_ms", "--down")


def test_netem_arguments_for_each_condition() -> None:
    c = LinkConditions(delay_ms=25, jitter_ms=2, loss=0.01, loss_model="gilbert", loss_burst=4,
                       duplicate=0.001, reorder=0.02, rate_mbit=1000, queue_ms=50)  # fmt: skip
    args = netem.args(c, 1500)
    p, _r = c.gilbert_p_r()
    assert args[:5] == ["delay", "25ms", "2ms", "distribution", "normal"]
    assert args[5:9] == ["loss", "gemodel", f"{p * 100:.6g}%", "25%"]
    assert "duplicate" in args and "reorder" in args
    assert args[-4:] == ["rate", "1000mbit", "limit", str(netem.limit_packets(c, 1500))]
    # the limit holds what the delay line holds plus the queue: (25 + 8 + 50) ms at 1 Gbit/s
    assert netem.limit_packets(c, 1500) == -(-int(125e6 * 0.083) // 1500)
    assert netem.args(LinkConditions(loss=0.001), 1500)[2:5] == ["loss", "random", "0.1%"]
    assert netem.per_packet(c) and not netem.per_packet(LinkConditions(delay_ms=5))


def test_netem_counters_parse_tc_output() -> None:
    text = ("qdisc netem 8001: root refcnt 2 limit 1000 delay 25ms\n"
            " Sent 123456 bytes 789 pkt (dropped 12, overlimits 0 requeues 3)\n"
            " backlog 4500b 3p requeues 3\n")  # fmt: skip
    assert netem.counters(text) == {"bytes_out": 123456, "packets_out": 789, "dropped": 12,
                                    "overlimits": 0, "requeues": 3, "queue_packets": 3}  # fmt: skip


def test_timeline_events_merge_into_the_conditions() -> None:
    tl = parse_wan_timeline(
        [
            {"at_s": 0, "set": {"delay_ms": 10}},
            {"at_s": 1, "set": {"down": {"loss": 0.05}}},
            {"at_s": 2, "cut": {"duration_s": 0.5}},
            {"at_s": 3, "reset": True},
        ]
    )
    start = make_conditions({"rate_mbit": 200})
    plan = tl.plan()
    assert [round(at, 2) for at, _ in plan] == [0, 1, 2, 2.5, 3]
    cur = start
    seen = []
    for _, event in plan:
        cur = apply_event(cur, start, event)
        seen.append((cur.down.delay_ms, cur.down.loss, cur.up.loss, cur.cut))
    assert seen == [(10, 0, 0, False), (10, 0.05, 0, False), (10, 0.05, 0, True),
                    (10, 0.05, 0, False), (0, 0, 0, False)]  # fmt: skip
    assert cur.down.rate_mbit == 200 and tl.duration_s == 3
    with pytest.raises(ConfigError, match="exactly one action"):
        parse_wan_timeline([{"at_s": 0, "set": {"delay_ms": 1}, "restore": True}])
    with pytest.raises(ConfigError, match=r"set\.latency"):
        parse_wan_timeline([{"at_s": 0, "set": {"latency": 1}}])
