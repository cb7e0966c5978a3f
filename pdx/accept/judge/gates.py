"""Gates for the failures other P/D stacks are known for, from the servers' own records.

- silent fallback: requests labelled ``disaggregated`` whose decode did not use shipped KV —
  decode's own per-request figures in the ``pdx`` object (``kv_bytes`` it read, the time it
  spent prefilling the prompt itself), not the route label; with vLLM engines, decode's own
  record of each request whose KV load failed (the engine hook behind
  ``PDX_VLLM_KV_FAILURES``), matched to the requests the gateway labelled disaggregated;
- wrong output: a sample of greedy requests replayed on the local route, token ids compared;
- stranded KV: how long each KV object stayed in the store after its request ended, from the
  store's audit log (put, then release / expire / evict) and decode's per-request records;
  with vLLM engines, how long prefill's KV usage stayed above 0 after the step's last request
  ended (:mod:`pdx.accept.judge.engine_kv`);
- overdue: requests still unanswered past their own deadline + 2 × RTT;
- idle gap: the first burst after an idle period against the same step's steady TTFT.

Everything here is pure (records in, numbers out) except :func:`replay`, which sends requests,
and the engine stranded-KV watch, which reads the gateway's metrics.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import random
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# --- silent fallback ---------------------------------------------------------------------


def decode_used_shipped_kv(pdx: dict[str, Any]) -> bool:
    """Decode's own figures say it consumed shipped KV: bytes read and no prompt prefill."""
    local_prefill_ms = float((pdx.get("timings_ms") or {}).get("local_prefill") or 0.0)
    return int(pdx.get("kv_bytes") or 0) > 0 and local_prefill_ms == 0.0


def silent_fallback(rows: list[dict[str, Any]]) -> dict[str, int] | None:
    """Among ok requests labelled disaggregated (more than one token): how many did not use KV.

    None when no record carries a ``pdx`` object (a target that does not report per request).
    """
    objs = [r for r in rows if r.get("ok") and isinstance(r.get("pdx"), dict)]
    if not objs:
        return None
    labelled = [
        r["pdx"]
        for r in objs
        if r["pdx"].get("route") == "disaggregated" and (r.get("output_tokens") or 0) > 1
    ]
    silent = sum(1 for p in labelled if not decode_used_shipped_kv(p))
    return {"labelled_disaggregated": len(labelled), "silent_fallback": silent}


def engine_silent_fallback(
    rows: list[dict[str, Any]], audit_dirs: list[Path]
) -> dict[str, int] | str:
    """vLLM: ok requests labelled disaggregated (more than one token) whose decode request
    is in decode's KV-load failure records (vLLM recomputed the prompt: ``recompute``
    policy), or why this cannot be told.

    Only a record file whose first line says the hook is in place counts, so that no record
    of a request means its load did not fail rather than that nothing was recording.
    """
    if not audit_dirs:
        return "kv.audit_dir is unset, where decode writes its KV-load failure records"
    hooked, failed = False, []
    for path in globbed(audit_dirs, "*.kv-load-failures.jsonl"):
        for line in path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("hook") == "kv_load_failures":
                hooked = True
            elif rec.get("request_id"):
                failed.append(str(rec["request_id"]))
    if not hooked:
        return ("decode kept no KV-load failure record (an engine pdx did not start, or a "
                "vLLM environment without pdx's engine hooks: make vllm)")  # fmt: skip
    labelled = [
        r["pdx"]
        for r in rows
        if r.get("ok") and isinstance(r.get("pdx"), dict)
        and r["pdx"].get("route") == "disaggregated" and (r.get("output_tokens") or 0) > 1
    ]  # fmt: skip
    if any(not p.get("decode_request_id") for p in labelled):
        return "the gateway's records do not name decode's request ids"
    # vLLM's own id wraps the one the gateway sent (``cmpl-<id>``, maybe a suffix).
    silent = sum(1 for p in labelled if any(p["decode_request_id"] in f for f in failed))
    return {"labelled_disaggregated": len(labelled), "silent_fallback": silent}


def _engine_rows(rows: list[dict[str, Any]]) -> bool:
    """The records come from a gateway in front of vLLM engines (``pdx.engine: vllm``)."""
    return any(isinstance(r.get("pdx"), dict) and r["pdx"].get("engine") == "vllm" for r in rows)


