"""The link between prefill and decode: bandwidth, round trip, jitter, loss and compression."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pdx.sim.config import SimConfig


@dataclass
class Transfer:
    """One KV shipment: how long it holds the link and how long it takes end to end."""

    wire_bytes: float
    link_busy_s: float  # serialization time, including resent segments
    extra_latency_s: float  # round trips, jitter, loss recovery stalls (not holding the link)
    encode_s: float = 0.0  # codec time before the bytes can leave
    decode_s: float = 0.0  # codec time after the last byte arrived


class LinkModel:
    """Turns a prompt length into a :class:`Transfer`.

    Loss (``link_loss_recovery: stall``) is modelled as retransmission delay: the wire carries
    ``mss``-byte segments; each lost segment is sent again (more link time), and every round
    trip's worth of data that saw a loss costs one extra round trip (SACK-style recovery;
    congestion-window reduction is not modelled). With ``pipelined`` the bandwidth is a goodput
    measured on the lossy path itself, so resends are already in it and repairs overlap new
    data; only a loss among the last round trip's worth of data, which nothing follows, costs
    one more round trip. Jitter adds an exponential delay with mean ``link_jitter_s``.
    """

    def __init__(self, cfg: SimConfig, seed: int) -> None:
        self.kv_bytes_per_token = cfg.kv_bytes_per_token
        self.ratio = cfg.codec_ratio
        self.bw = cfg.link_bytes_per_s
        self.rtt_s = cfg.link_rtt_s
        self.loss = cfg.link_loss
        self.jitter_s = cfg.link_jitter_s
        self.mss = cfg.link_mss_bytes
        self.round_trips = cfg.link_round_trips
        self.fixed_s = cfg.link_fixed_s
        self.pipelined = cfg.link_loss_recovery == "pipelined"
        enc, dec = cfg.codec_encode_bytes_per_s, cfg.codec_decode_bytes_per_s
        self.encode_s_per_byte = 1.0 / enc if enc else 0.0
        self.decode_s_per_byte = 1.0 / dec if dec else 0.0
        self.random = self.loss > 0 or self.jitter_s > 0
        self.rng = np.random.default_rng(seed)

    def transfer(self, prompt_tokens: int) -> Transfer:
        """The transfer of one request's KV."""
        raw = prompt_tokens * self.kv_bytes_per_token
        wire = raw * self.ratio
        busy = wire / self.bw
        extra = self.rtt_s * self.round_trips + self.fixed_s
        if self.random:
            extra += self._random_delay(wire, busy)
            if self.loss > 0 and not self.pipelined:
                busy = self._busy_with_resends(wire)
        return Transfer(
            wire, busy, extra, raw * self.encode_s_per_byte, raw * self.decode_s_per_byte
        )

    def expected_s(self, prompt_tokens: int) -> float:
        """A transfer's time without its random part (what a rate learnt over many transfers
        predicts): encode, the bytes at the link's rate, the round trips, decode."""
        raw = prompt_tokens * self.kv_bytes_per_token
        busy = raw * self.ratio / self.bw
        return (
            raw * (self.encode_s_per_byte + self.decode_s_per_byte)
            + busy
            + (self.rtt_s * self.round_trips + self.fixed_s)
        )

    def _random_delay(self, wire: float, busy: float) -> float:
        delay = float(self.rng.exponential(self.jitter_s)) if self.jitter_s > 0 else 0.0
        if self.loss > 0 and self.rtt_s > 0 and self.pipelined:
            last = min(wire, self.bw * self.rtt_s)  # the final round trip's worth of data
            p_last = -math.expm1(max(1.0, last / self.mss) * math.log1p(-self.loss))
            delay += self.rtt_s * int(self.rng.random() < p_last)
        elif self.loss > 0 and self.rtt_s > 0:
            rounds = max(1, math.ceil(busy / self.rtt_s))
            segs_per_round = max(1.0, wire / self.mss / rounds)
            p_round = -math.expm1(segs_per_round * math.log1p(-self.loss))
            delay += self.rtt_s * int(self.rng.binomial(rounds, p_round))
        return delay

    def _busy_with_resends(self, wire: float) -> float:
        segments = max(1, math.ceil(wire / self.mss))
        lost = int(self.rng.binomial(segments, self.loss))
        # a resent segment can itself be lost: geometric series 1/(1-p) on the resends
        return (wire + lost * self.mss / (1.0 - self.loss)) / self.bw
