"""``pdx simulate`` through the real CLI: defaults, JSON keys, bad config, sweep, find-min."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from pdx.cli.main import app
from pdx.sim.config import PUBLISHED_ILLUSTRATION

runner = CliRunner()


def run(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, ["simulate", *args])
    return result.exit_code, result.stdout, result.stderr


def test_no_flags_prints_the_illustration_comparison() -> None:
    code, out, _ = run()
    assert code == 0
    assert "colocated" in out and "disaggregated" in out
    assert "poisson(rate=0.5/s, n=150, seed=7)" in out
    assert "nearest-rank" in out and "floor(n*p)" in out
    assert "0.127 s" in out  # disaggregated mean ITL of the correct model


def test_json_keys_and_published_compat() -> None:
    code, out, _ = run("--compat", "published", "--json")
    assert code == 0
    data = json.loads(out)
    for mode, (p50, p95, itl) in {
        "colocated": (4.43, 13.20, 0.434),
        "disaggregated": (4.46, 13.28, 0.160),
    }.items():
        got = data[mode]
        assert got["ttft_p50_s"] == pytest.approx(p50, rel=0.02)
        assert got["ttft_p95_s"] == pytest.approx(p95, rel=0.02)
        assert got["itl_mean_s"] == pytest.approx(itl, rel=0.02)
        assert "itl_p95_s" in got and "tpot_mean_s" in got and "goodput_fraction" in got
    assert data["compat"] == "published"
    assert data["percentile_method"].startswith("nearest-rank")


def write_config(tmp_path: Path, data: dict[str, object]) -> str:
    path = tmp_path / "sim.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def complete() -> dict[str, object]:
    return {k: v for k, v in PUBLISHED_ILLUSTRATION.items() if k != "workload"}


def error_lines(err: str) -> list[str]:
    return [line.strip() for line in err.strip().splitlines()]


def test_complete_yaml_runs_and_flags_override_it(tmp_path: Path) -> None:
    path = write_config(tmp_path, {**complete(), "decode_instances": 2})
    code, out, _ = run("--config", path, "--mode", "disaggregated", "--requests", "40", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["requests"] == 40 and data["colocated"] is None
    assert data["config"]["decode_instances"] == 2


def test_negative_bandwidth_is_one_clear_line(tmp_path: Path) -> None:
    code, _, err = run("--link-bytes-per-s", "-5")
    assert code == 2
    assert error_lines(err)[1:] == ["link_bytes_per_s: Input should be greater than 0 (got -5.0)"]


def test_bad_yaml_gives_one_line_per_problem(tmp_path: Path) -> None:
    data = complete()
    del data["weight_bytes"]
    data["link_bytes_per_s"] = -1
    data["link_speed_gbps"] = 100
    code, _, err = run("--config", write_config(tmp_path, data))
    assert code == 2
    lines = error_lines(err)
    assert lines[0] == f"error: {tmp_path / 'sim.yaml'}: 3 problem(s)"
    assert sorted(lines[1:]) == [
        "link_bytes_per_s: Input should be greater than 0 (got -1)",
        "link_speed_gbps: unknown key (got 100)",
        "weight_bytes: Field required",
    ]
    assert "Traceback" not in err


def test_bad_trace_names_its_line(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 2}\n{"arrival_s": 1}\n')
    code, _, err = run("--workload", str(trace))
    assert code == 2
    assert "line 2: prompt_tokens: Field required" in err


def test_trace_replay_through_the_cli(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [{"arrival_s": i * 0.5, "prompt_tokens": 8000, "output_tokens": 16} for i in range(20)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, _ = run("--workload", str(trace), "--json")
    assert code == 0
    data = json.loads(out)
    assert data["requests"] == 20 and data["workload"] == "trace t.jsonl"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--sweep", "nope=1:2:3"], "sweep parameter"),
        (["--sweep", "link_bytes_per_s=5"], "PARAM=start:stop:count"),
        (["--find-min", "link_rtt_s", "--slo", "ttft_p99_s=1"], "--find-min"),
        (["--find-min", "link_bytes_per_s", "--slo", "bogus=1"], "--slo"),
        (["--mode", "split"], "--mode"),
        (["--preset", "nope"], "--preset"),
        (["--compat", "published", "--decode-instances", "2"], "compat 'published'"),
    ],
)
def test_bad_options_are_one_line_errors(args: list[str], needle: str) -> None:
    code, _, err = run(*args)
    assert code == 2
    assert needle in err and "Traceback" not in err


def test_sweep_prints_a_table_and_writes_a_png(tmp_path: Path) -> None:
    png = tmp_path / "sweep.png"
    args = ["--sweep", "decode_instances=1:3:3", "--plot", str(png), "--rate", "1"]
    code, out, _ = run(*args, "--prefill-instances", "2", "--requests", "120", "--json")
    assert code == 0
    data = json.loads(out)
    assert [p["value"] for p in data["points"]] == [1.0, 2.0, 3.0]
    itl = [p["disaggregated"]["itl_mean_s"] for p in data["points"]]
    assert itl[0] > itl[1] > itl[2]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_find_min_link_answers_the_smallest_bandwidth() -> None:
    code, out, _ = run("--find-min", "link_bytes_per_s", "--slo", "ttft_p99_s=15", "--json")
    assert code == 0
    data = json.loads(out)
    answer = data["answer"]
    assert data["modes"] == ["disaggregated"] and "bisection" in data["method"]
    tried = {e["value"]: e for e in data["evaluations"]}
    assert tried[answer]["ok"]
    # every value tried below the answer failed, and the bracket is within 1 %
    below = [v for v, e in tried.items() if v < answer]
    assert below and not any(tried[v]["ok"] for v in below)
    assert answer / max(below) <= 1.0101


def test_find_min_decode_instances_is_exact() -> None:
    args = ["--find-min", "decode_instances", "--slo", "itl_p95_s=0.1", "--range", "1:16"]
    code, out, _ = run(
        *args, "--rate", "1", "--requests", "200", "--prefill-instances", "2", "--json"
    )
    assert code == 0
    data = json.loads(out)
    answer = int(data["answer"])
    tried = {int(e["value"]): e["ok"] for e in data["evaluations"]}
    assert tried[answer] and not tried[answer - 1]


def test_find_min_that_finds_nothing_exits_1() -> None:
    args = ["--find-min", "decode_instances", "--slo", "itl_p95_s=0.000001", "--range", "1:2"]
    code, out, _ = run(*args, "--rate", "1", "--requests", "50", "--json")
    assert code == 1
    data = json.loads(out)
    assert data["answer"] is None and not any(e["ok"] for e in data["evaluations"])


def test_model_preset_fills_the_model_fields() -> None:
    pytest.importorskip("pdx.kv.source")
    code, out, _ = run("--model-preset", "llama-3.1-70b", "--requests", "20", "--json")
    assert code == 0
    cfg = json.loads(out)["config"]
    # GQA-8, 80 layers, head_dim 128, bf16: 2 * 80 * 8 * 128 * 2 bytes per token
    assert cfg["kv_bytes_per_token"] == 2 * 80 * 8 * 128 * 2
    assert 70e9 < cfg["model_params"] < 71e9
    assert cfg["weight_bytes"] == 2 * cfg["model_params"]
    code, out, _ = run("--model-preset", "llama-3.1-70b", "--kv-bytes-per-token", "1000", "--json")
    assert json.loads(out)["config"]["kv_bytes_per_token"] == 1000  # a flag wins


def test_environment_sits_between_file_and_flags() -> None:
    env = {"PDX_SIM_LINK_BYTES_PER_S": "5e9", "PDX_SIM_DECODE_INSTANCES": "3"}
    result = runner.invoke(app, ["simulate", "--decode-instances", "2", "--json"], env=env)
    assert result.exit_code == 0
    cfg = json.loads(result.stdout)["config"]
    assert (cfg["link_bytes_per_s"], cfg["decode_instances"]) == (5e9, 2)
    bad = runner.invoke(app, ["simulate"], env={"PDX_SIM_LINK_BYTES_PER_S": "-1"})
    assert bad.exit_code == 2 and "environment" in bad.stderr


def test_yaml_trace_path_is_relative_to_the_file(tmp_path: Path) -> None:
    (tmp_path / "t.jsonl").write_text(
        '{"arrival_s": 0, "prompt_tokens": 900, "output_tokens": 4}\n'
    )
    path = write_config(tmp_path, {**complete(), "workload": {"trace": "t.jsonl"}})
    code, out, _ = run("--config", path, "--json")
    assert code == 0 and json.loads(out)["requests"] == 1
