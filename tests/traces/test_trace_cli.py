"""``pdx trace make`` and ``pdx trace stats`` through the CLI, and ``pdx simulate`` on a trace
with its prefix caches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdx.cli.main import app


def test_a_made_trace_round_trips_through_stats(tmp_path: Path) -> None:
    out = tmp_path / "chat.jsonl"
    made = CliRunner().invoke(
        app, ["trace", "make", str(out), "--sessions", "12", "--turns", "3", "--json"]
    )
    assert made.exit_code == 0, made.output
    known = json.loads(made.stdout)["known_ideal_hit_ratio"]
    stats = CliRunner().invoke(app, ["trace", "stats", str(out), "--json", "--cache-blocks", "8"])
    assert stats.exit_code == 0, stats.output
    s = json.loads(stats.stdout)
    assert s["ideal_hit_ratio"] == known and s["requests"] == 36 and s["sessions"] == 12
    assert s["cache_hit_ratio"] < s["ideal_hit_ratio"]  # 8 blocks cannot hold the sessions
    assert set(s["uncached_over"]) == {"1024", "4096", "16384"}
    text = CliRunner().invoke(app, ["trace", "stats", str(out)])
    assert f"ideal (infinite cache) {100 * known:.2f} %" in text.stdout


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 512, "output_length": 1}\n{"x": 1}\n')
    r = CliRunner().invoke(app, ["trace", "stats", str(bad)])
    assert r.exit_code == 2 and "line 2: timestamp: Field required" in r.stderr
    r = CliRunner().invoke(app, ["trace", "stats", str(bad), "--format", "csv"])
    assert r.exit_code == 2
    assert r.stderr.strip() == (
        "error: format: got 'csv', expected one of auto, mooncake, burstgpt, pdx"
    )
    r = CliRunner().invoke(app, ["trace", "make", str(tmp_path / "x"), "--turns", "0"])
    assert r.exit_code == 2 and r.stderr.startswith("error: --turns: got 0")


def test_simulate_a_trace_with_prefix_caches(tmp_path: Path) -> None:
    out = tmp_path / "chat.jsonl"
    made = CliRunner().invoke(app, ["trace", "make", str(out), "--sessions", "20", "--json"])
    known = json.loads(made.stdout)["known_ideal_hit_ratio"]
    args = ["simulate", "--workload", str(out), "--format", "mooncake", "--mode",
            "disaggregated", "--model-preset", "llama-3.1-8b", "--json"]  # fmt: skip
    cold = json.loads(CliRunner().invoke(app, args).stdout)["disaggregated"]
    hot = json.loads(CliRunner().invoke(app, [*args, "--prefix-cache-blocks", "100000"]).stdout)[
        "disaggregated"
    ]
    assert cold["prefix_hit_ratio"] is None
    assert round(hot["prefix_hit_ratio"], 6) == known  # one prefill, its cache holds everything
    # one decode instance holding everything too: only the uncached share crosses the link
    assert hot["kv_shipped_bytes"] == pytest.approx(cold["kv_shipped_bytes"] * (1 - known))
    assert hot["ttft_p50_s"] < cold["ttft_p50_s"]  # less to prefill


def test_simulated_offload_policies_ship_what_each_decides_on(tmp_path: Path) -> None:
    """length ships whole prompts, uncached only what decode lacks; break_even keeps the
    prefill where the KV is ready sooner: on a link too slow for any KV to pay, nothing ships."""
    out = tmp_path / "chat.jsonl"
    made = CliRunner().invoke(app, ["trace", "make", str(out), "--sessions", "20", "--json"])
    known = json.loads(made.stdout)["known_ideal_hit_ratio"]
    args = ["simulate", "--workload", str(out), "--format", "mooncake", "--mode",
            "disaggregated", "--model-preset", "llama-3.1-8b", "--prefix-cache-blocks",
            "100000", "--local-prefill-max-tokens", "0", "--json"]  # fmt: skip

    def run(*extra: str) -> dict:
        result = CliRunner().invoke(app, [*args, *extra])
        assert result.exit_code == 0, result.output
        return dict(json.loads(result.stdout)["disaggregated"])

    length, uncached = run("--offload-policy", "length"), run("--offload-policy", "uncached")
    assert uncached["kv_shipped_bytes"] == pytest.approx(length["kv_shipped_bytes"] * (1 - known))
    slow = ["--link-bytes-per-s", "1e6", "--link-rtt-s", "0.2"]  # 8 Mbit/s, RTT 200 ms
    assert run("--offload-policy", "break_even", *slow)["kv_shipped_bytes"] == 0
    assert (
        run("--offload-policy", "length", *slow)["kv_shipped_bytes"] == length["kv_shipped_bytes"]
    )
    # the same trace 100x faster on a 100 Gbit/s link: decode's own queue grows, and part of
    # the prefill goes remote
    rushed = ["--time-scale", "0.01", "--link-bytes-per-s", "1.25e10"]
    assert run("--offload-policy", "break_even", *rushed)["kv_shipped_bytes"] > 0
    assert run("--offload-policy", "break_even")["kv_shipped_bytes"] == 0  # no queue: all local
    bad = CliRunner().invoke(app, [*args, "--offload-policy", "sometimes"])
    assert bad.exit_code == 2 and "offload_policy" in bad.stderr
