"""``smoke_scale: true``: every cell of a playbook's matrix, briefly, on a 2-core box.

A reference matrix is sized for a datacenter (10-minute steps, 32K-token prompts, 64 users,
a 70B-class KV): on one small machine most of its steps could not even hold their KV. This
profile keeps every cell and every condition and shrinks what each cell does, by fixed,
documented rules, so one command runs the whole matrix to a verdict:

- steps last at most :data:`STEP_S` seconds; every time inside a condition (a cut, a kill, a
  WAN event) scales with its step, a cut lasting at least 1 s; idle gaps last at most
  :data:`IDLE_S`;
- prompt and output lengths are multiplied by :data:`TOKENS` and :data:`OUTPUT` (at least 16
  and 4 tokens), users become ``ceil(sqrt(users))`` (1/8/32/64 → 1/3/6/8, still distinct),
  open-loop rates are multiplied by :data:`RATE`; a synthetic model's compute time is
  multiplied by :data:`COMPUTE` (``model.synthetic_time_scale``, unless the playbook sets it),
  so a 70B-class prefill of a scaled prompt takes what the box can give a cell; a
  ``router.local_prefill_max_tokens`` the playbook sets scales with the lengths, so the cells
  that ship their KV are the same as at full size;
- a step is valid with at least :data:`MIN_REQUESTS` requests over half its time at half its
  load, the replay gate sends at most :data:`REPLAYS` requests, the warm-up at most 2, and
  Locust runs in one process.

Thresholds are not touched: a cell's verdict says what its small sample proves (most say
"undecided"), which is the point of a smoke run. The report's playbook shows the scaled values.
"""

from __future__ import annotations

import math
from typing import Any

STEP_S = 8.0
IDLE_S = 5.0
TOKENS = 1 / 32
OUTPUT = 1 / 8
RATE = 1 / 8
COMPUTE = 1 / 32
MIN_REQUESTS = 3
REPLAYS = 5


def smoke_scaled(d: dict[str, Any]) -> dict[str, Any]:
    """A validated playbook's data (``model_dump``) with the smoke profile applied (see the
    module docstring); the caller validates the result again."""
    m = d["matrix"]
    m["input_tokens"] = _distinct(max(16, round(n * TOKENS)) for n in m["input_tokens"])
    m["output_tokens"] = _distinct(max(4, round(n * OUTPUT)) for n in m["output_tokens"])
    if m["concurrency"]:
        m["concurrency"] = _distinct(math.ceil(math.sqrt(c)) for c in m["concurrency"])
    if m["rate_rps"]:
        m["rate_rps"] = [r * RATE for r in m["rate_rps"]]
    m["exclude"] = [_scaled_cell(cell) for cell in m["exclude"]]
    matrix_s = m["duration_s"]
    m["duration_s"] = min(matrix_s, STEP_S)
    for c in d["conditions"].values():
        own = c["duration_s"]
        length = own if own is not None else matrix_s
        if own is not None:
            c["duration_s"] = min(own, STEP_S)
        _scale_times(c, min(length, STEP_S) / length)
    v = d["validity"]
    v["min_requests"] = min(v["min_requests"], MIN_REQUESTS)
    v["min_duration_s"] = min(v["min_duration_s"], STEP_S / 2)
    v["min_load_fraction"] = min(v["min_load_fraction"], 0.5)
    j = d["judgement"]
    j["replay_requests"] = min(j["replay_requests"], REPLAYS)
    load = d["load"]
    load["workers"] = 0
    load["warmup_requests"] = min(load["warmup_requests"], 2)
    # first, so that a value the playbook sets itself wins
    d["target"]["deploy_set"] = [
        f"model.synthetic_time_scale={COMPUTE}",
        *(_scaled_threshold(item) for item in d["target"]["deploy_set"]),
    ]
    return d


def _scale_times(c: dict[str, Any], f: float) -> None:
    """A condition's own times, for a step ``f`` times as long."""
    if c["link_down_at_s"] is not None:
        c["link_down_at_s"] *= f
        c["link_down_for_s"] = max(1.0, c["link_down_for_s"] * f)
    if c["kill_prefill_at_s"] is not None:
        c["kill_prefill_at_s"] *= f
    c["idle_s"] = min(c["idle_s"], IDLE_S)
    for event in c["wan_events"]:
        event["at_s"] *= f
        if (event.get("cut") or {}).get("duration_s") is not None:
            event["cut"]["duration_s"] = max(1.0, event["cut"]["duration_s"] * f)


def _scaled_cell(cell: dict[str, Any]) -> dict[str, Any]:
    """A matrix.exclude entry naming the scaled values of the cells it names."""
    out = dict(cell)
    if "input_tokens" in out:
        out["input_tokens"] = max(16, round(int(out["input_tokens"]) * TOKENS))
    if "output_tokens" in out:
        out["output_tokens"] = max(4, round(int(out["output_tokens"]) * OUTPUT))
    if "concurrency" in out:
        out["concurrency"] = math.ceil(math.sqrt(int(out["concurrency"])))
    if "rate_rps" in out:
        out["rate_rps"] = float(out["rate_rps"]) * RATE
    return out


def _scaled_threshold(item: str) -> str:
    """``router.local_prefill_max_tokens=N`` times the length scale (what ships stays so)."""
    key, eq, value = item.partition("=")
    if key != "router.local_prefill_max_tokens" or not eq or not value.strip().isdigit():
        return item
    return f"{key}={max(1, round(int(value) * TOKENS))}"


def _distinct(values: Any) -> list[Any]:
    """The values in order, each once (two lengths that scale to one value are one cell)."""
    return list(dict.fromkeys(values))
