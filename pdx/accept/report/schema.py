"""The report's schema: the pydantic models behind report.json, the JSON Schema generated from
them (``report.schema.json``, shipped in ``pdx/accept/``), and :func:`load_report`, which reads a
report directory and brings reports of older schema versions up to the current one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pdx.accept.judge.criteria import CriterionResult, ValidityResult
from pdx.errors import InputError

SCHEMA_PATH = Path(__file__).parents[1] / "report.schema.json"
# 2: recommendations became the settings object; the list is what_to_change.
# 3: a criterion's result may be not_measured; threshold-0 criteria carry rate_bound; the link
#    verdict is a criterion per step (link_verdict); not_judged lists the criteria set to null.
# 4: search (pdx accept --search), baseline (split vs colocated), not_a_constraint.
# 5: offload (matrix.offload: policies side by side).
SCHEMA_VERSION = 5


class StepReport(BaseModel):
    """Everything measured in one step."""

    model_config = ConfigDict(extra="forbid")
    id: str
    index: int
    network: str
    condition: dict[str, Any]
    input_tokens: int
    output_tokens: int
    concurrency: int | None
    rate_rps: float | None
    duration_s: float = Field(description="asked for")
    elapsed_s: float = Field(description="first intended send to last stream end")
    valid: bool
    validity_problems: list[str]
    summary: dict[str, Any]
    metrics_delta: dict[str, float] = Field(description="target /metrics after − before (pdx_*)")
    proxy: dict[str, Any] | None = Field(None, description="fault proxy counters for this step")
    fault_events: list[dict[str, Any]] = Field(default_factory=list)
    kernel: dict[str, Any] | None = Field(
        default=None,
        description="netns router: condition set (tbf, nft) and its counters this step",
    )
    preflight: dict[str, Any] | None = Field(
        default=None,
        description="the link probed under this step's condition before its load "
        "(preflight.probe_each_step): probe_link {command, server, report, summary}",
    )
    prediction: dict[str, dict[str, Any]] | None = Field(
        default=None,
        description="per metric (ttft_p50_ms, ttft_p99_ms, second_token_p50_ms, tpot_p50_ms, "
        "transfer_p50_ms): predicted, measured, error_pct, interval, n, result",
    )
    unexplained: bool | None = Field(
        default=None,
        description="a measured figure's whole interval lies beyond ±error_max_pct of the "
        "prediction (null: not predicted)",
    )
    prediction_model: dict[str, Any] | None = Field(
        default=None, description="the simulator inputs of the step's prediction"
    )
    timeline: list[dict[str, Any]] = Field(default_factory=list)
    recovery_s: float | None = None
    kv_stranded_byte_s: float | None = Field(
        default=None,
        description="Σ bytes × seconds the step's KV objects stayed held after request end",
    )
    resources: list[dict[str, Any]] = Field(default_factory=list)
    raw: dict[str, str] = Field(default_factory=dict, description="raw files, relative paths")


class Recommendation(BaseModel):
    """One setting the run's measurements recommend, and the figures behind it."""

    model_config = ConfigDict(extra="forbid")
    value: Any = Field(description="the setting (null when the run cannot tell)")
    why: str
    numbers: dict[str, Any] = Field(default_factory=dict)


RECOMMENDATION_NAMES = (
    "local_prefill_max_tokens",
    "kv_streams",
    "chunk_size_kb",
    "codec",
    "prefill_decode_ratio",
    "congestion_control",
)


def no_recommendations(why: str) -> dict[str, Recommendation]:
    """Every recommendation, none made, each saying why."""
    return {n: Recommendation(value=None, why=why) for n in RECOMMENDATION_NAMES}