# --- overdue -----------------------------------------------------------------------------


def overdue(rows: list[dict[str, Any]], deadline_s: float, rtt_s: float) -> dict[str, Any]:
    """Requests still waiting past ``deadline_s + 2 × rtt_s`` (answered late or never).

    Requests cut off by the end of the load before their deadline are not counted either way.
    """
    limit_s = deadline_s + 2 * rtt_s
    judged, late = 0, 0
    for r in rows:
        elapsed_s = float(r.get("elapsed_ms") or r.get("e2e_ms") or 0.0) / 1e3
        if r.get("unfinished") and elapsed_s <= limit_s:
            continue  # censored: it might still have been answered in time
        judged += 1
        late += elapsed_s > limit_s
    return {"overdue": late, "overdue_judged": judged, "overdue_limit_s": limit_s}


# --- stranded KV -------------------------------------------------------------------------


def parse_ts(ts: str) -> float:
    """An audit time stamp (``2026-11-29T09:15:48.123Z``) as Unix seconds."""
    t = dt.datetime.strptime(ts, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=dt.UTC)
    return t.timestamp()


def read_jsonl(paths: list[Path]) -> list[dict[str, Any]]:
    """Every JSON line of every file (files that do not exist yet are skipped)."""
    out: list[dict[str, Any]] = []
    for path in paths:
        if path.is_file():
            for line in path.read_text(errors="replace").splitlines():
                if line.strip():
                    try:
                        out.append(json.loads(line))
                    except ValueError:  # a line cut by a process killed mid-write
                        continue
    return out


@dataclass
class HeldObject:
    """One KV object as the store's audit log and the request records show it."""

    kv_id: str
    bytes: int
    stored_s: float  # the Put completed: readable from here
    deleted_s: float | None = None
    deleted_by: str = ""  # release | expire | evict | abandon
    request_end_s: float | None = None
    end_from: str = "created"  # decode | client | created (no request record names it)

    def stranded_s(self, observed_s: float) -> float:
        """Seconds held after its request ended (up to ``observed_s`` while still held)."""
        end = self.request_end_s if self.request_end_s is not None else self.stored_s
        return max(0.0, (self.deleted_s if self.deleted_s is not None else observed_s) - end)


def held_objects(
    audit: list[dict[str, Any]],
    decode_records: list[dict[str, Any]],
    rows: list[dict[str, Any]],
) -> dict[str, HeldObject]:
    """Objects put into the store, with when they were deleted and when their request ended.

    A request's end is decode's record of it (the Generate call that read the kv_id ended:
    finished, failed or cancelled), else the client's (its stream ended); an object no request
    record names was never handed to decode, so its request was over when it was stored.
    """
    objs: dict[str, HeldObject] = {}
    for rec in audit:
        kv_id = rec.get("kv_id")
        if not kv_id or "ts" not in rec:
            continue
        event = rec.get("event")
        if event == "put" and rec.get("outcome") == "ok" and not rec.get("missing_chunks"):
            objs.setdefault(
                kv_id, HeldObject(kv_id, int(rec.get("bytes") or 0), parse_ts(rec["ts"]))
            )
        elif rec.get("outcome") == "deleted" and kv_id in objs and objs[kv_id].deleted_s is None:
            objs[kv_id].deleted_s = parse_ts(rec["ts"])
            objs[kv_id].deleted_by = str(event)
    for r in rows:
        kv_id = (r.get("pdx") or {}).get("kv_id")
        if kv_id in objs:
            end = float(r["t_intended_s"]) + float(r.get("elapsed_ms") or 0.0) / 1e3
            objs[kv_id].request_end_s, objs[kv_id].end_from = end, "client"
    for d in decode_records:
        kv_id = d.get("kv_id")
        if kv_id in objs and "ts" in d:
            objs[kv_id].request_end_s, objs[kv_id].end_from = parse_ts(d["ts"]), "decode"
    return objs


