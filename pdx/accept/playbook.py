"""Acceptance playbooks: target, load matrix, network conditions, criteria and validity rules.

A playbook is validated once (pydantic, unknown keys refused); every problem is reported on its
own line with its path (``matrix.concurrency[2]: must be > 0``). The matrix expands into steps:
network condition (outer) × input length × output length × concurrency (or rate).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pdx.accept.load.section import Load
from pdx.config import build_config, read_yaml
from pdx.faults.wan.cross import CrossTrafficSpec
from pdx.faults.wan.timeline import WanEvent
from pdx.serving.offload_config import Policy

_Strict = ConfigDict(extra="forbid")

PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class Target(BaseModel):
    """What is loaded: an external OpenAI-compatible URL, or a deploy config pdx starts."""

    model_config = _Strict
    url: str | None = Field(default=None, description="base URL, e.g. http://127.0.0.1:8000")
    deploy: str | None = Field(
        None,
        description="'default' (embedded pair) or a deploy YAML path, relative to the playbook",
    )
    deploy_set: list[str] = Field(default_factory=list, description="--set overrides for deploy")
    metrics_path: str = "/metrics"
    ready_path: str = "/readyz"
    ready_timeout_s: PositiveFloat = 180.0
    model: str = Field(
        default="", description="'model' field sent with each request (empty = omitted)"
    )
    extra_body: dict[str, Any] = Field(default_factory=dict, description="merged into each body")
    records_dirs: list[str] = Field(
        default_factory=list,
        description="target.url only: directories (relative to the playbook) holding the "
        "records of a pdx deployment this run did not start, each role's kv.audit_dir "
        "mounted or copied here (prefill's kv-store-*.jsonl, decode's "
        "decode-*-requests.jsonl); the gates that read them (kv_stranded_max_s) are judged",
    )
    netns: NetnsTarget = Field(default_factory=lambda: NetnsTarget())

    @model_validator(mode="after")
    def _one_target(self) -> Target:
        if (self.url is None) == (self.deploy is None):
            raise ValueError("set exactly one of target.url or target.deploy")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"target.url must start with http:// or https:// (got {self.url!r})")
        if self.records_dirs and self.url is None:
            raise ValueError(
                "target.records_dirs is for a target.url (a deploy's records are its own)"
            )
        if self.netns.enabled and self.url is not None:
            raise ValueError("target.netns needs target.deploy (pdx places the pair itself)")
        return self


class NetnsTarget(BaseModel):
    """Deploy into a two-site namespace topology (``pdx faults netns``; root only).

    Prefill runs in ``<prefix>-prefill``, decode and the gateway in ``<prefix>-decode``; every
    KV byte crosses ``<prefix>-router``, where each step's ``bandwidth_mbps``, ``delay_ms``,
    ``jitter_ms`` and ``loss`` act on every wire packet (netem, or pdx's userspace emulator);
    link cuts are applied by the deploy's KV fault proxy on the decode side (connections
    reset). A host link (the first free /30 of ``10.77.3.0/24``) joins this
    namespace to the decode site so the load generator (and the proxy's control) reach it.
    """

    model_config = _Strict
    enabled: bool = False
    prefix: str = Field(default="pdxacc", pattern=r"^[a-z][a-z0-9]{0,11}$")
    rate_mbit: PositiveFloat = Field(
        default=10_000.0, description="router rate when a step sets no bandwidth_mbps"
    )
    mtu: Annotated[int, Field(ge=576, le=9000)] = 1500


class Matrix(BaseModel):
    """The load matrix; each combination (× each network condition) is one step."""

    model_config = _Strict
    input_tokens: list[PositiveInt] | None = Field(
        default=None, min_length=1, description="prompt lengths (not with a trace workload)"
    )
    output_tokens: list[PositiveInt] | None = Field(default=None, min_length=1)
    workload: list[str] | None = Field(
        default=None,
        min_length=1,
        description="trace steps: names from load.workloads, each replayed under every network "
        "condition (and at each matrix.rate_rps, which sets its pace)",
    )
    concurrency: list[PositiveInt] | None = Field(default=None, description="closed loop: users")
    rate_rps: list[PositiveFloat] | None = Field(
        default=None, description="open loop: Poisson req/s"
    )
    network: list[str] = Field(default_factory=lambda: ["normal"], min_length=1)
    offload: list[Policy] | None = Field(
        default=None,
        min_length=2,
        description="offload policies compared on the same traffic: each step is run once per "
        "policy (every request sends pdx_offload), the order alternating from step to step; the "
        "verdict is the first policy's, the others are judged beside it (pdx's gateway)",
    )
    offload_rounds: PositiveInt = Field(
        default=1, description="matrix.offload: each cell runs every policy this many times"
    )
    duration_s: PositiveFloat = 60.0
    exclude: list[dict[str, str | int | float]] = Field(
        default_factory=list,
        description="cells left out of the product: each entry names some of network, "
        "input_tokens, output_tokens, concurrency, rate_rps; a step matching all is dropped",
    )

    @model_validator(mode="after")
    def _one_load_axis(self) -> Matrix:
        if self.workload is not None:  # trace steps: lengths and times come from the trace
            if self.input_tokens or self.output_tokens or self.concurrency:
                raise ValueError(
                    "matrix.workload steps take lengths and load from the trace: leave out "
                    "input_tokens, output_tokens and concurrency"
                )
        elif not self.input_tokens or not self.output_tokens:
            raise ValueError("set matrix.input_tokens and output_tokens (or a trace workload)")
        elif (self.concurrency is None) == (self.rate_rps is None):
            raise ValueError("set exactly one of matrix.concurrency or matrix.rate_rps")
        if self.offload and len(set(self.offload)) != len(self.offload):
            raise ValueError(f"matrix.offload: each policy once (got {self.offload})")
        for i, cell in enumerate(self.exclude):
            unknown = sorted(set(cell) - set(CELL_KEYS))
            if unknown or not cell:
                raise ValueError(
                    f"matrix.exclude[{i}]: name some of {', '.join(CELL_KEYS)} (got {cell})"
                )
        return self


CELL_KEYS = ("network", "input_tokens", "output_tokens", "concurrency", "rate_rps")


class Condition(BaseModel):
    """A network condition on the KV link, applied through the fault proxy for one step.

    ``loss`` on a TCP link is applied as stalls: with that probability per chunk the stream is
    held for ``loss_stall_ms`` (what a retransmission costs); ``link_down_*`` cuts the link at
    ``link_down_at_s`` into the step for ``link_down_for_s`` seconds. Under ``target.netns``
    ``delay_ms``, ``jitter_ms``, ``loss`` and ``bandwidth_mbps`` are packet-level conditions of
    the router hop instead (TCP itself sees the RTT and the lost packets).
    ``idle_s`` (the idle-gap condition) sends nothing for that long before the step's load
    starts, so its first requests are a burst after idle (judged by ``idle_ttft_ratio_max``).
    """

    model_config = _Strict
    delay_ms: Annotated[float, Field(ge=0)] = 0.0
    jitter_ms: Annotated[float, Field(ge=0)] = 0.0
    loss: Annotated[float, Field(ge=0, le=1)] = 0.0
    loss_stall_ms: Annotated[float, Field(ge=0)] = 200.0
    bandwidth_mbps: PositiveFloat | None = None
    link_down_at_s: Annotated[float, Field(ge=0)] | None = None
    link_down_for_s: PositiveFloat | None = None
    kill_prefill_at_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = Field(
        default=None,
        description="SIGKILL prefill instance kill_prefill_index (its process group) this long "
        "into the step; the deploy restarts it (see pdx/accept/target/engine_faults.py)",
    )
    kill_prefill_index: Annotated[int, Field(ge=0)] = 0
    idle_s: Annotated[float, Field(ge=0, le=3600, allow_inf_nan=False)] = Field(
        default=0.0, description="idle-gap: seconds with no request before the step's load"
    )
    duration_s: PositiveFloat | None = Field(
        default=None,
        description="this condition's steps run this long instead of matrix.duration_s (a "
        "fault step that must outlast a restart beside a short normal one)",
    )
    criteria: dict[str, float | str | None] = Field(
        default_factory=dict,
        description="criteria that differ under this condition (null = not judged here)",
    )
    wan_events: list[WanEvent] = Field(
        default_factory=list,
        description="target.netns: changes of the router hop during the step (the WAN "
        "timeline's events: at_s and set / cut / restore / reset), after its pre-flight",
    )
    cross_traffic: CrossTrafficSpec | None = Field(
        default=None, description="target.netns: bulk TCP flows on the router hop for the step"
    )

    @model_validator(mode="after")
    def _link_down_pair(self) -> Condition:
        if (self.link_down_at_s is None) != (self.link_down_for_s is None):
            raise ValueError("link_down_at_s and link_down_for_s go together")
        return self

    @field_validator("criteria")
    @classmethod
    def _known_criteria(cls, value: dict[str, float | str | None]) -> dict[str, float | str | None]:
        unknown = sorted(set(value) - set(Criteria.model_fields))
        if unknown:
            raise ValueError(f"unknown criteria {unknown}; known: {sorted(Criteria.model_fields)}")
        Criteria.model_validate(value)  # the same ranges as the playbook's own criteria
        return value

    @property
    def is_fault(self) -> bool:
        """Whether this condition changes the link at all."""
        return bool(
            self.delay_ms
            or self.jitter_ms
            or self.loss
            or self.bandwidth_mbps
            or self.link_down_at_s is not None
            or bool(self.wan_events)
            or self.cross_traffic is not None
        )


Fraction = Annotated[float, Field(ge=0, le=1)]


class Criteria(BaseModel):
    """Acceptance thresholds; ``None`` = not judged. Rates are fractions (0.01 = 1 %).

    A rate threshold of exactly 0 means "none observed" (judged on the count). The gates
    (``silent_fallback_max`` … ``idle_ttft_ratio_max``) read the servers' own per-request
    records; see docs/accept.md for what each counts.
    """

    model_config = _Strict
    ttft_p50_ms: PositiveFloat | None = None
    ttft_p99_ms: PositiveFloat | None = None
    tpot_p50_ms: PositiveFloat | None = None
    tpot_p99_ms: PositiveFloat | None = None
    transfer_p50_ms: PositiveFloat | None = None
    transfer_p99_ms: PositiveFloat | None = None
    transfer_success_min: Annotated[float, Field(ge=0, le=1)] | None = 0.999
    retry_rate_max: Annotated[float, Field(ge=0)] | None = 0.01
    degrade_rate_max: Annotated[float, Field(ge=0)] | None = 0.01
    error_rate_max: Annotated[float, Field(ge=0, le=1)] | None = 0.0
    eviction_rate_max: Annotated[float, Field(ge=0)] | None = None
    silent_fallback_max: Fraction | None = Field(
        default=0.01,
        description="share of requests labelled disaggregated whose decode did not use "
        "shipped KV (no KV bytes read, or decode prefilled the prompt itself)",
    )
    output_mismatch_max: Fraction | None = Field(
        default=0.0,
        description="share of replayed greedy requests whose tokens differ on the local route",
    )
    kv_stranded_max_s: Annotated[float, Field(ge=0)] | Literal["auto"] | None = Field(
        default="auto",
        description="longest time a KV object stays held after its request ended; "
        "auto = the deploy's kv_transfer_timeout_ms + 2 x the probed RTT p99 (engine: vllm: "
        "how long prefill's KV usage stays above 0 after the step's last request; auto = "
        "vllm.kv_lease_s + 2 x RTT + 1 s)",
    )
    overdue_requests_max: Fraction | None = Field(
        default=0.0,
        description="share of requests still unanswered past judgement.request_deadline_s "
        "+ 2 x RTT",
    )
    plaintext_on_link_max: Fraction | None = Field(
        default=None,
        description="target.netns: share of the packets captured between the sites, while "
        "canary requests run after each step, that carry the canary prompt in the clear "
        "(0: none may; null: no capture)",
    )
    idle_ttft_ratio_max: PositiveFloat | None = Field(
        default=2.0,
        description="idle-gap steps: burst TTFT p99 / steady TTFT p99 of the same step",
    )
    link_verdict: Literal["GO", "auto"] | None = Field(
        default="auto",
        description="pdx probe-link's verdict on the KV link under each step's condition, "
        "against the run's KV demand: GO = must be GO (not_measured without a probe); auto = "
        "judged where preflight.probe_link probes the link, listed as not judged elsewhere",
    )


class Judgement(BaseModel):
    """How criteria are judged: confidence, the replay sample and each request's deadline."""

    model_config = _Strict
    confidence: Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)] = Field(
        default=0.95,
        description="one-sided confidence of every bound; 0 = judge point estimates (labelled)",
    )
    replay_requests: Annotated[int, Field(ge=0, le=1000)] = Field(
        default=300,
        description="per step, greedy requests replayed on the local route (output_mismatch_max; "
        "a threshold of 0 needs 299 with none mismatched to bound the rate to 1 % at 95 %)",
    )
    replay_concurrency: Annotated[int, Field(ge=1, le=64)] = Field(
        default=1,
        description="replays in flight at once; 1 = each alone on decode. More is quicker (300 "
        "replays of a real model take minutes one by one) but batches them, and an engine whose "
        "kernels depend on the batch may then swap a near-tied token (pdx's tiny model did, 1 of "
        "300 at 4): pair it with replay_tie_logprob",
    )
    replay_tie_logprob: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] = Field(
        default=0.0,
        description="nats: a replay whose first differing token was within this of the "
        "replay's own choice (its logprobs) is a near-tie, shown but not a mismatch: for engines "
        "whose kernels depend on the batch (vLLM in bf16 moved logprobs by up to 0.03 nat); "
        "0 = every difference is a mismatch",
    )
    zero_rate_bound: Annotated[float, Field(gt=0, lt=1, allow_inf_nan=False)] = Field(
        default=0.01,
        description="a rate threshold of 0 passes only when none was observed and the sample "
        "bounds the rate at or below this (at judgement.confidence: 299 samples for 1 % at 95 %)",
    )
    request_deadline_s: PositiveFloat | None = Field(
        default=None,
        description="each request's own deadline (overdue_requests_max); default: the deploy's "
        "gateway.request_timeout_s, or load.timeout_s for target.url",
    )
    idle_burst_s: PositiveFloat = Field(
        default=1.0, description="idle-gap: requests sent this long after the gap are the burst"
    )
    repeat_tolerance: Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)] = Field(
        default=0.1,
        description="--repeat: runs whose measured values differ by less than this fraction of "
        "the threshold agree for the verdict, however significant the difference (it cannot "
        "move the decision); 0: any significant difference makes the step unstable",
    )

    @field_validator("confidence")
    @classmethod
    def _meaningful(cls, value: float) -> float:
        if 0 < value < 0.5:
            raise ValueError("expected 0 (point estimates) or a confidence in [0.5, 1)")
        return value


