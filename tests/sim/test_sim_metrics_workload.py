"""Percentiles, queue peaks and trace parsing."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdx.errors import ConfigError, InputError
from pdx.sim.config import WorkloadConfig
from pdx.sim.metrics import max_in_queue, nearest_rank, weighted_nearest_rank
from pdx.sim.workload import load_trace, poisson_workload

floats = st.floats(min_value=0, max_value=1e6, allow_nan=False)
ps = st.sampled_from([0.0, 0.5, 0.9, 0.95, 0.99, 0.999, 1.0])


@given(st.lists(floats, min_size=1, max_size=200), ps)
def test_nearest_rank_is_sorted_floor_index(xs: list[float], p: float) -> None:
    want = sorted(xs)[min(len(xs) - 1, math.floor(len(xs) * p))]
    assert nearest_rank(np.asarray(xs), p) == want


@given(st.lists(st.tuples(floats, st.integers(1, 50)), min_size=1, max_size=60), ps)
def test_weighted_nearest_rank_equals_expanded_sample(
    pairs: list[tuple[float, int]], p: float
) -> None:
    expanded = [v for v, k in pairs for _ in range(k)]
    values = np.asarray([v for v, _ in pairs])
    counts = np.asarray([k for _, k in pairs])
    assert weighted_nearest_rank(values, counts, p) == nearest_rank(np.asarray(expanded), p)


def test_max_in_queue_counts_overlap_and_leaving_wins_ties() -> None:
    enter = np.asarray([0.0, 1.0, 2.0, 3.0])
    leave = np.asarray([2.0, 3.0, 2.5, 3.0])
    assert max_in_queue(enter, leave) == 2


def write_trace(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_trace_replay_sorts_by_arrival_and_ignores_extra_keys(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path,
        [
            json.dumps({"arrival_s": 2.0, "prompt_tokens": 10, "output_tokens": 3, "id": "b"}),
            "",
            json.dumps({"arrival_s": 1.0, "prompt_tokens": 20, "output_tokens": 4}),
        ],
    )
    wl = load_trace(path)
    assert (wl.arrival_s, wl.prompt_tokens, wl.output_tokens) == ([1.0, 2.0], [20, 10], [4, 3])


def test_trace_errors_name_the_line(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path,
        [
            json.dumps({"arrival_s": 0.0, "prompt_tokens": 10, "output_tokens": 3}),
            "{not json",
            json.dumps({"arrival_s": 1.0, "prompt_tokens": -5, "output_tokens": 3}),
            json.dumps({"arrival_s": 1.0, "output_tokens": 3}),
        ],
    )
    with pytest.raises(ConfigError) as info:
        load_trace(path)
    problems = info.value.problems
    assert problems[0].startswith("line 2: not JSON")
    assert problems[1].startswith("line 3: prompt_tokens:") and "-5" in problems[1]
    assert problems[2] == "line 4: prompt_tokens: Field required"


def test_missing_trace_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="existing JSONL"):
        load_trace(tmp_path / "nope.jsonl")


def test_prompt_mix_follows_its_weights() -> None:
    cfg = WorkloadConfig.model_validate(
        {"requests": 20000, "prompt_tokens": [1, 2], "prompt_weights": [1, 3]}
    )
    wl = poisson_workload(cfg)
    assert wl.prompt_tokens.count(2) / len(wl) == pytest.approx(0.75, abs=0.02)
    gaps = np.diff([0.0, *wl.arrival_s])
    assert gaps.mean() == pytest.approx(1 / 0.5, rel=0.03)