def stranded(objs: list[HeldObject], bound_s: float, observed_s: float) -> dict[str, Any]:
    """Per step: the longest hold after request end, bytes × seconds, objects over the bound."""
    holds = [(o, o.stranded_s(observed_s)) for o in objs]
    worst = max(holds, key=lambda h: h[1], default=None)
    return {
        "kv_objects": len(objs),
        # no object, no measurement: the criterion is not_measured, never "0 s held"
        "kv_stranded_max_s": worst[1] if worst else None,
        "_kv_stranded_holds_s": [s for _, s in holds],
        "kv_stranded_byte_s": sum(o.bytes * s for o, s in holds),
        "kv_stranded_over_bound": sum(1 for _, s in holds if s > bound_s),
        "kv_stranded_still_held": sum(1 for o in objs if o.deleted_s is None),
        "kv_stranded_bound_s": bound_s,
        "kv_stranded_worst": (
            {
                "kv_id": worst[0].kv_id,
                "bytes": worst[0].bytes,
                "held_after_end_s": round(worst[1], 3),
                "deleted_by": worst[0].deleted_by or "still held",
                "request_end_from": worst[0].end_from,
            }
            if worst and worst[1] > 0
            else None
        ),
    }


# --- idle gap ----------------------------------------------------------------------------


def idle_burst(rows: list[dict[str, Any]], t0_s: float, burst_s: float) -> dict[str, Any] | None:
    """TTFTs of the burst (sent within ``burst_s`` of the step start) and of the steady rest.

    The steady part starts one burst length after the burst, so the burst's tail is not in it.
    The burst is timed from the first request sent (``t0_s`` at the earliest): a load generator
    slow to start only lengthens the idle gap, it does not empty the burst.
    """
    sent = [r["t_intended_s"] for r in rows if r.get("t_intended_s") is not None]
    start = max(t0_s, min(sent, default=t0_s))
    ok = [r for r in rows if r.get("ok") and r.get("ttft_ms") is not None]
    burst = [r["ttft_ms"] for r in ok if r["t_intended_s"] - start < burst_s]
    steady = [r["ttft_ms"] for r in ok if r["t_intended_s"] - start >= 2 * burst_s]
    if not burst or not steady:
        return None
    return {
        "burst_requests": len(burst),
        "burst_ttft_p99_ms": float(np.percentile(burst, 99)),
        "steady_requests": len(steady),
        "steady_ttft_p99_ms": float(np.percentile(steady, 99)),
        "idle_ttft_ratio": float(np.percentile(burst, 99))
        / max(float(np.percentile(steady, 99)), 1e-9),
        "_steady_ttft_ms": steady,
        "_burst_ttft_ms": burst,
    }


# --- replay ------------------------------------------------------------------------------


def replay_candidates(
    rows: list[dict[str, Any]], extra_body: dict[str, Any], count: int, seed: int
) -> list[dict[str, Any]]:
    """Up to ``count`` greedy requests that used shipped KV and kept their prompt and tokens."""
    if float(extra_body.get("temperature", 0) or 0) != 0:
        return []  # sampled requests cannot be compared token for token
    pool = [
        r
        for r in rows
        if r.get("ok")
        and r.get("prompt_ids")
        and r.get("output_ids")
        and isinstance(r.get("pdx"), dict)
        and r["pdx"].get("route") == "disaggregated"
        and decode_used_shipped_kv(r["pdx"])
    ]
    random.Random(seed).shuffle(pool)
    return pool[:count]