class Report(BaseModel):
    """A signed-off (or refused) acceptance run."""

    model_config = ConfigDict(extra="forbid")
    schema_version: Literal[5] = 5
    name: str
    verdict: Literal["GO", "NO-GO", "INCONCLUSIVE"]
    valid: bool
    complete: bool
    exit_code: int
    started_at: str
    finished_at: str
    target: dict[str, Any]
    criteria: list[CriterionResult]
    not_judged: list[dict[str, str]] = Field(
        default_factory=list,
        description="criteria the playbook set to null (globally or under a condition), each "
        "with the steps it covers and why; listed, never counted as met",
    )
    validity: list[ValidityResult]
    what_to_change: list[str] = Field(
        default_factory=list,
        description="what would change each failure (schema 1: the list under recommendations)",
    )
    recommendations: dict[str, Recommendation] = Field(
        default_factory=lambda: no_recommendations("not computed"),
        description="settings for the measured link and load: local_prefill_max_tokens, "
        "kv_streams, chunk_size_kb, codec, prefill_decode_ratio, congestion_control",
    )
    prediction_summary: dict[str, Any] | None = Field(
        default=None, description="steps predicted, unexplained, the compute fitted to the run"
    )
    steps: list[StepReport]
    formulas: dict[str, str]
    metric_names: dict[str, dict[str, str]] = Field(
        default_factory=dict,
        description="each latency metric's name in vllm bench serve, AIPerf, guidellm, MLPerf",
    )
    confidence: float = Field(
        default=0.0, description="judgement.confidence; 0 = criteria judged on point estimates"
    )
    preflight: dict[str, Any] | None = None
    playbook: dict[str, Any]
    environment: dict[str, Any]
    plots: list[str] = Field(default_factory=list, description="PNG files next to the report")
    problems: list[str] = Field(default_factory=list, description="why the run is incomplete")
    search: list[dict[str, Any]] | None = Field(
        default=None,
        description="pdx accept --search: per searched condition the param, limit (last GO), "
        "bracket [last GO, first NO-GO], outcome, every probe with its verdict and sample, the "
        "simulator's predicted_limit and curve, and past the range its extrapolation",
    )
    baseline: dict[str, Any] | None = Field(
        default=None,
        description="baseline: colocated: per step the split beside every request prefilled "
        "locally (TTFT p50/p99, TPOT p50, goodput with intervals) and whether the split pays",
    )
    offload: dict[str, Any] | None = Field(
        default=None,
        description="matrix.offload: per cell each policy's figures (goodput, TTFT p50/p90/p99, "
        "TPOT p50 with intervals, KV bytes and Gbps, share offloaded, decode's prefill time) and "
        "whether the first policy pays over each other one",
    )
    not_a_constraint: list[dict[str, Any]] = Field(
        default_factory=list,
        description="criteria whose threshold is more than 10x the measured value on every "
        "step: a GO says nothing about them",
    )


def report_schema() -> dict[str, Any]:
    """JSON Schema of report.json."""
    schema = Report.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = "https://pdx.dev/schemas/accept-report-v1.json"
    return schema


def write_schema(path: Path = SCHEMA_PATH) -> Path:
    """Regenerate the shipped schema file."""
    path.write_text(json.dumps(report_schema(), indent=2, sort_keys=True) + "\n")
    return path


def load_report(directory: Path | str) -> Report:
    """Read ``DIR/report.json`` (or a report.json path) and validate it."""
    p = Path(directory)
    p = p / "report.json" if p.is_dir() else p
    if not p.is_file():
        raise InputError("report", str(directory), "a report directory containing report.json")
    try:
        data = json.loads(p.read_text())
        if isinstance(data, dict) and data.get("schema_version") == 1:
            data = upgrade_v1(data)
        if isinstance(data, dict) and data.get("schema_version") in (2, 3, 4):
            data = dict(data, schema_version=5)  # 3 to 5 only add fields and a result value
        return Report.model_validate(data)
    except ValueError as exc:
        raise InputError("report", str(p), f"a valid pdx report.json ({exc})") from None


def upgrade_v1(data: dict[str, Any]) -> dict[str, Any]:
    """A schema-1 report as schema 2: its list of changes moves to what_to_change."""
    out = dict(data, schema_version=5)
    old = out.pop("recommendations", None)
    out["what_to_change"] = list(old) if isinstance(old, list) else []
    out["recommendations"] = {
        k: v.model_dump() for k, v in no_recommendations("not in a schema 1 report").items()
    }
    return out
