"""One choice's way through prefill (maybe) and decode, as a stream of tokens.

:class:`Flow` runs the route the router chose, degrades to local prefill when prefill or
the KV store fails, ends generation at a stop string, records the timings, the metrics and
the ``pdx`` object of the response, and maps decode failures to :class:`HTTPProblem` (an
unreachable decode before the first token: 503 with ``Retry-After``). A request with ``n``
choices runs ``n`` flows.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdx._proto import serving_pb2
from pdx.serving.backends.tokenizer import Tokenizer
from pdx.serving.gateway.context import FlowContext
from pdx.serving.gateway.protocol import CompletionRequest, HTTPProblem
from pdx.serving.router import Decision, PrefillInstance

MARKS = ("prefill_first_event", "prefill_stored_event", "decode_first_chunk",
         "first_to_second_token")  # fmt: skip
STREAMED_MARKS = ("prefill_opened_event",)  # only with kv.streaming
WINDOW_IDS = 8  # ids a text window holds at most before it starts again one id back


@dataclass
class Outcome:
    """What a choice produced, for the response body."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    pdx: dict[str, Any] = field(default_factory=dict)
    logprobs: list[serving_pb2.TokenLogprob | None] = field(default_factory=list)
    text: str = ""  # the text so far (cut before a stop string once one matched)