async def replay(
    url: str,
    candidates: list[dict[str, Any]],
    extra_body: dict[str, Any],
    model: str,
    timeout_s: float,
    tie_logprob: float = 0.0,
    concurrency: int = 1,
) -> dict[str, Any]:
    """Send each candidate again on the local route (decode prefills it); compare token ids.

    Up to ``concurrency`` replays are in flight at once (1: each alone on decode; more is
    quicker but batches them, which an engine whose kernels depend on the batch answers with
    its own near-tie swaps).
    With ``tie_logprob`` > 0 the replay also asks for each token's top logprobs (by token id):
    a replay whose first differing token was, in the replay's own logprobs, within
    ``tie_logprob`` nats of the token it chose is a near-tie (an engine whose kernels depend on
    the batch moves logprobs by a few hundredths of a nat in bf16): counted and shown, not a
    mismatch. A first difference farther apart, or not among the top alternatives, is one.
    """
    import aiohttp

    salt = secrets.token_hex(6)
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(session: aiohttp.ClientSession, i: int, r: dict[str, Any]) -> dict[str, Any]:
        body = {
            **extra_body,
            "prompt": r["prompt_ids"],
            "max_tokens": r["output_len_requested"],
            "temperature": 0,
            "stream": False,
            "return_token_ids": True,
            "pdx_route": "local",
            # A salt of its own: a vLLM decode keeps the blocks it pulled for the original
            # request in its prefix cache, and without one the replay would read them again
            # instead of prefilling the prompt (no effect on pdx's own engine).
            "cache_salt": f"pdx-replay-{salt}-{i}",
            **({"model": model} if model else {}),
        }
        if tie_logprob > 0:
            body.update(logprobs=TIE_TOP, return_tokens_as_token_ids=True)
        async with gate:
            try:
                async with session.post(url + "/v1/completions", json=body) as resp:
                    data = await resp.json(content_type=None) if resp.status == 200 else None
            except (aiohttp.ClientError, TimeoutError, ValueError):
                data = None
        return ((data or {}).get("choices") or [{}])[0]

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        answers = await asyncio.gather(*(one(session, i, r) for i, r in enumerate(candidates)))
    mismatches: list[dict[str, Any]] = []
    ties: list[dict[str, Any]] = []
    errors = 0
    for r, choice in zip(candidates, answers, strict=True):
        ids = choice.get("token_ids")
        if ids is None:
            errors += 1
        elif list(ids) != list(r["output_ids"]):
            seen = _mismatch(r, list(ids), choice.get("logprobs"))
            gap = seen["logprob_gap"]  # < 0: the logprobs do not show the choice; no tie
            (ties if gap is not None and 0 <= gap <= tie_logprob else mismatches).append(seen)
    return {
        # every replay sent stays in the denominator: one that errored is neither a match nor
        # a mismatch, and the criterion's bounds count it both ways
        "replayed": len(candidates),
        "replay_mismatches": len(mismatches),
        "replay_errors": errors,
        "replay_mismatch_examples": mismatches[:3],
        **({"replay_near_ties": len(ties), "replay_near_tie_examples": ties[:3],
            "replay_tie_logprob": tie_logprob} if tie_logprob > 0 else {}),
    }  # fmt: skip


TIE_TOP = 5  # alternatives per token a near-tie replay asks for


def _mismatch(r: dict[str, Any], local: list[int], logprobs: Any = None) -> dict[str, Any]:
    """Where the replay first differs; with the replay's logprobs (tokens as ``token_id:N``),
    how far below its own choice the shipped run's token was there (None: not among them)."""
    shipped = list(r["output_ids"])
    first = next((i for i, (a, b) in enumerate(zip(shipped, local, strict=False)) if a != b),
                 min(len(shipped), len(local)))  # fmt: skip
    gap = None
    if isinstance(logprobs, dict) and first < min(len(shipped), len(local)):
        tops = logprobs.get("top_logprobs") or []
        chosen = logprobs.get("token_logprobs") or []
        if first < min(len(tops), len(chosen)) and tops[first] and chosen[first] is not None:
            other = tops[first].get(f"token_id:{shipped[first]}")
            gap = None if other is None else round(float(chosen[first]) - float(other), 6)
    return {
        "kv_id": r["pdx"].get("kv_id"),
        "first_difference_at_token": first,
        "disaggregated": shipped[:16],
        "local": local[:16],
        "logprob_gap": gap,
    }


# --- one step ----------------------------------------------------------------------------


def globbed(dirs: list[Path], pattern: str) -> list[Path]:
    """Files matching ``pattern`` in every directory, sorted by name within each."""
    return [p for d in dirs for p in sorted(d.glob(pattern))]


@dataclass
class GateContext:
    """What the gates of every step need from the run (fixed once the target is up)."""

    url: str
    # Where the store audit and decode's records are: the deploy's kv.audit_dir, or for a
    # target.url the directories of target.records_dirs (one per host's role).
    audit_dirs: list[Path]
    deadline_s: float  # each request's own deadline
    rtt_s: float  # measured RTT p99 (0 when the link was not probed)
    stranded_bound_s: float | None  # kv_stranded_max_s "auto"
    extra_body: dict[str, Any]
    model: str = ""
    timeout_s: float = 120.0
    replay_requests: int = 16
    replay_tie_logprob: float = 0.0
    replay_concurrency: int = 1
    idle_burst_s: float = 1.0
    seed: int = 0
    # engine: vllm — where prefill's KV usage is read (the gateway's /metrics) for the
    # stranded-KV gate (pdx.accept.judge.engine_kv); None: no such target
    metrics_url: str | None = None
    # pdx's own pair: the cap on KV across the link (kv.max_link_gbps / max_link_share), Gbit/s
    kv_link_cap_gbps: float | None = None
    # target.netns with plaintext_on_link_max: the canary capture between the sites
    wire: Any = None  # pdx.accept.target.wire.WireCheck


