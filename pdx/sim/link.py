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
    extra_latency_s: float  # round trip, jitter, loss recovery stalls, codec time


class LinkModel:
    """Turns a prompt length into a :class:`Transfer`.

    Loss is modelled as retransmission delay: the wire carries ``mss``-byte segments; each
    lost segment is sent again (more link time), and every round trip's worth of data that
    saw a loss costs one extra round trip (SACK-style recovery; congestion-window
    reduction is not modelled). Jitter adds an exponential delay with mean ``link_jitter_s``.
    """

    def __init__(self, cfg: SimConfig, seed: int) -> None:
        self.kv_bytes_per_token = cfg.kv_bytes_per_token
        self.ratio = cfg.codec_ratio
        self.bw = cfg.link_bytes_per_s
        self.rtt_s = cfg.link_rtt_s
        self.loss = cfg.link_loss
        self.jitter_s = cfg.link_jitter_s
        self.mss = cfg.link_mss_bytes
        enc, dec = cfg.codec_encode_bytes_per_s, cfg.codec_decode_bytes_per_s
        self.codec_s_per_raw_byte = (1.0 / enc if enc else 0.0) + (1.0 / dec if dec else 0.0)
        self.random = self.loss > 0 or self.jitter_s > 0
        self.rng = np.random.default_rng(seed)

    def transfer(self, prompt_tokens: int) -> Transfer:
        """The transfer of one request's KV."""
        raw = prompt_tokens * self.kv_bytes_per_token
        wire = raw * self.ratio
        busy = wire / self.bw
        extra = self.rtt_s + raw * self.codec_s_per_raw_byte
        if self.random:
            extra += self._random_delay(wire, busy)
            if self.loss > 0:
                busy = self._busy_with_resends(wire)
        return Transfer(wire, busy, extra)

    def _random_delay(self, wire: float, busy: float) -> float:
        delay = float(self.rng.exponential(self.jitter_s)) if self.jitter_s > 0 else 0.0
        if self.loss > 0 and self.rtt_s > 0:
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
