"""Routing: which decode instance, which path (disaggregated or local), and when to refuse.

Decode score (higher is better), for a healthy instance with room for this request::

    score = (kv_free_bytes - need) / kv_budget_bytes
            - (queue_depth + in_flight) / (max_batch + max_queue)

where ``need`` is the KV the request reserves at decode: ``kv_bytes_per_token`` (from the
instance's Status) × (prompt tokens + max_tokens), and ``kv_free_bytes`` what is free *now*:
the budget less this gateway's own requests in flight there (counted as they are sent and as
they end) and less what others had reserved at the last Status poll (a poll lags; this
gateway's own sends and ends do not). An instance is a candidate only when
healthy, not down (its process restarting, per the supervisor), ``in_flight < max_batch +
max_queue`` and ``need <= kv_free_bytes`` (it can take *this* request now); with no
candidate the request is refused early (HTTP 429 + Retry-After when all are full, 503 +
Retry-After when none is up; 400 when its KV exceeds every instance's whole budget), never
queued without bound. A ``user``/session key sticks to the instance that served it
while that instance is a candidate. Otherwise, under a cache-aware policy, each candidate's
score gains ``router.offload.cache_weight × cached / prompt tokens``: the share of the prompt
its prefix cache holds (block hashes it reported, compared with the prompt's own).

Offload (``router.offload.policy``): ``length`` (the rule before prefix caches) prefills on
decode when the prompt is shorter than the threshold and ships the whole prompt's KV otherwise,
choosing decode by load alone; ``uncached`` when the part of it the chosen decode does not hold
is shorter, and ships only that part (decode supplies the rest from its cache), choosing decode
by load and cached share. An open circuit breaker sends ``auto`` traffic local too.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pdx.serving.deploy_config import RouterConfig
from pdx.serving.offload_config import OffloadChoice
from pdx.serving.offload_rates import LiveRates, Prediction
from pdx.serving.prefix_cache import block_hashes, leading_matches, reusable_blocks

Route = Literal["auto", "disaggregated", "local"]
ROUTES: tuple[str, ...] = ("auto", "disaggregated", "local")


@dataclass
class DecodeInstance:
    """What the router knows about one decode instance (polled Status + its own in-flight)."""

    name: str
    address: str
    stub: Any = None
    healthy: bool = False
    queue_depth: int = 0
    running: int = 0
    max_batch: int = 1
    max_queue: int = 0
    kv_budget_bytes: int = 1
    kv_free_bytes: int = 1
    kv_bytes_per_token: float = 0.0  # what a request reserves per token (0: unknown)
    kv_reserved_here: int = 0  # this gateway's requests in flight there: their reservations
    kv_others: int = 0  # reserved by others at the last poll (budget - free - ours then)
    in_flight: int = 0
    down: bool = False  # its process is down, says the supervisor (restarting)
    block_tokens: int = 0  # its prefix cache's block size (0: none, or not heard from yet)
    cached_blocks: set[int] = field(default_factory=set)  # block hashes its cache holds
    local_pending_tokens: int = 0  # uncached tokens of local requests sent, no first token yet

    def cached_tokens(self, hashes: Sequence[int], prompt_tokens: int) -> int:
        """The leading prompt tokens its prefix cache holds (``hashes``: the prompt's blocks)."""
        if not self.block_tokens or not hashes:
            return 0
        most = reusable_blocks(prompt_tokens, self.block_tokens)
        return leading_matches(hashes[:most], self.cached_blocks.__contains__) * self.block_tokens

    @property
    def capacity(self) -> int:
        """Requests it accepts at once."""
        return self.max_batch + self.max_queue

    def kv_need_bytes(self, tokens: int) -> int:
        """The KV a request of ``tokens`` (prompt + max_tokens) reserves here."""
        return math.ceil(self.kv_bytes_per_token * tokens)

    def polled(self, budget_bytes: int, free_bytes: int) -> None:
        """A Status reply: what others hold is what is reserved less this gateway's share.

        A request of this gateway's sent but not yet reserved at decode when the poll ran
        makes others read low until the next poll; decode's own admission holds the budget.
        """
        self.kv_budget_bytes = budget_bytes
        self.kv_others = max(0, budget_bytes - free_bytes - self.kv_reserved_here)
        self.kv_free_bytes = self.kv_free_now()

    def kv_free_now(self) -> int:
        """Free KV budget now: less this gateway's in flight and others' at the last poll."""
        if self.kv_bytes_per_token <= 0:
            return self.kv_free_bytes  # an instance that reports no reservations (engines)
        return max(0, self.kv_budget_bytes - self.kv_others - self.kv_reserved_here)

    def score(self, tokens: int = 0) -> float | None:
        """The documented score, or None when it cannot take this request now."""
        if not self.healthy or self.down or self.in_flight >= self.capacity:
            return None
        need, free_now = self.kv_need_bytes(tokens), self.kv_free_now()
        if need > free_now:
            return None
        free = (free_now - need) / max(1, self.kv_budget_bytes)
        return free - (self.queue_depth + self.in_flight) / max(1, self.capacity)


@dataclass
class PrefillInstance:
    """One prefill instance (gRPC address) and the gateway's in-flight count to it."""

    name: str
    address: str
    stub: Any = None
    healthy: bool = True
    in_flight: int = 0
    down: bool = False  # its process is down, says the supervisor (restarting)


class CircuitBreaker:
    """Opens when transfer P99 > ``breaker_p99_ms`` (``degrade_p99_ms``, else a share of the
    TTFT budget) or success rate < threshold over a window.

    Open → after ``breaker_open_s`` one half-open probe is let through; its success closes
    the breaker (window cleared), its failure opens it again. A probe that ends without a
    transfer outcome (its client left, its decode failed first) is given back with
    :meth:`abandon`, so the next request probes: a lost probe must not hold the breaker open.
    """

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.window: deque[tuple[bool, float]] = deque(maxlen=cfg.breaker_window)
        self.state: Literal["closed", "open", "half_open"] = "closed"
        self.opened_at = 0.0
        self.reason = ""
        self._probe_out = False
        self.probe_seq = 0  # which grant is the probe out now (see :meth:`abandon`)

    def allow(self) -> bool:
        """Whether a disaggregated transfer may be attempted now (may start a probe)."""
        if self.state == "closed":
            return True
        if self.state == "open" and time.monotonic() - self.opened_at >= self.cfg.breaker_open_s:
            self.state = "half_open"
        if self.state == "half_open" and not self._probe_out:
            self._probe_out = True
            self.probe_seq += 1
            return True
        return False

    def abandon(self, seq: int) -> None:
        """Probe ``seq`` ended without reporting a transfer: let the next request probe."""
        if self.state == "half_open" and self._probe_out and seq == self.probe_seq:
            self._probe_out = False

    def record(self, ok: bool, transfer_ms: float) -> None:
        """Feed one transfer outcome."""
        if self.state == "half_open":
            self._probe_out = False
            if ok:
                self.state, self.reason = "closed", ""
                self.window.clear()
            else:
                self._open("probe_failed")
            return
        self.window.append((ok, transfer_ms))
        if self.state == "closed":
            reason = self._trip_reason()
            if reason:
                self._open(reason)

    def _trip_reason(self) -> str:
        if len(self.window) < self.cfg.breaker_min_samples:
            return ""
        oks = [ms for ok, ms in self.window if ok]
        rate = len(oks) / len(self.window)
        if rate < self.cfg.success_rate_threshold:
            return "success_rate"
        # max() first: it is O(n), p99 sorts, and p99 can only exceed what max exceeds.
        bound = self.cfg.breaker_p99_ms
        if oks and max(oks) > bound and p99(oks) > bound:
            return "transfer_p99"
        return ""

    def _open(self, reason: str) -> None:
        self.state, self.reason, self.opened_at = "open", reason, time.monotonic()


def p99(values: list[float]) -> float:
    """Nearest-rank 99th percentile."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, int(0.99 * len(ordered) + 0.5) - 1))]


@dataclass
class Decision:
    """Where a request goes: path, instances, and whether (and why) it was degraded."""

    route: Literal["disaggregated", "local"]
    decode: DecodeInstance
    prefill: PrefillInstance | None = None
    degrade_reason: str = ""
    kv_need_bytes: int = 0  # what the request reserves on ``decode`` (the flow holds it)
    breaker_probe: int = 0  # the breaker's half-open probe number this request carries, or 0
    cached_tokens: int = 0  # prompt tokens ``decode``'s prefix cache holds (as last reported)
    uncached_tokens: int = 0  # the rest: what prefill computes and ships when remote
    policy: str = "length"  # router.offload.policy that decided
    threshold_tokens: int = 0  # its threshold
    kv_start_token: int = 0  # remote: the KV ships from here (decode holds the rest)
    predicted: Prediction | None = None  # break_even: both paths' predicted cost
    explore: str = ""  # break_even: the path this request measures ("remote"/"local"), or ""

    def offload(self) -> dict[str, Any]:
        """The offload decision's inputs, for the response's ``pdx`` object."""
        p = self.predicted
        return {"policy": self.policy, "threshold_tokens": self.threshold_tokens,
                "cached_tokens": self.cached_tokens, "uncached_tokens": self.uncached_tokens,
                "predicted_remote_ms": round(p.remote_ms, 3) if p else None,
                "predicted_local_ms": round(p.local_ms, 3) if p else None,
                "explore": self.explore or None, "path": self.route}  # fmt: skip


@dataclass
class Router:
    """Chooses instances and path; holds the breaker and the sticky map."""

    cfg: RouterConfig
    local_prefill_max_tokens: int
    decodes: list[DecodeInstance] = field(default_factory=list)
    prefills: list[PrefillInstance] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.breaker = CircuitBreaker(self.cfg)
        self.sticky: OrderedDict[str, str] = OrderedDict()
        self.rates = LiveRates()  # what finished requests showed (break_even decides on it)

    def pick_decode(
        self, user: str | None, tokens: int = 0, cached_share: dict[str, float] | None = None
    ) -> DecodeInstance | None:
        """Sticky instance if it can take the request (``tokens``: prompt + max_tokens), else
        the best score (plus each one's ``cached_share`` of the prompt, weighted); None =
        reject."""
        if user and self.cfg.sticky and user in self.sticky:
            inst = next((d for d in self.decodes if d.name == self.sticky[user]), None)
            if inst is not None and inst.score(tokens) is not None:
                self.sticky.move_to_end(user)
                return inst
        weight, shares = self.cfg.offload.cache_weight, cached_share or {}
        scored = [
            (s + weight * shares.get(d.name, 0.0), d)
            for d in self.decodes
            if (s := d.score(tokens)) is not None
        ]
        if not scored:
            return None
        best = max(scored, key=lambda pair: pair[0])[1]
        if user and self.cfg.sticky:
            self.sticky[user] = best.name
            self.sticky.move_to_end(user)
            while len(self.sticky) > self.cfg.sticky_entries:
                self.sticky.popitem(last=False)
        return best

    def pick_prefill(self) -> PrefillInstance | None:
        """The healthy prefill instance with the fewest requests in flight."""
        healthy = [p for p in self.prefills if p.healthy and not p.down]
        return min(healthy, key=lambda p: p.in_flight) if healthy else None

    def too_large(self, tokens: int) -> tuple[int, int] | None:
        """(need, largest budget) when a request of ``tokens`` fits no decode's whole KV
        budget (waiting would not help); None when some instance could hold it."""
        known = [d for d in self.decodes if d.kv_bytes_per_token > 0]
        if not known:
            return None
        largest = max(known, key=lambda d: d.kv_budget_bytes)
        need = largest.kv_need_bytes(tokens)
        return (need, largest.kv_budget_bytes) if need > largest.kv_budget_bytes else None

    def decide(
        self,
        requested: str,
        prompt_tokens: int,
        user: str | None,
        max_tokens: int = 0,
        prompt_ids: Sequence[int] = (),
        choice: OffloadChoice | None = None,
        salt: str = "",
    ) -> Decision | None:
        """Path and instances for one request; None when no decode capacity (early rejection).

        ``prompt_ids``: the prompt's token ids, compared with what each decode's prefix cache
        holds under the request's ``salt`` (none given: nothing is taken as cached).
        ``choice``: the request's own policy and threshold (``pdx_offload``), else
        ``router.offload``'s.
        """
        policy = (choice and choice.policy) or self.cfg.offload.policy
        threshold = self.local_prefill_max_tokens
        if choice is not None and choice.threshold_tokens is not None:
            threshold = choice.threshold_tokens
        cached = self._cached(prompt_ids, prompt_tokens, salt)
        aware = policy != "length"  # length: as before caches, the prompt's length alone
        shares = {name: n / max(1, prompt_tokens) for name, n in cached.items() if aware}
        decode = self.pick_decode(user, prompt_tokens + max_tokens, shares)
        if decode is None:
            return None
        held = cached.get(decode.name, 0)
        need = decode.kv_need_bytes(prompt_tokens + max_tokens)
        decision = Decision("local", decode, kv_need_bytes=need, cached_tokens=held,
                            uncached_tokens=prompt_tokens - held, policy=policy,
                            threshold_tokens=threshold,
                            kv_start_token=held if aware else 0)  # fmt: skip
        measured = prompt_tokens - held if aware else prompt_tokens
        if requested == "local" or (requested == "auto" and not self._remote(decision, measured)):
            return decision
        decision.prefill = self.pick_prefill()
        if decision.prefill is None:
            decision.degrade_reason = "prefill_unavailable"
            return decision
        if requested == "auto":
            was_closed = self.breaker.state == "closed"
            if not self.breaker.allow():
                decision.prefill = None
                decision.degrade_reason = f"circuit_open:{self.breaker.reason}"
                return decision
            decision.breaker_probe = 0 if was_closed else self.breaker.probe_seq
        decision.route = "disaggregated"
        return decision

    def _remote(self, decision: Decision, measured: int) -> bool:
        """Whether an ``auto`` request's policy sends its prefill to the prefill site."""
        if decision.policy != "break_even":
            return measured >= decision.threshold_tokens
        rates, uncached = self.rates, decision.uncached_tokens
        d = decision.decode
        decision.predicted = rates.predict(
            uncached, d.kv_bytes_per_token * uncached, d.local_pending_tokens
        )
        if not rates.exploring and (stale := rates.stale()):
            decision.explore = rates.exploring = stale  # measure it (one request at a time)
            return stale == "remote"
        if decision.predicted is None:  # until both paths are measured: the uncached rule
            return measured >= decision.threshold_tokens
        return decision.predicted.remote

    def _cached(
        self, prompt_ids: Sequence[int], prompt_tokens: int, salt: str = ""
    ) -> dict[str, int]:
        """Per decode, the leading tokens of the prompt its prefix cache holds."""
        sizes = {d.block_tokens for d in self.decodes if d.block_tokens}
        out: dict[str, int] = {}
        for size in sizes if prompt_ids else ():
            hashes = block_hashes(prompt_ids, size, salt)
            for d in self.decodes:
                if d.block_tokens == size and d.cached_blocks:
                    out[d.name] = d.cached_tokens(hashes, prompt_tokens)
        return out