def gate_context(
    pb: Any, playbook_dir: Path, url: str, preflight: dict[str, Any] | None,
    audit_dirs: list[Path], topology: Any = None,
) -> GateContext:  # fmt: skip
    """Deadlines and bounds of the gates, from the deploy config and the probed RTT; with a
    namespace ``topology`` and ``plaintext_on_link_max`` set, the canary capture too."""
    from pdx.accept.preflight.kv import deploy_config, transfer_deadline_s

    summary = ((preflight or {}).get("probe_link") or {}).get("summary") or {}
    rtt_s = float(summary.get("rtt_p99_ms") or 0.0) / 1e3
    deadline, bound, cap = pb.judgement.request_deadline_s, None, None
    metrics_url: str | None = None
    if pb.target.deploy is not None:
        cfg = deploy_config(pb.target, playbook_dir)
        deadline = deadline or cfg.gateway.request_timeout_s
        if cfg.engine == "pdx":
            bound = transfer_deadline_s(cfg.kv.kv_transfer_timeout_ms, summary, preflight)
            cap = cfg.kv.link_cap_gbps
            bound += 2 * rtt_s
        else:  # vLLM's prefill frees KV nobody pulled when its lease runs out
            bound = cfg.vllm.kv_lease_s + 2 * rtt_s + 1.0
            metrics_url = url + pb.target.metrics_path
    elif pb.target.records_dirs:  # its kv_transfer_timeout_ms is not known here: derived
        bound = transfer_deadline_s(None, summary, preflight) + 2 * rtt_s
    wire = None
    if topology is not None and pb.criteria.plaintext_on_link_max is not None:
        from pdx.accept.target.wire import WireCheck

        wire = WireCheck(str(topology.cfg.router), token_id_max=pb.load.token_id_max,
                         seed=pb.seed, extra_body=dict(pb.target.extra_body),
                         model=pb.target.model, timeout_s=pb.load.timeout_s)  # fmt: skip
    return GateContext(
        url=url,
        audit_dirs=audit_dirs,
        deadline_s=deadline or pb.load.timeout_s,
        rtt_s=rtt_s,
        stranded_bound_s=bound,
        extra_body=dict(pb.target.extra_body),
        model=pb.target.model,
        timeout_s=pb.load.timeout_s,
        replay_requests=pb.judgement.replay_requests,
        replay_tie_logprob=pb.judgement.replay_tie_logprob,
        replay_concurrency=pb.judgement.replay_concurrency,
        idle_burst_s=pb.judgement.idle_burst_s,
        seed=pb.seed,
        metrics_url=metrics_url,
        kv_link_cap_gbps=cap,
        wire=wire,
    )


@dataclass
class StepGates:
    """A step's gate facts (merged into its summary), extra samples and what was not measured."""

    facts: dict[str, Any]
    samples: dict[str, list[float]]
    not_measured: list[str]


