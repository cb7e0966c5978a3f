"""Workloads: Poisson arrivals with a prompt-length mix, or a JSONL trace to replay."""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdx.config import validation_problems
from pdx.errors import ConfigError, InputError
from pdx.sim.config import WorkloadConfig


@dataclass
class Workload:
    """Requests sorted by arrival: parallel lists of arrival time, prompt and output tokens."""

    arrival_s: list[float]
    prompt_tokens: list[int]
    output_tokens: list[int]
    source: str

    def __len__(self) -> int:
        return len(self.arrival_s)


def poisson_workload(cfg: WorkloadConfig) -> Workload:
    """Draw, per request, an exponential gap then a prompt length (in that order).

    The order of draws matters: it is what makes seed 7 reproduce the published workload.
    """
    rng = random.Random(cfg.seed)
    rate = cfg.rate_per_s
    lengths = cfg.prompt_tokens
    # the cumulative weights choices() would compute on every call: same draws, less work
    cum = list(itertools.accumulate(cfg.prompt_weights))
    expo, choices = rng.expovariate, rng.choices
    t = 0.0
    arrival: list[float] = []
    prompt: list[int] = []
    for _ in range(cfg.requests):
        t += expo(rate)
        arrival.append(t)
        prompt.append(choices(lengths, cum_weights=cum)[0])
    output = [cfg.output_tokens] * cfg.requests
    source = f"poisson(rate={rate}/s, n={cfg.requests}, seed={cfg.seed})"
    return Workload(arrival, prompt, output, source)


class TraceRecord(BaseModel):
    """One line of a replay trace. Extra keys (ids, timestamps) are ignored."""

    model_config = ConfigDict(extra="ignore")

    arrival_s: float = Field(ge=0)
    prompt_tokens: int = Field(gt=0)
    output_tokens: int = Field(gt=0)


def load_trace(path: Path | str) -> Workload:
    """Read a JSONL trace; every problem names its line. Records are sorted by arrival."""
    p = Path(path)
    if not p.is_file():
        raise InputError("workload", str(p), "an existing JSONL trace file")
    rows: list[tuple[float, int, int]] = []
    problems: list[str] = []
    with p.open() as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                rec = TraceRecord.model_validate(json.loads(line))
            except json.JSONDecodeError as exc:
                problems.append(f"line {lineno}: not JSON ({exc.msg})")
            except ValidationError as exc:
                problems.extend(f"line {lineno}: {msg}" for msg in validation_problems(exc))
            else:
                rows.append((rec.arrival_s, rec.prompt_tokens, rec.output_tokens))
            if len(problems) >= 10:
                break
    if problems:
        raise ConfigError(str(p), problems)
    if not rows:
        raise ConfigError(str(p), ["the trace holds no requests"])
    rows.sort(key=lambda r: r[0])
    return Workload(
        [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], f"trace {p.name}"
    )


def build_workload(cfg: WorkloadConfig) -> Workload:
    """The trace when one is named, else the Poisson workload."""
    return load_trace(cfg.trace) if cfg.trace else poisson_workload(cfg)