class TextTracker:
    """Incremental text of a choice: what may be sent now, and where a stop string matched."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str], min_tokens: int) -> None:
        self.tokenizer, self.stops, self.min_tokens = tokenizer, stops, min_tokens
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.checked = 0  # length of the text already searched
        # Rendered incrementally: decoding every id so far at each token is quadratic in the
        # output (its own figure in docs/performance.md). Each update decodes a window from
        # the token before the last committed ones, and adds what the new ids added to the
        # window's text: a tokenizer's rule for a window's first token (a dropped leading
        # space) applies alike to both decodes, so their difference is the new text.
        self._text = ""  # the text of ids[:_read]
        self._prefix = self._read = 0  # the window starts at _prefix
        self._window = ""  # the text of ids[_prefix:_read] decoded alone

    def update(self, out: Outcome) -> bool:
        """Extend ``out.text`` with the newest ids; True when a stop string matched (text
        cut before it). ``out.text`` is what decoding every id would give."""
        ids = out.tokens
        now = self.tokenizer.decode(ids[self._prefix :])
        if not now.startswith(self._window):  # not additive here: decode it all, once
            out.text = self.tokenizer.decode(ids)
            self._commit(ids, out.text)
        elif now.endswith("\ufffd"):  # a character still incomplete: nothing committed
            out.text = self._text + now[len(self._window) :]
        else:
            out.text = self._text + now[len(self._window) :]
            self._commit(ids, out.text)
        return self._stopped(out, len(ids))

    def _commit(self, ids: list[int], text: str) -> None:
        """The text now holds every id; the next window starts at the last committed ones
        (one id back after a long incomplete run), and further back while it renders
        nothing (a special id, say: a window beginning with it would lose the next word's
        leading space, as a decode's first word does)."""
        self._text, self._prefix, self._read = text, self._read, len(ids)
        if self._read - self._prefix > WINDOW_IDS:
            self._prefix = self._read - 1
        self._window = self.tokenizer.decode(ids[self._prefix : self._read])
        while not self._window and self._prefix > 0:
            self._prefix = max(0, self._prefix - 1) if self._read - self._prefix < WINDOW_IDS else 0
            self._window = self.tokenizer.decode(ids[self._prefix : self._read])

    def feed(self, out: Outcome, text: str, tokens: int) -> bool:
        """Append text an engine already detokenized (``tokens``: the count with it); True
        when a stop string matched. Nothing is decoded here: the engine's text is the text."""
        out.text += text
        return self._stopped(out, tokens)

    def _stopped(self, out: Outcome, tokens: int) -> bool:
        if not self.stops:
            return False
        # Only text not searched before can start a new match (min_tokens: none before it).
        start = max(0, self.checked - self.hold - 4)
        self.checked = len(out.text)
        if tokens < self.min_tokens:
            return False
        cuts = [i for s in self.stops if (i := out.text.find(s, start)) >= 0]
        if not cuts:
            return False
        out.text = out.text[: min(cuts)]
        return True

    def sendable(self, out: Outcome, final: bool) -> str:
        """Text that may go out now: not a partial character, not a possible stop's start."""
        text = out.text
        if final:
            return text
        if text.endswith("\ufffd"):
            text = text.rstrip("\ufffd")
        for n in range(min(self.hold, len(text)), 0, -1):
            if any(s.startswith(text[-n:]) for s in self.stops):
                return text[:-n]
        return text


def decode_unreachable(name: str, detail: str, retry_after_s: int) -> HTTPProblem:
    """503 for a request whose decode instance could not be reached before its first token
    (nothing was generated: retrying is safe, e.g. once the supervisor restarted it)."""
    return HTTPProblem(
        503, f"decode instance {name} unreachable before the first token: {detail}",
        "decode_unavailable", headers={"Retry-After": str(retry_after_s)},
    )  # fmt: skip


class Flow:
    """One choice through prefill (maybe) and decode, yielding tokens as they arrive."""

    def __init__(
        self,
        ctx: FlowContext,
        req: CompletionRequest,
        decision: Decision,
        *,
        request_id: str = "",
        index: int = 0,
    ) -> None:
        self.ctx, self.req, self.decision = ctx, req, decision
        self.id = request_id or f"cmpl-{secrets.token_hex(12)}"
        self.index = index
        self.outcome = Outcome()
        self.text = TextTracker(ctx.tokenizer, req.stop, req.min_tokens)
        self.t0 = time.perf_counter()
        self.ttft_s: float | None = None
        self.last_token_s = 0.0
        self.prefill_first: serving_pb2.PrefillFirstToken | None = None
        self.prefill_reply: serving_pb2.PrefillReply | None = None
        self.marks: dict[str, float] = {}  # gateway-side intervals, seconds
        self.client_gone = False  # the streaming client disconnected before the end
        # The next token is already here (the same upstream message or read): the writer may
        # hold this token's event and send both in one write instead of one send each.
        self.more_ready = False
        # Streamed KV: decode's Generate, started at prefill's ``opened`` event so its Get
        # runs while prefill still computes; and when it was sent.
        self._early: Any = None
        self._early_sent = 0.0
        # The decode slot is taken now, so that requests routed in the same instant see it.
        self._reserved = True
        self._pending_local = decision.uncached_tokens if decision.route == "local" else 0
        decision.decode.local_pending_tokens += self._pending_local
        decision.decode.in_flight += 1
        decision.decode.kv_reserved_here += decision.kv_need_bytes
        ctx.metrics.in_flight.labels(decision.decode.name).set(decision.decode.in_flight)

    def _local_started(self) -> None:
        """Decode's own prefill of this request is over (its first token is out, or it ended)."""
        self.decision.decode.local_pending_tokens -= self._pending_local
        self._pending_local = 0

    def release(self) -> None:
        """Give the decode slot back (once; also for a flow that never ran), and the breaker's
        half-open probe if this flow carried it and never reported a transfer."""
        self._local_started()
        if self._reserved:
            self._reserved = False
            if self.decision.breaker_probe:
                self.ctx.router.breaker.abandon(self.decision.breaker_probe)
            if self.decision.explore:  # its measurement is in (or lost): the next may explore
                self.ctx.router.rates.exploring = ""
            d = self.decision.decode
            d.in_flight -= 1
            d.kv_reserved_here -= self.decision.kv_need_bytes
            self.ctx.metrics.in_flight.labels(d.name).set(d.in_flight)

    async def collect(self) -> Outcome:
        """Run to completion (non-streaming)."""
        async for _ in self.events():
            pass
        return self.outcome

    async def events(self) -> AsyncGenerator[int, None]:
        """Generated tokens in order; raises HTTPProblem on failure."""
        self.ctx.metrics.waiting.inc()
        outcome_label = "error"
        try:
            gen = self._generate_request()
            # aclosing: when the client leaves, closing this generator cancels the gRPC calls
            # at once (not whenever the garbage collector finalises the inner generators).
            if self.decision.route == "disaggregated" and self.decision.prefill is not None:
                async with contextlib.aclosing(self._prefill(self.decision.prefill, gen)) as pf:
                    async for token in pf:
                        yield token
                        if self.outcome.finish_reason:  # a stop string in the first token
                            break
            if self.decision.degrade_reason:
                gen.degrade_reason = self.decision.degrade_reason
            if not self.outcome.finish_reason:
                async with contextlib.aclosing(self._decode(gen)) as dec:
                    async for token in dec:
                        yield token
                        if self.outcome.finish_reason:  # a stop string: end generation now
                            break
            if not self.outcome.pdx:  # ended by a stop string: decode's stats never came
                self._finish(serving_pb2.GenerateChunk(finish_reason="stop"))
            outcome_label = "degraded" if self.outcome.pdx.get("degraded") else "ok"
        finally:
            if self._early is not None:  # a streamed-KV decode call nobody will read
                self._early.cancel()
                self._early = None
            self.account(outcome_label)

    def account(self, outcome_label: str) -> None:
        """The end of a flow, however it ended: slot back, gauges down, request counted."""
        m = self.ctx.metrics
        if self.client_gone:
            outcome_label = "client_disconnect"
        self.release()
        (m.waiting if self.ttft_s is None else m.running).dec()
        route = self.outcome.pdx.get("route", self.decision.route)
        m.requests.labels(route, outcome_label).inc()

    def _generate_request(self) -> serving_pb2.GenerateRequest:
        req = self.req
        seed = req.seed if self.index == 0 else (req.seed + self.index * 0x9E3779B97F4A7C15)
        sampling = serving_pb2.SamplingParams(
            max_tokens=req.max_tokens, temperature=req.temperature, seed=seed % 2**64,
            ignore_eos=req.ignore_eos, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
            frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
            repetition_penalty=req.repetition_penalty, logit_bias=req.logit_bias,
            min_tokens=req.min_tokens, want_logprobs=req.logprobs is not None,
            logprobs=req.logprobs or 0,
        )  # fmt: skip
        rid = self.id if self.index == 0 else f"{self.id}-{self.index}"
        return serving_pb2.GenerateRequest(
            request_id=rid,
            prompt_token_ids=req.prompt_ids,
            sampling=sampling,
            cache_salt=req.cache_salt,
        )

    async def _prefill(
        self, p: PrefillInstance, gen: serving_pb2.GenerateRequest
    ) -> AsyncGenerator[int, None]:
        """Yield prefill's first token the moment it arrives; fill in the kv_id once stored.

        The client gets the first token while prefill still encodes and stores the KV, so the
        store Put is not on the time to first token. Failures degrade to local prefill.
        """
        start = self.decision.kv_start_token  # decode holds these: only the rest ships
        request = serving_pb2.PrefillRequest(
            request_id=self.id, token_ids=gen.prompt_token_ids, sampling=gen.sampling,
            codec=self.req.kv_codec, kv_start_token=start, cache_salt=gen.cache_salt,
        )  # fmt: skip
        p.in_flight += 1
        sent = time.perf_counter()
        call = p.stub.PrefillStream(request, timeout=self.ctx.cfg.request_timeout_s)
        try:
            async for event in call:
                if event.HasField("opened"):
                    self.marks["prefill_opened_event"] = time.perf_counter() - sent
                    self._start_early_decode(event.opened, gen)
                elif event.HasField("first"):
                    self.marks["prefill_first_event"] = time.perf_counter() - sent
                    self.prefill_first = event.first
                    gen.first_token, gen.has_first_token = event.first.first_token, True
                    first_lp = event.first.first_logprob if event.first.HasField(
                        "first_logprob") else None  # fmt: skip
                    self._token(gen.first_token, first_lp)
                    yield gen.first_token
                    if self.outcome.finish_reason:
                        return
                elif event.HasField("stored"):
                    self.marks["prefill_stored_event"] = time.perf_counter() - sent
                    self.prefill_reply = stored = event.stored
                    gen.kv_id, gen.kv_start_token = stored.kv_id, stored.kv_start_token
                    gen.kv_endpoint = self.ctx.kv_route.get(stored.kv_endpoint, stored.kv_endpoint)
        except grpc.aio.AioRpcError as exc:
            if self._early is not None and gen.has_first_token:
                pass  # decode reads the streamed object: it sees the failure (KV_INCOMPLETE)
            else:
                self._cancel_early(gen)
                self._prefill_failed(exc, gen.has_first_token)
        finally:
            call.cancel()
            p.in_flight -= 1
        if self._early is not None and not gen.has_first_token:
            self._cancel_early(gen)  # the stream ended before its first token
        if not gen.kv_id:
            gen.kv_start_token = 0
        if not gen.kv_id and not self.decision.degrade_reason:
            self._degrade_to_local("prefill_no_kv")

    def _start_early_decode(
        self, opened: serving_pb2.PrefillOpened, gen: serving_pb2.GenerateRequest
    ) -> None:
        """Streamed KV: start decode now; its Get reads the object while prefill writes it
        and the first token comes from the object's tail."""
        gen.kv_id, gen.kv_start_token = opened.kv_id, self.decision.kv_start_token
        gen.kv_endpoint = self.ctx.kv_route.get(opened.kv_endpoint, opened.kv_endpoint)
        if gen.sampling.max_tokens <= 1:  # prefill's first token is all of it: read no KV
            return
        early = serving_pb2.GenerateRequest()
        early.CopyFrom(gen)
        early.first_token_in_kv = True
        self._early_sent = time.perf_counter()
        self._early = self.decision.decode.stub.Generate(
            early, timeout=self.ctx.cfg.request_timeout_s
        )

    def _cancel_early(self, gen: serving_pb2.GenerateRequest) -> None:
        if self._early is not None:
            self._early.cancel()
            self._early = None
            gen.kv_id = gen.kv_endpoint = ""
            gen.kv_start_token = 0

    def _prefill_failed(self, exc: grpc.aio.AioRpcError, started: bool) -> None:
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and not started:
            raise HTTPProblem(400, exc.details() or "bad request", "invalid_value")
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self._degrade_to_local("prefill_overloaded")
        else:  # after the first token: the KV could not be stored; decode prefills itself
            self._degrade_to_local("kv_store_failed" if started else "prefill_unavailable")

    def _degrade_to_local(self, reason: str) -> None:
        self.decision.degrade_reason = reason
        self.decision.route = "local"

    async def _decode(self, gen: serving_pb2.GenerateRequest) -> AsyncGenerator[int, None]:
        d = self.decision.decode
        sent = time.perf_counter()
        call, self._early = self._early, None
        if call is not None:  # streamed KV: started at prefill's opened event
            sent = self._early_sent
        else:
            call = d.stub.Generate(gen, timeout=self.ctx.cfg.request_timeout_s)
        # Prefill's first token went out already; decode echoes it first, skipped here.
        skip = 1 if gen.has_first_token else 0
        try:
            async for chunk in call:
                self.marks.setdefault("decode_first_chunk", time.perf_counter() - sent)
                lps = list(chunk.logprobs)
                for i, token in enumerate(chunk.token_ids):
                    if skip:
                        skip -= 1
                        continue
                    self._token(token, lps[i] if i < len(lps) else None)
                    self.more_ready = i < len(chunk.token_ids) - 1
                    yield token
                    if self.outcome.finish_reason:
                        return
                if chunk.finish_reason:
                    self._finish(chunk)
        except grpc.aio.AioRpcError as exc:
            raise self._decode_problem(exc, bool(self.outcome.tokens)) from None
        finally:
            call.cancel()
        if not self.outcome.finish_reason:
            raise HTTPProblem(502, f"decode {d.name} ended the stream early", "decode_failed")

    def _decode_problem(self, exc: grpc.aio.AioRpcError, started: bool) -> HTTPProblem:
        d, code = self.decision.decode, exc.code()
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and not started:
            self.ctx.metrics.rejections.labels("decode_full").inc()
            return HTTPProblem(
                429, f"decode {d.name}: {exc.details()}", "overloaded",
                headers={"Retry-After": str(self.ctx.cfg.retry_after_s)},
            )  # fmt: skip
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return HTTPProblem(400, exc.details() or "bad request", "invalid_value")
        if code == grpc.StatusCode.UNAVAILABLE:
            # Only an unreachable instance is marked down (until its next good status poll):
            # a request that failed for its own reasons says nothing about the instance.
            d.healthy = False
            if not started:
                return decode_unreachable(d.name, f"{code.name}: {exc.details()}",
                                          self.ctx.cfg.retry_after_s)  # fmt: skip
        where = f"after {len(self.outcome.tokens)} tokens" if started else "before the first token"
        return HTTPProblem(
            502,
            f"decode instance {d.name} failed {where}: {code.name}: {exc.details()}",
            "decode_failed",
        )

    def _token(
        self, token: int, logprob: serving_pb2.TokenLogprob | None = None, *, decode: bool = True
    ) -> None:
        """Record one generated token (``decode``: render the text from the ids; an engine
        that sends its own text has fed it to :attr:`text` already)."""
        now = time.perf_counter()
        m = self.ctx.metrics
        if self.ttft_s is None:
            self.ttft_s = now - self.t0
            self._local_started()
            m.waiting.dec()
            m.running.inc()
        else:
            m.itl.observe(now - self.last_token_s)
            if len(self.outcome.tokens) == 1:
                self.marks["first_to_second_token"] = now - self.t0 - self.ttft_s
        self.last_token_s = now
        m.generation_tokens.inc()
        self.outcome.tokens.append(token)
        self.outcome.logprobs.append(logprob)
        if decode and self.text.update(self.outcome):
            self.outcome.finish_reason = "stop"

    def _finish(self, chunk: serving_pb2.GenerateChunk) -> None:
        st, m = chunk.stats, self.ctx.metrics
        self.outcome.finish_reason = self.outcome.finish_reason or chunk.finish_reason
        degraded = st.degraded or bool(self.decision.degrade_reason)
        reason = st.degrade_reason or self.decision.degrade_reason
        if degraded:
            m.degradations.labels(reason.split(":")[0]).inc()
        if st.transfer_outcome:
            ok = st.transfer_outcome == "ok"
            m.transfer_outcomes.labels(st.transfer_outcome).inc()
            self.ctx.router.breaker.record(ok, st.transfer_ms)
            if ok:
                m.transfer.observe(st.transfer_ms / 1e3)
                m.kv_bytes.inc(st.kv_bytes)
        m.retries.inc(st.retries)
        self._observe(st)
        e2e_s = time.perf_counter() - self.t0
        route = st.route or self.decision.route
        m.finished(
            route,
            self.outcome.finish_reason,
            self.ttft_s,
            e2e_s,
            len(self.outcome.tokens),
            len(self.req.prompt_ids) if self.index == 0 else 0,
        )
        self.outcome.pdx = self._pdx(st, route, degraded, reason, e2e_s)

    def _observe(self, st: serving_pb2.GenerateStats) -> None:
        """Feed the router's live rates (break_even decides on them) with this request."""
        rates, pf, pr = self.ctx.router.rates, self.prefill_first, self.prefill_reply
        first = self.marks.get("prefill_first_event")
        if st.transfer_outcome == "ok" and pf is not None and pr is not None and first:
            rates.observe_remote(prefill_ms=pf.prefill_ms, queue_ms=pf.queue_ms,
                                 computed_tokens=len(self.req.prompt_ids) - pr.cached_tokens,
                                 first_event_ms=first * 1e3, kv_bytes=st.kv_bytes,
                                 transfer_ms=st.transfer_ms, wait_ms=st.kv_wait_ms)  # fmt: skip
        elif st.local_prefill_compute_ms and st.computed_tokens:
            rates.observe_local(local_prefill_ms=st.local_prefill_compute_ms,
                                computed_tokens=st.computed_tokens)  # fmt: skip

    def _pdx(
        self, st: serving_pb2.GenerateStats, route: str, degraded: bool, reason: str, e2e_s: float
    ) -> dict[str, Any]:
        pr = self.prefill_reply
        return {
            "route": route,
            "requested_route": self.req.route,
            "synthetic": self.ctx.synthetic,
            "degraded": degraded,
            "degrade_reason": reason or None,
            "kv_bytes": st.kv_bytes,
            "transfer_ms": round(st.transfer_ms, 3),
            "retries": st.retries,
            "transfer_outcome": st.transfer_outcome or None,
            "decode_instance": st.instance or self.decision.decode.name,
            "prefill_instance": self.decision.prefill.name
            if pr and self.decision.prefill
            else None,
            "kv_id": pr.kv_id if pr else None,
            "cached_tokens": st.cached_tokens,
            "prefill_cached_tokens": pr.cached_tokens if pr else None,
            "kv_start_token": pr.kv_start_token if pr else None,
            "offload": {**self.decision.offload(), "path": route},
            **self._streamed(st),
            "timings_ms": self._timings(st, e2e_s),
        }

    def _streamed(self, st: serving_pb2.GenerateStats) -> dict[str, Any]:
        """Streamed KV figures: how much of the KV's Put and of decode's Get overlapped
        prefill's computation, and the first-to-second-token gap (ms)."""
        pr, marks = self.prefill_reply, self.marks
        gap = marks.get("first_to_second_token")
        out: dict[str, Any] = {
            "kv_streamed": bool(st.kv_streamed or (pr and pr.kv_streamed)),
            "first_to_second_token_ms": round(gap * 1e3, 3) if gap is not None else None,
        }
        if not out["kv_streamed"]:
            return out
        # decode's Get could run from the opened event until prefill's first token
        during = marks.get("prefill_first_event", 0.0) - marks.get("prefill_opened_event", 0.0)
        hidden = min(st.transfer_ms, max(0.0, during * 1e3))
        out.update(
            kv_put_overlap_bytes=pr.kv_overlap_bytes if pr else None,
            kv_put_overlap_ms=round(pr.kv_overlap_ms, 3) if pr else None,
            kv_get_wait_ms=round(st.kv_wait_ms, 3),
            kv_bytes_while_writing=st.kv_bytes_while_writing,
            transfer_overlap_ms=round(hidden, 3),
            transfer_hidden_fraction=round(hidden / st.transfer_ms, 4) if st.transfer_ms else None,
        )
        return out

    def _timings(self, st: serving_pb2.GenerateStats, e2e_s: float) -> dict[str, float | None]:
        """Where the time went (ms): prefill and decode figures plus gateway-side intervals."""
        pf, pr = self.prefill_first, self.prefill_reply

        def ms(value: float | None) -> float | None:
            return None if value is None else round(value, 3)

        return {
            "ttft": ms((self.ttft_s or 0.0) * 1e3),
            "e2e": ms(e2e_s * 1e3),
            "prefill_queue": ms(pf.queue_ms) if pf else None,
            "prefill": ms(pf.prefill_ms) if pf else None,
            "kv_store": ms(pr.store_ms) if pr else None,
            "decode_kv_ready": ms(st.queue_ms),
            "local_prefill": ms(st.local_prefill_ms),
            "first_decode_step": ms(st.first_step_ms),
            **{
                k: ms(self.marks[k] * 1e3) if k in self.marks else None
                for k in MARKS + STREAMED_MARKS
            },
        }
