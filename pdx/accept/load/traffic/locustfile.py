"""Locust load for an OpenAI-compatible streaming endpoint (the pdx gateway, vLLM, SGLang, ...).

Each streamed request is reported as separate Locust entries (request type ``LLM``):
``ttft``, ``tpot``, ``itl`` (one entry per chunk gap) and ``e2e`` for successful requests, and
``failed`` (with its cause) for failed ones, so failures never mix into latency statistics.
Every request is also written exactly (no rounding) to ``<--pdx-records>/requests-<pid>.jsonl``.

Closed loop (default): ``-u`` users each send the next request when the last one ends.
Open loop: ``--pdx-mode open --pdx-rate R`` sends Poisson arrivals at R req/s in total (split
over all users and workers); latencies count from the *intended* send time.
Trace replay: ``--pdx-mode trace --pdx-trace FILE`` (one user) sends each request of the
trace's window at its own (scaled) time, open loop, with prompts that share what the trace's
hash ids share and the session as ``user`` (``trace_replay.py``; ``--pdx-trace-*`` options).

    locust -f loadtests/locustfile.py --headless -u 8 -r 8 --run-time 60s \
        --host http://127.0.0.1:8000 --csv out/step --pdx-input-len 512 --pdx-output-len 64
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any

import gevent
import requests
from gevent import GreenletExit
from gevent.lock import BoundedSemaphore
from gevent.pool import Group
from locust import User, constant, events, stats, task
from locust.runners import WorkerRunner
from locust.user.task import LOCUST_STATE_STOPPING

from pdx.accept.load.traffic.llm_stream import (
    LengthSpec,
    PromptSample,
    PromptSource,
    RequestRecord,
    build_body,
    load_lengths_file,
    stream_completion,
)
from pdx.accept.load.traffic.trace_replay import TraceSend, add_options, trace_sends

_records_file: Any = None


@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    parser.add_argument("--pdx-mode", choices=["closed", "open", "trace"], default="closed")
    add_options(parser)
    parser.add_argument("--pdx-rate", type=float, default=0.0, help="open loop: total req/s")
    parser.add_argument("--pdx-max-inflight", type=int, default=64, help="open loop, per user")
    parser.add_argument("--pdx-input-len", default="128", help="N or LOW:HIGH (tokens)")
    parser.add_argument("--pdx-output-len", default="64", help="N or LOW:HIGH (tokens)")
    parser.add_argument("--pdx-lengths-file", default="", help="JSONL or input,output lines")
    parser.add_argument("--pdx-prompt-kind", choices=["ids", "text"], default="ids")
    parser.add_argument("--pdx-token-id-max", type=int, default=250)
    parser.add_argument("--pdx-model", default="")
    parser.add_argument("--pdx-endpoint", default="/v1/completions")
    parser.add_argument("--pdx-extra-body", default="{}", help="JSON merged into each body")
    parser.add_argument("--pdx-timeout-s", type=float, default=120.0)
    parser.add_argument("--pdx-seed", type=int, default=0)
    parser.add_argument("--pdx-records", default="", help="directory for per-request JSONL")
    parser.add_argument(
        "--pdx-abort-fraction", type=float, default=0.0, help="cancel after the first token"
    )
    parser.add_argument(
        "--pdx-keep-prompts", type=int, default=0, help="keep prompt ids of ~N requests per user"
    )


_environment: Any = None


@events.init.add_listener
def _on_init(environment: Any, **_kw: Any) -> None:
    global _environment
    _environment = environment
    opts = environment.parsed_options
    if opts is None:
        return
    if not isinstance(environment.runner, WorkerRunner):
        # Custom options travel from the master to its workers; the user count does not.
        opts.pdx_users_total = max(1, int(opts.num_users or 1))


@events.quit.add_listener
def _final_csv(**_kw: Any) -> None:
    """Let Locust's CSV writer write once more after the last request, before it closes.

    It writes every CSV_STATS_INTERVAL_SEC; requests finished after its last pass (the users
    stopping) are in the console summary but would be missing from ``--csv`` files.
    """
    env = _environment
    opts = getattr(env, "parsed_options", None)
    if opts is not None and opts.csv_prefix and not isinstance(env.runner, WorkerRunner):
        gevent.sleep(stats.CSV_STATS_INTERVAL_SEC + 0.2)


@events.test_stop.add_listener
def _on_stop(**_kw: Any) -> None:
    if _records_file is not None:
        _records_file.flush()


def _record(rec: RequestRecord, opts: Any) -> None:
    global _records_file
    if not opts.pdx_records:
        return
    if _records_file is None:
        Path(opts.pdx_records).mkdir(parents=True, exist_ok=True)
        path = Path(opts.pdx_records) / f"requests-{os.getpid()}.jsonl"
        _records_file = path.open("a", buffering=1)
    _records_file.write(rec.to_json() + "\n")


def _fire(environment: Any, name: str, ms: float, length: int = 0, exc: Any = None) -> None:
    environment.events.request.fire(
        request_type="LLM",
        name=name,
        response_time=ms,
        response_length=length,
        exception=exc,
        context={},
    )


def report(environment: Any, rec: RequestRecord) -> None:
    """Turn one measured request into Locust entries and a JSONL record."""
    if rec.aborted:
        if rec.ttft_ms is not None:
            _fire(environment, "ttft_aborted", rec.ttft_ms)
    elif rec.ok and rec.ttft_ms is not None and rec.e2e_ms is not None:
        _fire(environment, "ttft", rec.ttft_ms)
        if rec.tpot_ms is not None:
            _fire(environment, "tpot", rec.tpot_ms)
        for gap in rec.itl_ms:
            _fire(environment, "itl", gap)
        _fire(environment, "e2e", rec.e2e_ms, rec.output_tokens or 0)
    else:
        ms = (rec.e2e_ms or 0.0) if rec.e2e_ms is not None else rec.queue_ms
        _fire(environment, "failed", ms, 0, RuntimeError(rec.error or "failed"))
    _record(rec, environment.parsed_options)


class CompletionUser(User):
    """One simulated client streaming completions (closed or open loop, see module doc)."""

    wait_time = constant(0)

    def __init__(self, environment: Any) -> None:
        super().__init__(environment)
        opts = environment.parsed_options
        self.opts = opts
        rows = load_lengths_file(opts.pdx_lengths_file) if opts.pdx_lengths_file else None
        seed = opts.pdx_seed * 1_000_003 + os.getpid() * 1009 + id(self) % 997
        self.prompts = PromptSource(
            LengthSpec.parse(opts.pdx_input_len),
            LengthSpec.parse(opts.pdx_output_len),
            kind=opts.pdx_prompt_kind,
            token_id_max=opts.pdx_token_id_max,
            rows=rows,
            seed=seed,
        )
        self.rng = random.Random(seed)
        self.extra = json.loads(opts.pdx_extra_body or "{}")
        self.url = (self.host or "").rstrip("/") + opts.pdx_endpoint
        self.session = requests.Session()
        self.pending = Group()
        self.slots = BoundedSemaphore(max(1, opts.pdx_max_inflight))
        self.sent = 0

    def _keep_prompt(self) -> bool:
        """Keep the first N prompts, then each with chance N / sent (spread over the step)."""
        keep = self.opts.pdx_keep_prompts
        return keep > 0 and (self.sent <= keep or self.rng.random() < keep / self.sent)

    def _one(self, t_intended: float, mode: str, sent: TraceSend | None = None) -> None:
        if sent is None:
            sample = self.prompts.next()
        else:
            sample = PromptSample(sent.prompt, sent.input_len, sent.output_len)
        self.sent += 1
        rec = RequestRecord(
            t_intended_s=time.time() - (time.perf_counter() - t_intended),
            mode=mode,
            input_len=sample.input_len,
            output_len_requested=sample.output_len,
        )
        if isinstance(sample.prompt, list) and self._keep_prompt():
            rec.prompt_ids = sample.prompt
        body = build_body(sample, self.opts.pdx_model or None, self.extra)
        if sent is not None:
            rec.trace_line, rec.session = sent.line, sent.session
            rec.ideal_cached_tokens = sent.ideal_cached_tokens
            body["user"] = sent.session  # a router's stickiness can act on it
        abort = self.rng.random() < self.opts.pdx_abort_fraction
        try:
            stream_completion(self.session, self.url, body, rec, t_intended,
                              self.opts.pdx_timeout_s, abort_after_first=abort)  # fmt: skip
        except GreenletExit:
            # The run ended while this request waited: record it (a hang must not vanish).
            rec.unfinished, rec.error = True, "unfinished: the load stopped while it waited"
            _record(rec, self.environment.parsed_options)
            raise
        report(self.environment, rec)

    def _open_one(self, t_intended: float, sent: TraceSend | None = None) -> None:
        with self.slots:
            self._one(t_intended, "trace" if sent else "open", sent)

    @task
    def send(self) -> None:
        """Closed loop: one request per iteration. Open loop: an endless Poisson arrival loop."""
        if self.opts.pdx_mode == "closed":
            self._one(time.perf_counter(), "closed")
            return
        if self.opts.pdx_mode == "trace":
            self._replay()
            return
        users = max(1, int(getattr(self.opts, "pdx_users_total", 1)))
        rate = self.opts.pdx_rate / users
        if rate <= 0:
            raise ValueError("--pdx-mode open needs --pdx-rate > 0")
        t_next = time.perf_counter()
        while not self._stopping():
            t_next += self.rng.expovariate(rate)
            while (delay := t_next - time.perf_counter()) > 0 and not self._stopping():
                gevent.sleep(min(delay, 0.05))  # wakes often enough to stop sending in time
            if not self._stopping():
                self.pending.spawn(self._open_one, t_next)
        # The run is over: no new arrival; those in flight finish (answered, errored or, past
        # Locust's --stop-timeout, recorded unfinished with how long they had waited).
        self.pending.join()

    def _replay(self) -> None:
        """Send the trace window's requests at their times (once), then let them finish."""
        t0 = time.perf_counter()
        for sent in trace_sends(self.opts):
            t_next = t0 + sent.send_s
            while (delay := t_next - time.perf_counter()) > 0 and not self._stopping():
                gevent.sleep(min(delay, 0.05))
            if self._stopping():
                break
            self.pending.spawn(self._open_one, t_next, sent)
        self.pending.join()
        while not self._stopping():  # the window is sent: wait for the step to end
            gevent.sleep(0.2)

    def _stopping(self) -> bool:
        """Locust asked this user to stop (the run time is over; --stop-timeout lets it drain)."""
        return bool(self._state == LOCUST_STATE_STOPPING)

    def on_stop(self) -> None:
        """Stop arrivals still queued or in flight when the run ends."""
        self.pending.kill(block=False)
        self.session.close()