async def collect(
    ctx: GateContext, rows: list[dict[str, Any]], t0_s: float, idle_s: float, step_index: int,
    input_tokens: int = 0,
) -> StepGates:  # fmt: skip
    """Every gate's facts for one step (replaying its sample on the local route; with a wire
    check, capturing the link while canary prompts of ``input_tokens`` cross it)."""
    facts: dict[str, Any] = {}
    missing: list[str] = []
    if ctx.wire is not None:  # first: the step's conditions are still on the link
        facts.update(await ctx.wire.check(ctx.url, input_tokens))
        if not facts.get("wire_captures"):
            missing.append(f"plaintext_on_link_max: {facts.get('wire_error') or 'no packet'}")
    fallback = silent_fallback(rows)
    if _engine_rows(rows):
        # vLLM's route label is the gateway's own: "disaggregated" once decode, given the KV
        # handle, emits a token. vLLM's counters are summed over requests (and count pulled
        # tokens at admission, before a load can fail); decode's own failure records, per
        # request, are what tells a quiet recompute apart.
        engine = engine_silent_fallback(rows, ctx.audit_dirs)
        if isinstance(engine, str):
            missing.append(f"silent_fallback_max: engine vllm: {engine}")
        else:
            facts.update(engine)
            if not engine["labelled_disaggregated"]:
                missing.append("silent_fallback_max: no request was labelled disaggregated")
    elif fallback is None:
        missing.append("silent_fallback_max: the target reports no per-request pdx object")
    else:
        facts.update(fallback)
        if not fallback["labelled_disaggregated"]:
            missing.append("silent_fallback_max: no request was labelled disaggregated")
    facts.update(overdue(rows, ctx.deadline_s, ctx.rtt_s))
    facts["deadline_s"] = ctx.deadline_s
    from_engine = _engine_rows(rows)
    if from_engine:  # before the replay: its requests must not be what prefill is seen holding
        await _engine_stranded_facts(ctx, rows, facts, missing)
    await _replay_facts(ctx, rows, step_index, facts, missing)
    samples: dict[str, list[float]] = {}
    if idle_s > 0:
        facts["idle_s"] = idle_s  # an idle-gap step: idle_ttft_ratio_max applies to it
        burst = idle_burst(rows, t0_s, ctx.idle_burst_s)
        if burst is None:
            missing.append("idle_ttft_ratio_max: no ok request in the burst or after it")
        else:
            samples["steady_ttft_ms"] = burst.pop("_steady_ttft_ms")
            samples["burst_ttft_ms"] = burst.pop("_burst_ttft_ms")
            facts.update(burst, idle_s=idle_s)
    if from_engine:
        pass  # judged from prefill's own KV usage above
    elif not ctx.audit_dirs or ctx.stranded_bound_s is None:
        missing.append(
            "kv_stranded_max_s: no KV store audit log (engine: vllm, or a target.url without "
            "target.records_dirs)"
        )
    else:
        audit = read_jsonl(globbed(ctx.audit_dirs, "kv-store-*.jsonl"))
        records = read_jsonl(globbed(ctx.audit_dirs, "decode-*-requests.jsonl"))
        now = time.time()
        objs = [o for o in held_objects(audit, records, rows).values() if o.stored_s >= t0_s]
        facts.update(stranded(objs, ctx.stranded_bound_s, now))
    return StepGates(facts, samples, missing)


async def _engine_stranded_facts(
    ctx: GateContext, rows: list[dict[str, Any]], facts: dict[str, Any], missing: list[str]
) -> None:
    """vLLM: KV prefill still holds once the step's requests ended, from its KV usage."""
    from pdx.accept.judge.engine_kv import watch_prefill_kv

    if ctx.metrics_url is None or ctx.stranded_bound_s is None:
        missing.append("kv_stranded_max_s: the target's prefill KV usage is not readable here "
                       "(a target.url in front of vLLM: set a number, or null)")  # fmt: skip
        return
    shipped = sum(1 for r in rows if (r.get("pdx") or {}).get("route") == "disaggregated")
    held = await watch_prefill_kv(ctx.metrics_url, rows, ctx.stranded_bound_s, shipped)
    if isinstance(held, str):
        missing.append(f"kv_stranded_max_s: engine vllm: {held}")
    else:
        facts.update(held)


async def _replay_facts(
    ctx: GateContext,
    rows: list[dict[str, Any]],
    step_index: int,
    facts: dict[str, Any],
    missing: list[str],
) -> None:
    if ctx.replay_requests <= 0:
        return
    picked = replay_candidates(rows, ctx.extra_body, ctx.replay_requests, ctx.seed + step_index)
    if not picked:
        missing.append(
            "output_mismatch_max: no greedy request that used shipped KV kept its prompt and "
            "token ids (needs return_token_ids and a pdx gateway)"
        )
        return
    result = await replay(ctx.url, picked, ctx.extra_body, ctx.model, ctx.timeout_s,
                          ctx.replay_tie_logprob, ctx.replay_concurrency)  # fmt: skip
    facts.update(result)