class Validity(BaseModel):
    """When a step's numbers may be judged at all (MLPerf-style VALID / INVALID first)."""

    model_config = _Strict
    min_requests: PositiveInt = 20
    min_duration_s: PositiveFloat = 10.0
    min_load_fraction: Annotated[float, Field(gt=0, le=1)] = Field(
        default=0.9, description="achieved / target load (users busy, or req/s) at least this"
    )


class Preflight(BaseModel):
    """Optional measurements taken before the load, included in the report."""

    model_config = _Strict
    measure_kv: bool = Field(default=False, description="run `pdx measure-kv` (analytic) first")
    model_preset: str | None = Field(
        default=None, description="measure-kv preset; default: the deployed model's name"
    )
    link_gbps: PositiveFloat = Field(default=100.0, description="link speed for the KV budget")
    probe_link: bool = Field(
        default=False, description="run `pdx probe-link` over the KV link (needs target.deploy)"
    )
    probe_duration_s: Annotated[float, Field(ge=0.2, le=60, allow_inf_nan=False)] = 1.0
    probe_streams: Annotated[int, Field(ge=1, le=16)] = 2
    probe_chunk_sizes: str = Field(default="256KiB,1MiB,4MiB", description="chunk sweep sizes")
    probe_chunk_seconds: Annotated[float, Field(ge=0.1, le=10, allow_inf_nan=False)] = 0.5
    probe_each_step: bool = Field(
        default=False,
        description="probe the KV link again under each step's condition, before its load "
        "(RTT, loss, goodput; the figures each step's prediction uses)",
    )
    probe_step_duration_s: Annotated[float, Field(ge=0.2, le=60, allow_inf_nan=False)] = Field(
        default=0.5, description="probe-link --duration of each step's probe"
    )
    advisory: bool = Field(
        default=False,
        description="report the link verdict (criteria.link_verdict) without letting it decide "
        "the run: for playbooks that run links the rules reject on purpose",
    )


