"""Trace workloads in a playbook: load.workload / load.workloads, the matrix's workload axis,
the steps they expand to, and the Locust arguments of a trace step."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pdx.accept.load.locust import step_args
from pdx.accept.playbook import load_playbook
from pdx.accept.steps import expand_steps
from pdx.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "playbooks" / "traces" / "chat-sessions.jsonl"


def write(tmp_path: Path, doc: dict) -> Path:
    (tmp_path / "traces").mkdir(exist_ok=True)
    (tmp_path / "traces" / "t.jsonl").write_text(TRACE.read_text())
    path = tmp_path / "pb.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "target": {"url": "http://127.0.0.1:1"}, **doc}))
    return path


def test_one_trace_for_every_step_with_its_path_relative_to_the_playbook(tmp_path: Path) -> None:
    pb = load_playbook(write(tmp_path, {
        "load": {"workload": {"trace": "traces/t.jsonl", "length_scale": 0.03125,
                              "time_scale": 0.25}},
        "matrix": {"network": ["normal"], "duration_s": 20},
    }))  # fmt: skip
    assert pb.matrix.workload == ["trace"]
    assert pb.load.workloads["trace"].trace == str(tmp_path / "traces" / "t.jsonl")
    (step,) = expand_steps(pb)
    # 160 requests, the longest prompt 5,120 tokens (160 scaled), 128 output (4), 54.9 s of trace
    assert (step.input_tokens, step.output_tokens, step.workload) == (160, 4, "trace")
    assert step.time_scale == 0.25 and step.rate_rps == pytest.approx(159 / (54.865 * 0.25), 1e-3)
    assert step.id == f"s00-trace-r{step.rate_rps:.3g}-normal"
    args = step_args(pb, step, "http://x", tmp_path)
    assert args[args.index("-u") + 1] == "1"
    assert args[args.index("--pdx-mode") + 1] == "trace"
    assert args[args.index("--pdx-time-scale") + 1] == "0.25"


def test_named_traces_on_the_matrix_axis_at_given_rates(tmp_path: Path) -> None:
    pb = load_playbook(write(tmp_path, {
        "load": {"workloads": {"chat": {"trace": "traces/t.jsonl", "max_requests": 41}}},
        "matrix": {"network": ["normal", "slow"], "workload": ["chat"], "rate_rps": [2, 4]},
        "conditions": {"normal": {}, "slow": {}},
    }))  # fmt: skip
    steps = expand_steps(pb)
    assert [(s.network, s.rate_rps) for s in steps] == [
        ("normal", 2), ("normal", 4), ("slow", 2), ("slow", 4)
    ]  # fmt: skip
    assert steps[1].time_scale == pytest.approx(steps[0].time_scale / 2)


@pytest.mark.parametrize(("doc", "problem"), [
    ({"load": {"workloads": {"a": {"trace": "traces/t.jsonl"}}},
      "matrix": {"workload": ["b"]}}, "matrix.workload names ['b'] not defined"),
    ({"load": {"workload": {"trace": "traces/t.jsonl"}},
      "matrix": {"workload": ["trace"], "input_tokens": [8]}}, "leave out input_tokens"),
    ({"matrix": {"network": ["normal"]}}, "set matrix.input_tokens and output_tokens"),
])  # fmt: skip
def test_bad_trace_matrices_are_named(tmp_path: Path, doc: dict, problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_playbook(write(tmp_path, doc))
    assert problem in str(err.value)
