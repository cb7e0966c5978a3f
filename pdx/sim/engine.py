"""The discrete-event engine: prefill pools, the link, and decode instances stepping batches.

Decode is simulated per *segment*, not per token: while a batch's composition does not
change, every step lasts the same time, so a run of ``k`` steps is one event. A segment
ends when its first member finishes; a request that becomes ready mid-segment cuts it at
the first step boundary at or after its ready time (where it joins). This keeps the event
count proportional to requests, not tokens.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from pdx.sim.config import Mode, SimConfig
from pdx.sim.link import LinkModel, Transfer
from pdx.sim.prefix import PrefixCaches
from pdx.sim.workload import Workload

ARRIVAL, PREFILL_DONE, READY, DECODE = 0, 1, 2, 3  # also the tie order at equal times
LINK_JOIN, LINK_DONE = 4, 5  # link_sharing fair: a transfer joins the link; the next one ends
POOL = -1  # PREFILL_DONE from the prefill pool (not an instance's local prefill)


class _Instance:
    """A decode instance (disaggregated) or a colocated instance: one batch, one local prefill."""

    __slots__ = (
        "batch_n",
        "busy_s",
        "chunk_queue",
        "finish_heap",
        "fresh",
        "idx",
        "inflight",
        "kv_used",
        "prefill_busy_s",
        "prefill_free_at",
        "prompt_heap",
        "running",
        "seg_chunk",
        "seg_d",
        "seg_k",
        "seg_start",
        "steps_done",
        "version",
        "waiting",
    )

    def __init__(self, idx: int) -> None:
        self.idx = idx
        self.waiting: deque[int] = deque()
        self.batch_n = 0
        self.kv_used = 0.0
        self.finish_heap: list[tuple[int, int]] = []
        self.fresh: list[int] = []  # joined; their first decode step is the current segment's
        self.prompt_heap: list[tuple[int, int]] = []
        self.steps_done = 0
        self.running = False
        self.seg_start = 0.0
        self.seg_d = 0.0
        self.seg_k = 0
        self.version = 0
        self.prefill_free_at = 0.0
        self.chunk_queue: deque[list[int]] = deque()
        self.seg_chunk: list[tuple[list[int], int]] = []
        self.inflight = 0
        self.busy_s = 0.0
        self.prefill_busy_s = 0.0


@dataclass
class EngineTrace:
    """Raw per-request times and per-segment step records of one run."""

    mode: Mode
    arrival_s: list[float]
    prompt_tokens: list[int]
    output_tokens: list[int]
    prefill_start_s: list[float]
    prefill_end_s: list[float]
    ready_s: list[float]
    join_s: list[float]
    finish_s: list[float]
    transfer_start_s: list[float]
    local_prefill: bytearray
    first_token_s: list[float] = field(default_factory=list)
    second_token_s: list[float] = field(default_factory=list)
    link_time_s: list[float] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)  # prefix its prefill found cached
    shipped_tokens: list[int] = field(default_factory=list)  # tokens whose KV crossed the link
    step_s: list[float] = field(default_factory=list)
    step_count: list[int] = field(default_factory=list)
    step_batch: list[int] = field(default_factory=list)
    prefill_busy_s: float = 0.0
    prefill_servers: int = 1
    decode_busy_s: float = 0.0
    decode_servers: int = 1
    link_busy_s: float = 0.0
    link_bytes: float = 0.0
    events: int = 0


class Engine:
    """One simulation of one serving mode over one workload."""

    def __init__(self, cfg: SimConfig, workload: Workload, mode: Mode) -> None:
        self.cfg = cfg
        self.mode = mode
        self.published = cfg.compat == "published"
        self.chunk = cfg.chunked_prefill_tokens if mode == "colocated" else None
        self.local_max = cfg.local_prefill_max_tokens if mode == "disaggregated" else 0
        self.policy = cfg.offload_policy
        n = len(workload)
        nan = math.nan
        self.tr = EngineTrace(
            mode=mode,
            arrival_s=workload.arrival_s,
            prompt_tokens=workload.prompt_tokens,
            output_tokens=workload.output_tokens,
            prefill_start_s=[nan] * n,
            prefill_end_s=[nan] * n,
            ready_s=[nan] * n,
            join_s=[nan] * n,
            finish_s=[nan] * n,
            transfer_start_s=[nan] * n,
            local_prefill=bytearray(n),
            first_token_s=[nan] * n,
            second_token_s=[nan] * n,
            link_time_s=[nan] * n,
            cached_tokens=[0] * n,
            shipped_tokens=[0] * n,
        )
        count = cfg.colocated_instances if mode == "colocated" else cfg.decode_instances
        self.insts = [_Instance(i) for i in range(count)]
        self.caches = PrefixCaches(
            workload.hash_ids, workload.block_size, cfg.prefix_cache_blocks,
            cfg.prefill_instances, count,
        )  # fmt: skip
        self.load = [0] * count  # requests routed to each instance and not finished
        self.pool_free: list[tuple[float, int]] = [(0.0, s) for s in range(cfg.prefill_instances)]
        self.link = LinkModel(cfg, seed=cfg.workload.seed + 1)
        self.link_free_at = 0.0
        # link_sharing fair: rid -> its remaining link time at the full rate, and what follows
        self.sharing: dict[int, float] = {}
        self.after_link: dict[int, tuple[float, float, float, int, float]] = {}
        self.link_t = 0.0
        self.link_version = 0
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = itertools.count()
        self.done = bytearray(n)
        self.prefill_s_per_token = 2.0 * cfg.model_params / cfg.prefill_flops
        self.prefill_fixed_s = cfg.prefill_fixed_s
        self.prefill_factor: list[float] | None = None
        if cfg.prefill_time_sigma > 0:
            rng = np.random.default_rng(cfg.workload.seed + 2)
            self.prefill_factor = rng.lognormal(0.0, cfg.prefill_time_sigma, n).tolist()
        # first token from prefill: the request reaches the prefill site, and the token and
        # the KV's handle come back, half a round trip each; decode makes the other tokens
        self.from_prefill = cfg.first_token_from == "prefill"
        crosses = self.from_prefill or cfg.prefill_over_link
        self.half_rtt_s = cfg.link_rtt_s / 2 if crosses else 0.0
        self.layers = cfg.model_layers if cfg.kv_overlap == "layerwise" else 0
        self.kv_bytes_per_token = cfg.kv_bytes_per_token
        self.weight_bytes = cfg.weight_bytes
        self.hbm_bytes_per_s = cfg.decode_hbm_bytes_per_s
        self.weights_per_step = cfg.decode_weight_reads == "per_step"
        self.max_batch = cfg.max_decode_batch or n + 1
        self.kv_budget = cfg.decode_kv_budget_bytes or math.inf

    # -- event plumbing ---------------------------------------------------------------

    def _push(self, t: float, kind: int, a: int, b: int) -> None:
        heapq.heappush(self.heap, (t, kind, next(self.seq), a, b))

    def run(self) -> EngineTrace:
        """Run to completion and return the raw trace."""
        tr = self.tr
        n = len(tr.arrival_s)
        if n:
            self._push(tr.arrival_s[0], ARRIVAL, 0, 0)
        heap, pop, insts = self.heap, heapq.heappop, self.insts
        events = 0
        while heap:
            t, kind, _, a, b = pop(heap)
            events += 1
            if kind == DECODE:
                inst = insts[a]
                if b == inst.version:
                    self._segment_end(inst, t)
            elif kind == READY:
                inst = insts[b]
                inst.inflight -= 1
                self._make_ready(inst, a, t)
            elif kind == PREFILL_DONE:
                self._prefill_done(a, b, t)
            elif kind == LINK_JOIN:
                self._link_join(a, t)
            elif kind == LINK_DONE:
                if a == self.link_version:
                    self._link_done(t)
            else:
                self._arrival(a, t)
                if a + 1 < n:
                    self._push(tr.arrival_s[a + 1], ARRIVAL, a + 1, 0)
        tr.events = events
        self._totals()
        return tr

    def _totals(self) -> None:
        tr, cfg = self.tr, self.cfg
        tr.decode_busy_s = sum(i.busy_s for i in self.insts)
        tr.decode_servers = len(self.insts)
        if self.mode == "colocated":
            tr.prefill_busy_s = sum(i.prefill_busy_s for i in self.insts)
            tr.prefill_servers = len(self.insts)
        else:  # the pool only; its busy time was added as prefills started
            tr.prefill_servers = cfg.prefill_instances

    # -- routing ----------------------------------------------------------------------

    def _least_loaded(self) -> _Instance:
        """The instance with the fewest requests assigned and not finished (lowest index wins)."""
        load = self.load
        if len(load) == 1:
            return self.insts[0]
        return self.insts[load.index(min(load))]

    # -- prefill ------------------------------------------------------------------------

    def _arrival(self, rid: int, t: float) -> None:
        tr = self.tr
        prompt = measured = tr.prompt_tokens[rid]
        if self.policy in ("uncached", "break_even") and self.mode == "disaggregated":
            # what decode would lack
            measured -= self.caches.hit(self.caches.decode, self._least_loaded().idx, rid, prompt)
        local = measured <= self.local_max
        if self.policy == "break_even" and self.mode == "disaggregated":
            local = self._local_pays(rid, measured, t)
        if self.mode == "colocated" or local:
            inst = self._least_loaded()
            self.load[inst.idx] += 1
            if self.mode == "disaggregated":
                tr.local_prefill[rid] = 1
            if self.chunk:
                self._chunk_enqueue(inst, rid, t)
            else:
                self._local_prefill(inst, rid, t)
        else:
            free_at, server = heapq.heappop(self.pool_free)
            there = t + self.half_rtt_s
            start = free_at if free_at > there else there
            dur = self._prefill_s(rid, prompt - self._cached(self.caches.prefill, server, rid))
            end = start + dur
            heapq.heappush(self.pool_free, (end, server))
            tr.prefill_start_s[rid], tr.prefill_end_s[rid] = start, end
            tr.prefill_busy_s += dur
            self._push(end, PREFILL_DONE, rid, POOL)
            inst = self.insts[0]
        if self.published:  # the published model: the request enters the batch on arrival
            inst.waiting.append(rid)
            self._interrupt(inst, t)

    def _local_pays(self, rid: int, uncached: int, t: float) -> bool:
        """break_even: the least-loaded decode prefills the uncached part sooner than the
        prefill pool's queue, its prefill, the round trip and the transfer would have it ready
        (the rates are the simulator's own: what the gateway's live averages converge to)."""
        work = self._prefill_s(rid, uncached)
        local = max(0.0, self._least_loaded().prefill_free_at - t) + work
        remote = (max(0.0, self.pool_free[0][0] - t - self.half_rtt_s) + work
                  + 2 * self.half_rtt_s + self.link.expected_s(uncached)
                  + max(0.0, self.link_free_at - t))  # fmt: skip
        return local <= remote

    def _cached(self, caches: list, idx: int, rid: int) -> int:  # type: ignore[type-arg]
        """The prefix of ``rid`` instance ``idx``'s cache holds (recorded); then it holds all."""
        hit = self.caches.hit(caches, idx, rid, self.tr.prompt_tokens[rid])
        self.tr.cached_tokens[rid] = hit
        self.caches.store(caches, idx, rid)
        return hit

    def _prefill_s(self, rid: int, prompt: int) -> float:
        """How long one request's prefill computes (FLOPs, fixed cost, its spread factor) for
        ``prompt`` uncached tokens (at least one: the last token is always computed)."""
        dur = max(1, prompt) * self.prefill_s_per_token + self.prefill_fixed_s
        return dur * self.prefill_factor[rid] if self.prefill_factor is not None else dur

    def _local_prefill(self, inst: _Instance, rid: int, t: float) -> None:
        """FIFO prefill on the instance itself; decode steps freeze while it has work."""
        tr = self.tr
        start = inst.prefill_free_at if inst.prefill_free_at > t else t
        dur = self._prefill_s(
            rid, tr.prompt_tokens[rid] - self._cached(self.caches.decode, inst.idx, rid)
        )
        inst.prefill_free_at = start + dur
        inst.prefill_busy_s += dur
        tr.prefill_start_s[rid], tr.prefill_end_s[rid] = start, start + dur
        self._push(start + dur, PREFILL_DONE, rid, inst.idx)
        self._interrupt(inst, t)

    def _chunk_enqueue(self, inst: _Instance, rid: int, t: float) -> None:
        was_empty = not inst.chunk_queue
        cached = self._cached(self.caches.decode, inst.idx, rid)
        inst.chunk_queue.append([rid, max(1, self.tr.prompt_tokens[rid] - cached)])
        if not inst.running:
            self._start_segment(inst, t)
        elif was_empty:
            self._interrupt(inst, t)

    def _prefill_done(self, rid: int, where: int, t: float) -> None:
        tr = self.tr
        if where != POOL:
            tr.first_token_s[rid] = t
            self._make_ready(self.insts[where], rid, t)
            return
        if self.from_prefill:  # else the first token comes with decode's first step
            tr.first_token_s[rid] = t + self.half_rtt_s
        if self.from_prefill and tr.output_tokens[rid] == 1:  # answered: no KV to ship
            tr.ready_s[rid] = tr.join_s[rid] = tr.finish_s[rid] = tr.first_token_s[rid]
            tr.local_prefill[rid] = 0
            self.done[rid] = 1
            return
        inst = self._least_loaded()
        self.load[inst.idx] += 1
        inst.inflight += 1
        # only what the decode instance lacks crosses the link (the length policy: all of it)
        held = self.caches.hit(self.caches.decode, inst.idx, rid, tr.prompt_tokens[rid])
        held = 0 if self.policy == "length" else held
        self.caches.store(self.caches.decode, inst.idx, rid)
        tr.shipped_tokens[rid] = tr.prompt_tokens[rid] - held
        xfer = self.link.transfer(tr.shipped_tokens[rid])
        if self.cfg.link_sharing == "fair":
            asked = t + xfer.encode_s + self.half_rtt_s
            tr.transfer_start_s[rid] = asked
            tr.link_busy_s += xfer.link_busy_s
            tr.link_bytes += xfer.wire_bytes
            self.after_link[rid] = (xfer.link_busy_s, xfer.extra_latency_s, xfer.decode_s,
                                    inst.idx, asked)  # fmt: skip
            self._push(asked, LINK_JOIN, rid, 0)
            return
        if self.layers:
            asked, done = self._layerwise(xfer, tr.prefill_start_s[rid], t)
            start = tr.transfer_start_s[rid] = self.link_free_at if self._queued(asked) else asked
            done = max(done, start + xfer.link_busy_s)
        else:
            # the bytes can leave once encoded (and, in pdx's flow, once decode has the handle)
            asked = t + xfer.encode_s + self.half_rtt_s
            start = tr.transfer_start_s[rid] = self.link_free_at if self._queued(asked) else asked
            done = start + xfer.link_busy_s
        self.link_free_at = done
        tr.link_busy_s += xfer.link_busy_s
        tr.link_bytes += xfer.wire_bytes
        arrived = done + xfer.extra_latency_s
        tr.link_time_s[rid] = arrived - asked
        self._push(arrived + xfer.decode_s, READY, rid, inst.idx)

    # -- link_sharing fair: the transfers on the link share its rate equally ---------------

    def _link_advance(self, t: float) -> None:
        if self.sharing:
            share = (t - self.link_t) / len(self.sharing)
            for rid in self.sharing:
                self.sharing[rid] -= share
        self.link_t = t

    def _link_next(self, t: float) -> None:
        self.link_version += 1
        if self.sharing:
            left = min(self.sharing.values())
            self._push(t + max(left, 0.0) * len(self.sharing), LINK_DONE, self.link_version, 0)

    def _link_join(self, rid: int, t: float) -> None:
        self._link_advance(t)
        self.sharing[rid] = self.after_link[rid][0]
        self._link_next(t)

    def _link_done(self, t: float) -> None:
        self._link_advance(t)
        tr = self.tr
        for rid in [r for r, left in self.sharing.items() if left <= 1e-12]:
            del self.sharing[rid]
            _, extra, decode_s, idx, asked = self.after_link.pop(rid)
            tr.link_time_s[rid] = t + extra - asked
            self._push(t + extra + decode_s, READY, rid, idx)
        self._link_next(t)

    def _queued(self, asked: float) -> bool:
        """Whether a transfer ready at ``asked`` waits for the one before it (fifo link)."""
        return self.cfg.link_sharing == "fifo" and self.link_free_at > asked

    def _layerwise(self, xfer: Transfer, pf_start: float, pf_end: float) -> tuple[float, float]:
        """kv_overlap layerwise: (when the first layer can leave, when the last byte has
        left with an idle link). Layer i (1..L) is computed at pf_start + i * (prefill / L)
        and encoded in encode_s / L; each takes link_busy_s / L of the link, in order, so the
        last byte leaves at the later of the first layer + all bytes, and the last layer +
        its own bytes."""
        n = self.layers
        per_layer = (pf_end - pf_start) / n
        enc, wire = xfer.encode_s / n, xfer.link_busy_s / n
        first = pf_start + per_layer + enc + self.half_rtt_s
        last = pf_end + enc + self.half_rtt_s
        return first, max(first + xfer.link_busy_s, last + wire)

    # -- decode -------------------------------------------------------------------------

    def _make_ready(self, inst: _Instance, rid: int, t: float) -> None:
        self.tr.ready_s[rid] = t
        if not self.from_prefill:
            self.tr.first_token_s[rid] = t
        if self.published:
            # queued on arrival already; an idle instance wakes when the earliest-arrived
            # waiting request is ready (the published loop walks requests in arrival order)
            if not inst.running and inst.waiting and inst.waiting[0] == rid:
                self._start_segment(inst, t)
            return
        inst.waiting.append(rid)
        if not inst.running:
            self._start_segment(inst, t)
        elif len(inst.waiting) == 1 and inst.batch_n < self.max_batch:
            self._interrupt(inst, t)

    def _interrupt(self, inst: _Instance, x: float) -> None:
        """Cut the running segment at the first step boundary at or after ``x``."""
        if not inst.running:
            return
        t0, d = inst.seg_start, inst.seg_d
        j = int((x - t0) / d)
        if t0 + j * d < x:
            j += 1
        if j >= inst.seg_k:
            return
        inst.version += 1
        if j == 0:  # the segment starts now: plan it again with the newcomer
            inst.seg_chunk = []
            self._start_segment(inst, t0)
            return
        inst.seg_k = j
        self._push(t0 + j * d, DECODE, inst.idx, inst.version)

    def _admit(self, inst: _Instance, t: float) -> None:
        tr = self.tr
        waiting, reserve = inst.waiting, self.kv_bytes_per_token
        while waiting and inst.batch_n < self.max_batch:
            rid = waiting[0]
            steps = tr.output_tokens[rid] - (1 if self.from_prefill else 0)
            if steps == 0:  # the first token, from prefill, was the whole answer
                waiting.popleft()
                tr.join_s[rid] = t
                tr.finish_s[rid] = tr.first_token_s[rid]
                self.done[rid] = 1
                self.load[inst.idx] -= 1
                continue
            need = (tr.prompt_tokens[rid] + tr.output_tokens[rid]) * reserve
            if inst.kv_used + need > self.kv_budget:
                break
            waiting.popleft()
            inst.batch_n += 1
            inst.kv_used += need
            tr.join_s[rid] = t
            inst.fresh.append(rid)
            heapq.heappush(inst.finish_heap, (inst.steps_done + steps, rid))
            heapq.heappush(inst.prompt_heap, (-tr.prompt_tokens[rid], rid))

    def _step_s(self, inst: _Instance) -> float:
        heap, done = inst.prompt_heap, self.done
        while done[heap[0][1]]:
            heapq.heappop(heap)
        kv_bytes = -heap[0][0] * self.kv_bytes_per_token  # padded to the longest prompt
        if self.weights_per_step:
            return (self.weight_bytes + inst.batch_n * kv_bytes) / self.hbm_bytes_per_s
        return inst.batch_n * (self.weight_bytes + kv_bytes) / self.hbm_bytes_per_s

    def _plan_chunk(self, inst: _Instance, t: float) -> float:
        """Take up to one chunk of prompt tokens from the queue head(s); return its time."""
        budget = self.chunk or 0
        plan: list[tuple[list[int], int]] = []
        starts = self.tr.prefill_start_s
        for entry in inst.chunk_queue:
            take = min(entry[1], budget)
            plan.append((entry, take))
            if math.isnan(starts[entry[0]]):
                starts[entry[0]] = t
            budget -= take
            if budget == 0:
                break
        inst.seg_chunk = plan
        return ((self.chunk or 0) - budget) * self.prefill_s_per_token

    def _start_segment(self, inst: _Instance, t: float) -> None:
        if inst.waiting:
            self._admit(inst, t)
        if inst.batch_n == 0 and not inst.chunk_queue:
            inst.running = False
            return
        d = self._step_s(inst) if inst.batch_n else 0.0
        if inst.chunk_queue:
            d += self._plan_chunk(inst, t)
            k = 1
        elif inst.prefill_free_at > t:  # prefill freezes decode until its queue drains
            d = max(d, inst.prefill_free_at - t)
            k = 1
        else:
            k = inst.finish_heap[0][0] - inst.steps_done
        inst.running = True
        inst.seg_start, inst.seg_d, inst.seg_k = t, d, k
        second = self.tr.second_token_s
        for rid in inst.fresh:  # their first decode step is this segment's first
            second[rid] = t + d
        inst.version += 1
        self._push(t + k * d, DECODE, inst.idx, inst.version)

    def _segment_end(self, inst: _Instance, t: float) -> None:
        tr, k, d = self.tr, inst.seg_k, inst.seg_d
        inst.steps_done += k
        inst.fresh.clear()
        if inst.batch_n:
            tr.step_s.append(d)
            tr.step_count.append(k)
            tr.step_batch.append(inst.batch_n)
            inst.busy_s += d * k
        if inst.seg_chunk:
            self._apply_chunk(inst, t)
        heap, done, reserve = inst.finish_heap, self.done, self.kv_bytes_per_token
        while heap and heap[0][0] <= inst.steps_done:
            _, rid = heapq.heappop(heap)
            tr.finish_s[rid] = t
            done[rid] = 1
            inst.batch_n -= 1
            self.load[inst.idx] -= 1
            inst.kv_used -= (tr.prompt_tokens[rid] + tr.output_tokens[rid]) * reserve
        self._start_segment(inst, t)

    def _apply_chunk(self, inst: _Instance, t: float) -> None:
        for entry, take in inst.seg_chunk:
            entry[1] -= take
            inst.prefill_busy_s += take * self.prefill_s_per_token
            if entry[1] == 0:
                inst.chunk_queue.popleft()
                rid = entry[0]
                self.tr.prefill_end_s[rid] = t
                self.tr.ready_s[rid] = t
                self.tr.first_token_s[rid] = t
                inst.waiting.append(rid)
        inst.seg_chunk = []


def run_mode(cfg: SimConfig, workload: Workload, mode: Mode) -> EngineTrace:
    """Simulate one serving mode over the workload."""
    return Engine(cfg, workload, mode).run()