class Prediction(BaseModel):
    """The simulator beside every step: predicted vs measured latency, and what to set."""

    model_config = _Strict
    enabled: bool = Field(
        default=False,
        description="simulate each step (model, the step's probed link, the run's measured "
        "compute, the step's own arrivals) and compare with what was measured",
    )
    error_max_pct: PositiveFloat = Field(
        default=25.0,
        description="a step whose measured figure departs from the prediction by more than "
        "this (its whole confidence interval outside ±error_max_pct) is unexplained",
    )


SearchParam = Literal[
    "rate", "concurrency", "rtt_ms", "loss", "bandwidth_mbps", "router.offload.threshold_tokens"
]


class Search(BaseModel):
    """``pdx accept --search PARAM``: the limit of one load or link parameter (docs/accept.md
    "Searching"). Each probe is a full judged step; the answer is the bracket [last GO, first
    NO-GO]. ``rate`` searches open-loop req/s and ``concurrency`` closed-loop users per network
    condition; ``rtt_ms``, ``loss`` and ``bandwidth_mbps`` search the link at the matrix's first
    load and lengths, starting from the first condition's other settings."""

    model_config = _Strict
    param: SearchParam | None = Field(default=None, description="what is searched (null = off)")
    range: tuple[float, float] | None = Field(
        default=None,
        description="LO:HI (or [LO, HI]) the search stays within; default per parameter: "
        "rate 0.5:64, concurrency 1:64, rtt_ms 1:200, loss 0.0001:0.05, bandwidth_mbps 10:10000",
    )
    resolution: PositiveFloat | None = Field(
        default=None,
        description="stop when the bracket is this narrow (the parameter's unit); default: "
        "10 % of the bracket's GO end (1 for concurrency)",
    )
    budget_s: PositiveFloat = Field(
        default=900.0, description="wall time the probes may take (deploy and pre-flight apart)"
    )
    probe_duration_s: PositiveFloat | None = Field(
        default=None, description="each probe's load duration; default matrix.duration_s"
    )
    fresh_deploy: bool = Field(
        default=True,
        description="start the deployment afresh before every probe (after the first), so "
        "each probe sees what a plain run at that value sees, not the breaker window, TCP "
        "windows and estimates earlier probes left; off: one deployment for all (faster)",
    )
    confirm: Annotated[int, Field(ge=0, le=3)] = Field(
        default=1,
        description="once the bracket is narrow its GO end is probed again this many times; "
        "a confirmation that is not GO disputes that value and the search goes on below it "
        "(one GO on a noisy machine can be luck)",
    )
    max_extensions: Annotated[int, Field(ge=0, le=4)] = Field(
        default=2,
        description="an INCONCLUSIVE probe is run again this many times at most, each twice "
        "as long, before it counts as undecided",
    )

    @field_validator("range", mode="before")
    @classmethod
    def _lo_hi(cls, value: Any) -> Any:
        if isinstance(value, str):
            lo, sep, hi = value.partition(":")
            try:
                return (float(lo), float(hi)) if sep else value
            except ValueError:
                raise ValueError("expected LO:HI, two numbers") from None
        return value

    @field_validator("range")
    @classmethod
    def _ordered(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        if value is not None and not (0 < value[0] < value[1] and all(map(_finite, value))):
            raise ValueError(f"expected 0 < LO < HI (got {value[0]:g}:{value[1]:g})")
        return value

    @model_validator(mode="after")
    def _loss_fraction(self) -> Search:
        if self.param == "loss" and self.range is not None and self.range[1] > 0.5:
            raise ValueError(f"range: loss is a fraction, HI <= 0.5 (got {self.range[1]:g})")
        return self


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


class PlaybookSecurity(BaseModel):
    """``security:`` of a playbook, passed to the deploy it starts."""

    model_config = _Strict
    allow_plaintext: bool = Field(
        default=False,
        description="the deploy's security.allow_plaintext: the sites may talk unencrypted "
        "(engine: vllm, or tls.enabled: false); the headline then says PLAINTEXT",
    )


class Playbook(BaseModel):
    """One acceptance run."""

    model_config = _Strict
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str = ""
    target: Target
    matrix: Matrix
    conditions: dict[str, Condition] = Field(default_factory=lambda: {"normal": Condition()})
    criteria: Criteria = Field(default_factory=Criteria)
    judgement: Judgement = Field(default_factory=lambda: Judgement())
    validity: Validity = Field(default_factory=lambda: Validity())
    load: Load = Field(default_factory=lambda: Load())
    preflight: Preflight = Field(default_factory=Preflight)
    prediction: Prediction = Field(default_factory=Prediction)
    search: Search = Field(default_factory=Search)
    baseline: Literal["none", "colocated"] = Field(
        default="none",
        description="colocated: every step is run twice, interleaved, the second time with "
        "every request prefilled where it decodes (pdx_route: local); the report puts the "
        "split beside it (advisory: the baseline never decides the verdict)",
    )
    security: PlaybookSecurity = Field(default_factory=lambda: PlaybookSecurity())
    seed: int = 0
    smoke_scale: bool = Field(
        default=False,
        description="run every cell briefly on a small box: steps of at most 8 s, lengths "
        "x 1/32 (outputs x 1/8), users sqrt(users), validity and replays scaled "
        "(pdx.accept.smoke; applied once, when the playbook is loaded)",
    )

    @model_validator(mode="before")
    @classmethod
    def _one_trace_for_every_step(cls, data: Any) -> Any:
        """``load.workload`` is the matrix's one trace: ``workloads: {trace: ...}``, replayed
        in every step (``matrix.workload: [trace]``)."""
        if not isinstance(data, dict):
            return data
        load, matrix = data.get("load"), data.get("matrix")
        if (isinstance(load, dict) and load.get("workload") and isinstance(matrix, dict)
                and not matrix.get("workload")):  # fmt: skip
            data = {**data, "matrix": {**matrix, "workload": ["trace"]},
                        "load": {**load, "workloads": {**(load.get("workloads") or {}),
                                                       "trace": load["workload"]}}}  # fmt: skip
        return data

    @model_validator(mode="after")
    def _security_reaches_the_deploy(self) -> Playbook:
        item = "security.allow_plaintext=true"
        if (
            self.security.allow_plaintext
            and self.target.deploy
            and item not in self.target.deploy_set
        ):
            self.target.deploy_set = [*self.target.deploy_set, item]
        return self

    @model_validator(mode="after")
    def _conditions_exist(self) -> Playbook:
        unknown = [w for w in self.matrix.workload or [] if w not in self.load.workloads]
        if unknown:
            raise ValueError(
                f"matrix.workload names {unknown} not defined under load.workloads "
                f"(defined: {sorted(self.load.workloads)})"
            )
        missing = [n for n in self.matrix.network if n not in self.conditions]
        if missing:
            raise ValueError(
                f"matrix.network names {missing} not defined under conditions "
                f"(defined: {sorted(self.conditions)})"
            )
        if any(self.conditions[n].is_fault for n in self.matrix.network) and self.target.url:
            raise ValueError("network faults need target.deploy (pdx must own the KV link)")
        if self.preflight.probe_link and self.target.url:
            raise ValueError("preflight.probe_link needs target.deploy (pdx must own the KV link)")
        if self.prediction.enabled and not self.preflight.probe_link:
            raise ValueError(
                "prediction.enabled needs preflight.probe_link (the prediction uses the link "
                "the probe measured)"
            )
        if self.search.param in ("rtt_ms", "loss", "bandwidth_mbps") and self.target.url:
            raise ValueError(
                f"search.param {self.search.param} needs target.deploy (pdx must own the link)"
            )
        if self.baseline == "colocated" and self.target.deploy is None:
            raise ValueError("baseline: colocated needs target.deploy (pdx's gateway routes it)")
        if self.search.param == "router.offload.threshold_tokens" and self.baseline != "none":
            raise ValueError("search.param router.offload.threshold_tokens: baseline none only")
        if self.search.param and self.matrix.offload:
            raise ValueError("search and matrix.offload: search under one policy at a time")
        if self.baseline == "colocated" and self.matrix.offload:
            raise ValueError("baseline: colocated and matrix.offload: compare one at a time")
        for name in self.matrix.network:
            events = self.conditions[name].wan_events
            for key in ("wan_events", "cross_traffic"):
                if getattr(self.conditions[name], key) and not self.target.netns.enabled:
                    raise ValueError(
                        f"conditions.{name}.{key} need target.netns (they act on the router "
                        "hop between the sites)"
                    )
            length, field = self.step_duration_s(name)
            if any(e.at_s >= length for e in events):
                raise ValueError(
                    f"conditions.{name}.wan_events: every at_s must be < {field} ({length})"
                )
        for name in self.matrix.network:
            c = self.conditions[name]
            length, field = self.step_duration_s(name)
            if c.kill_prefill_at_s is not None and self.target.url:
                raise ValueError(
                    f"conditions.{name}.kill_prefill_at_s needs target.deploy (pdx must own "
                    "the prefill process)"
                )
            if c.kill_prefill_at_s is not None and c.kill_prefill_at_s >= length:
                raise ValueError(
                    f"conditions.{name}.kill_prefill_at_s must be < {field} "
                    f"({c.kill_prefill_at_s} >= {length})"
                )
            if c.link_down_at_s is not None and c.link_down_at_s >= length:
                raise ValueError(
                    f"conditions.{name}.link_down_at_s must be < {field} "
                    f"({c.link_down_at_s} >= {length})"
                )
        return self

    def step_duration_s(self, network: str) -> tuple[float, str]:
        """How long a step under ``network`` runs, and the field that says so."""
        own = self.conditions[network].duration_s if network in self.conditions else None
        if own is not None:
            return own, f"conditions.{network}.duration_s"
        return self.matrix.duration_s, "matrix.duration_s"


def load_playbook(path: Path | str, *, dotted: list[str] | None = None) -> Playbook:
    """Read, override (``--set a.b=v``) and validate a playbook; one line per problem on error."""
    data = read_yaml(path)
    pb = build_config(Playbook, source=str(path), base=data, dotted=dotted)
    for w in pb.load.workloads.values():  # a trace path is relative to the playbook
        if not Path(w.trace).is_absolute():
            w.trace = str(Path(path).resolve().parent / w.trace)
    if pb.smoke_scale:
        from pdx.accept.smoke import smoke_scaled

        pb = Playbook.model_validate(smoke_scaled(pb.model_dump(mode="python")))
    return pb


def playbook_dict(pb: Playbook) -> dict[str, Any]:
    """The validated playbook as plain data (for the report)."""
    return pb.model_dump(mode="json")
