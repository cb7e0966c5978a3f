"""One choice through vLLM prefill (maybe) and vLLM decode: the two-step P/D protocol.

:class:`EngineFlow` is :class:`~pdx.serving.gateway.flow.Flow` for ``engine: vllm``: the same
tokens, text, stop handling, metrics and ``pdx`` object, with the engines' HTTP protocol in
place of pdx's gRPC pair.

- disaggregated: prefill (``max_tokens: 1``, ``do_remote_decode``) on a healthy prefill
  instance, up to ``kv.kv_retry_budget`` more instances under the gateway's global retry
  budget; its ``kv_transfer_params`` go unchanged to decode, which pulls the KV over NIXL;
- prefill refused, unreachable or slower than ``vllm.prefill_timeout_s``: decode recomputes
  the prompt (a decode request without ``kv_transfer_params``), labelled degraded;
- decode answers an error before the first token although it was given KV (its
  ``kv_load_failure_policy: fail`` after a failed pull, e.g. prefill died meanwhile): the
  request is sent again without the KV, labelled ``kv_load_failed``; counted as a failed
  transfer and in the breaker;
- local route (short prompt, open breaker, ``pdx_route: local``): decode only.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from pdx._proto import serving_pb2
from pdx.serving.engines.client import (
    EngineClient,
    EngineHTTPError,
    EngineUnreachable,
    PrefillResult,
    sampling_body,
    token_logprobs,
)
from pdx.serving.gateway.context import FlowContext
from pdx.serving.gateway.flow import Flow, decode_unreachable
from pdx.serving.gateway.protocol import HTTPProblem
from pdx.serving.router import PrefillInstance
from pdx.transfer.retry import GlobalRetryBudget

_SEED_STEP = 0x9E3779B97F4A7C15  # the same per-choice seed spacing as pdx's own pair


@dataclass(frozen=True)
class EngineSettings:
    """What the gateway needs to know about the engines beyond addresses."""

    served_model: str  # the name the instances serve (``--served-model-name``)
    prefill_timeout_s: float
    retry_budget: int  # more prefill instances tried per request
    kv_load_timeout_s: float  # decode given KV: longest wait for its first token
    kv_bytes_for: Callable[[int], int]  # prompt tokens → bytes of the blocks decode pulls


@dataclass(kw_only=True)
class EngineFlowContext(FlowContext):
    """A flow's view of the engine gateway: the shared state plus the engines' client."""

    engine: EngineSettings
    retry_budget: GlobalRetryBudget
    http: EngineClient | None = None  # set when the gateway connects

    @property
    def client(self) -> EngineClient:
        """The HTTP client to the instances (once the gateway connected)."""
        assert self.http is not None, "the gateway is not connected"
        return self.http


class _KVLoadFailed(Exception):
    """Decode refused a request it was given KV for, before any token."""


class EngineFlow(Flow):
    """A choice served by vLLM instances."""

    ctx: EngineFlowContext

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prefill_result: PrefillResult | None = None
        self.retries = 0
        self.transfer_outcome: str | None = None
        self.kv_ready_ms: float | None = None  # decode call → its first token, when given KV
        self.local_prefill_ms: float | None = None  # the same when decode computed the prompt
        self.engine_cached: int | None = None  # decode's prompt_tokens_details.cached_tokens

    @property
    def pulled_tokens(self) -> int:
        """Prompt tokens whose KV decode pulls: prefill's offer less decode's cached prefix."""
        pr = self.prefill_result
        return max(0, pr.remote_tokens - self.decision.cached_tokens) if pr else 0

    async def events(self) -> AsyncGenerator[int, None]:
        """Generated tokens in order; raises HTTPProblem on failure."""
        self.ctx.metrics.waiting.inc()
        outcome_label = "error"
        try:
            params = None
            if self.decision.route == "disaggregated" and self.decision.prefill is not None:
                params = await self._remote_prefill(self.decision.prefill)
            async with contextlib.aclosing(self._decode(params)) as dec:
                async for token in dec:
                    yield token
                    if self.outcome.finish_reason:  # a stop string: end generation now
                        break
            self._finish_engine()
            outcome_label = "degraded" if self.outcome.pdx.get("degraded") else "ok"
        finally:
            self.account(outcome_label)

    # --- step 1 --------------------------------------------------------------------------

    def _rid(self, step: str) -> str:
        return f"{self.id}-{self.index}-{step}"

    async def _remote_prefill(self, first: PrefillInstance) -> dict[str, Any] | None:
        """kv_transfer_params from a prefill instance, or None (degraded, reason recorded)."""
        ctx, tried = self.ctx, []
        p: PrefillInstance | None = first
        while p is not None:
            tried.append(p.name)
            reason = await self._prefill_once(p, len(tried))
            if reason is None:
                return self.prefill_result.kv_transfer_params if self.prefill_result else None
            others = [q for q in ctx.router.prefills if q.healthy and q.name not in tried]
            p = min(others, key=lambda q: q.in_flight) if others else None
            if (
                p is None
                or self.retries >= ctx.engine.retry_budget
                or not ctx.retry_budget.try_retry()
            ):
                self._degrade_to_local(reason)
                return None
            self.retries += 1
        return None

    async def _prefill_once(self, p: PrefillInstance, attempt: int) -> str | None:
        """One prefill call; None on success, else the degrade reason."""
        ctx = self.ctx
        p.in_flight += 1
        t0 = time.perf_counter()
        try:
            self.prefill_result = await ctx.client.prefill(
                p.address, self.req.prompt_ids, request_id=self._rid(f"p{attempt}"),
                timeout_s=ctx.engine.prefill_timeout_s,
            )  # fmt: skip
        except EngineHTTPError as exc:
            if exc.status in (400, 413, 422):
                raise HTTPProblem(
                    400, f"prefill {p.name}: {exc.message}", "invalid_value"
                ) from None
            ctx.router.breaker.record(False, (time.perf_counter() - t0) * 1e3)
            return "prefill_overloaded" if exc.status in (429, 503) else "prefill_failed"
        except EngineUnreachable as exc:
            p.healthy = False  # until its next good health poll
            ctx.router.breaker.record(False, (time.perf_counter() - t0) * 1e3)
            timed_out = "TimeoutError" in str(exc) or "Timeout" in str(exc)
            return "prefill_timeout" if timed_out else "prefill_unavailable"
        finally:
            p.in_flight -= 1
        self.marks["prefill_first_event"] = self.prefill_result.elapsed_ms / 1e3
        self.decision.prefill = p
        return None

    # --- step 2 --------------------------------------------------------------------------

    def _body(self, params: dict[str, Any] | None) -> dict[str, Any]:
        seed = self.req.seed if self.index == 0 else self.req.seed + self.index * _SEED_STEP
        body = {**sampling_body(self.req, seed), "prompt": self.req.prompt_ids,
                "request_id": self._rid("d" if params else "l")}  # fmt: skip
        if params is not None:
            body["kv_transfer_params"] = params
        return body

    async def _decode(self, params: dict[str, Any] | None) -> AsyncGenerator[int, None]:
        if params is not None:
            try:
                async with contextlib.aclosing(self._stream(self._body(params), True)) as s:
                    async for token in s:
                        yield token
                return
            except _KVLoadFailed as exc:
                self.transfer_outcome = "kv_load_failed"
                self.ctx.router.breaker.record(False, self.kv_ready_ms or 0.0)
                self._degrade_to_local(f"kv_load_failed:{exc}"[:120])
                self.retries += 1
        async with contextlib.aclosing(self._stream(self._body(None), False)) as s:
            async for token in s:
                yield token

    async def _stream(self, body: dict[str, Any], with_kv: bool) -> AsyncGenerator[int, None]:
        d, ctx = self.decision.decode, self.ctx
        sent = time.perf_counter()
        started = False
        # Given KV, decode must start within kv_load_timeout_s: a pull that hangs is abandoned
        # (closing the stream aborts it in vLLM) and the prompt recomputed without the KV.
        first_by = asyncio.timeout(ctx.engine.kv_load_timeout_s if with_kv else None)
        try:
            async with first_by:
                async for token in self._chunks(body, sent, first_by):
                    started = True
                    yield token
                    if self.outcome.finish_reason:
                        return
        except TimeoutError:
            if started:
                raise
            raise _KVLoadFailed(f"no first token in {ctx.engine.kv_load_timeout_s:g} s") from None
        except EngineHTTPError as exc:
            raise self._engine_problem(exc, started, with_kv) from None
        except EngineUnreachable as exc:
            if not started:
                d.healthy = False
                raise decode_unreachable(d.name, str(exc), ctx.cfg.retry_after_s) from None
            where = (
                f"after {len(self.outcome.tokens)} tokens" if started else "before the first token"
            )
            raise HTTPProblem(
                502, f"decode instance {d.name} failed {where}: {exc}", "decode_failed"
            ) from None
        if not self.outcome.finish_reason:
            raise HTTPProblem(502, f"decode {d.name} ended the stream early", "decode_failed")

    async def _chunks(
        self, body: dict[str, Any], sent: float, first_by: asyncio.Timeout
    ) -> AsyncGenerator[int, None]:
        """Tokens of one decode stream, recorded as they arrive."""
        d, ctx = self.decision.decode, self.ctx
        with_kv = "kv_transfer_params" in body
        started = False
        async with contextlib.aclosing(
            ctx.client.stream(d.address, body, timeout_s=ctx.cfg.request_timeout_s)
        ) as chunks:
            async for chunk in chunks:
                if chunk.usage:  # the last chunk (vLLM with --enable-prompt-tokens-details)
                    self.engine_cached = _cached_tokens(chunk.usage)
                if not started and chunk.token_ids:
                    started = True
                    first_by.reschedule(None)
                    first_ms = (time.perf_counter() - sent) * 1e3
                    self.marks.setdefault("decode_first_chunk", first_ms / 1e3)
                    if with_kv:  # decode took the request with its KV: the pull succeeded
                        self.kv_ready_ms, self.transfer_outcome = first_ms, "ok"
                    else:
                        self.local_prefill_ms = first_ms
                lps = token_logprobs(chunk.logprobs) if chunk.logprobs else []
                # vLLM's text is vLLM's detokenization of these ids (stop strings applied):
                # taken as is, not decoded again per token.
                own_text = chunk.text is not None and bool(chunk.token_ids)
                if own_text:
                    count = len(self.outcome.tokens) + len(chunk.token_ids)
                    if self.text.feed(self.outcome, chunk.text or "", count):
                        self.outcome.finish_reason = "stop"
                for i, token in enumerate(chunk.token_ids):
                    self._token(token, _logprob(lps[i]) if i < len(lps) else None,
                                decode=not own_text)  # fmt: skip
                    self.more_ready = chunk.more or i < len(chunk.token_ids) - 1
                    yield token
                    if self.outcome.finish_reason:
                        return
                if chunk.finish_reason:
                    self.outcome.finish_reason = chunk.finish_reason

    def _engine_problem(self, exc: EngineHTTPError, started: bool, with_kv: bool) -> Exception:
        d = self.decision.decode
        if not started and exc.status in (400, 413, 422):
            return HTTPProblem(400, f"decode {d.name}: {exc.message}", "invalid_value")
        if not started and exc.status in (429, 503):
            self.ctx.metrics.rejections.labels("decode_full").inc()
            retry_after = {"Retry-After": str(self.ctx.cfg.retry_after_s)}
            return HTTPProblem(429, f"decode {d.name}: {exc.message}", "overloaded",
                               headers=retry_after)  # fmt: skip
        if not started and with_kv:
            return _KVLoadFailed(f"HTTP {exc.status}")
        where = f"after {len(self.outcome.tokens)} tokens" if started else "before the first token"
        return HTTPProblem(502, f"decode instance {d.name} failed {where}: {exc}", "decode_failed")

    # --- the end -------------------------------------------------------------------------

    def _finish_engine(self) -> None:
        m, ctx = self.ctx.metrics, self.ctx
        self.outcome.finish_reason = self.outcome.finish_reason or "stop"
        reason = self.decision.degrade_reason
        degraded = bool(reason)
        if degraded:
            m.degradations.labels(reason.split(":")[0]).inc()
        pr = self.prefill_result if self.transfer_outcome else None
        kv_bytes = (
            ctx.engine.kv_bytes_for(self.pulled_tokens) if self.transfer_outcome == "ok" else 0
        )
        if self.transfer_outcome:
            ok = self.transfer_outcome == "ok"
            m.transfer_outcomes.labels(self.transfer_outcome).inc()
            if ok:
                ctx.router.breaker.record(True, pr.elapsed_ms if pr else 0.0)
                m.transfer.observe((self.kv_ready_ms or 0.0) / 1e3)
                m.kv_bytes.inc(kv_bytes)
        m.retries.inc(self.retries)
        e2e_s = time.perf_counter() - self.t0
        route = "disaggregated" if self.transfer_outcome == "ok" else "local"
        prompt_tokens = len(self.req.prompt_ids) if self.index == 0 else 0
        m.finished(route, self.outcome.finish_reason, self.ttft_s, e2e_s,
                   len(self.outcome.tokens), prompt_tokens)  # fmt: skip
        self.outcome.pdx = self._engine_pdx(route, degraded, reason, kv_bytes, e2e_s)

    def _engine_pdx(
        self, route: str, degraded: bool, reason: str, kv_bytes: int, e2e_s: float
    ) -> dict[str, Any]:
        pr = self.prefill_result
        shipped = self.transfer_outcome == "ok"

        def ms(value: float | None) -> float | None:
            return None if value is None else round(value, 3)

        return {
            "route": route,
            "requested_route": self.req.route,
            "engine": "vllm",
            "synthetic": False,
            "degraded": degraded,
            "degrade_reason": reason or None,
            "kv_bytes": kv_bytes,
            # Decode call → its first token: the NIXL pull plus one decode step (an upper
            # bound of the transfer; vLLM times transfers only summed: vllm:nixl_xfer_time_seconds).
            "transfer_ms": ms(self.kv_ready_ms) if shipped else 0.0,
            "retries": self.retries,
            "transfer_outcome": self.transfer_outcome,
            "decode_instance": self.decision.decode.name,
            "prefill_instance": self.decision.prefill.name
            if pr and self.decision.prefill
            else None,
            "kv_id": pr.remote_request_id if pr and self.transfer_outcome else None,
            # vLLM's usage.prompt_tokens_details.cached_tokens: on the local route decode's
            # prefix-cache hits; with pulled KV vLLM reports prefill's own hits instead
            # (None: the instance does not report it)
            "cached_tokens": None if shipped else self.engine_cached,
            "prefill_cached_tokens": self.engine_cached if shipped else None,
            "offload": {**self.decision.offload(), "path": route},
            "remote_tokens": pr.remote_tokens if pr and shipped else 0,
            "remote_blocks": pr.remote_blocks if pr and shipped else 0,
            # the part decode pulled: NIXL moves only the blocks decode's cache lacks (as its
            # KV events said when the request was routed); kv_bytes is their size
            "pulled_tokens": self.pulled_tokens if shipped else 0,
            # The id decode got with the KV handle: what its KV-load failure records name.
            "decode_request_id": self._rid("d") if pr else None,
            "timings_ms": {
                "ttft": ms((self.ttft_s or 0.0) * 1e3),
                "e2e": ms(e2e_s * 1e3),
                "prefill": ms(pr.elapsed_ms) if pr else None,
                "kv_ready_on_decode": ms(self.kv_ready_ms) if shipped else None,
                "local_prefill": ms(self.local_prefill_ms),
                "first_to_second_token": ms(self.marks["first_to_second_token"] * 1e3)
                if "first_to_second_token" in self.marks
                else None,
            },
        }


def _cached_tokens(usage: dict[str, Any]) -> int | None:
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


def _logprob(item: tuple[int, float, list[int], list[float]]) -> serving_pb2.TokenLogprob:
    token_id, value, top_ids, top_values = item
    return serving_pb2.TokenLogprob(token_id=token_id, logprob=value, top_ids=top_ids,
                                    top_logprobs=top_values)  # fmt: skip
