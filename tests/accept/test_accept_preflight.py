"""Pre-flight: measure-kv on the model the deploy serves, probe-link judged against KV demand."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdx.accept.playbook import load_playbook
from pdx.accept.preflight.kv import kv_bytes_per_request, measure_kv
from pdx.accept.preflight.probe import judge_demand, probe_args, run_probe, summary
from pdx.accept.report import preflight_lines
from pdx.accept.target import netns as netns_target
from pdx.cli.main import app
from pdx.errors import ConfigError

PLAYBOOKS = Path(__file__).resolve().parents[2] / "playbooks"
SMOKE = PLAYBOOKS / "smoke.yaml"


def test_measure_kv_sizes_the_embedded_tiny_model() -> None:
    pb = load_playbook(SMOKE, dotted=["matrix.input_tokens=[48,100]"])
    kv = measure_kv(pb, PLAYBOOKS, qps=2.0)
    assert "error" not in kv, kv
    assert (kv["model"], kv["dtype"]) == ("tiny-llama", "fp32")
    # tiny-llama: 2 layers x 2 KV heads x (64 / 4 heads = 16 dims) x (K + V) x 4 B = 512 B/token
    assert kv["result"]["kv_bytes_per_token"] == 2 * 2 * 16 * 2 * 4
    assert kv_bytes_per_request(kv) == (100, 100 * 512)


def test_measure_kv_follows_the_deploy_config() -> None:
    synthetic = "target.deploy_set=[model.backend=synthetic,model.preset=llama-3.1-70b]"
    pb = load_playbook(SMOKE, dotted=[synthetic])
    kv = measure_kv(pb, PLAYBOOKS, qps=1.0)
    assert (kv["model"], kv["dtype"]) == ("llama-3.1-70b", "bf16")
    # 80 layers x 8 KV heads x 128 dims x (K + V) x 2 B
    assert kv["result"]["kv_bytes_per_token"] == 80 * 8 * 128 * 2 * 2
    pb = load_playbook(SMOKE, dotted=["preflight.model_preset=llama-3.1-8b"])
    assert measure_kv(pb, PLAYBOOKS, qps=1.0)["model"] == "llama-3.1-8b"


def test_measure_kv_reports_an_unknown_model_instead_of_raising() -> None:
    pb = load_playbook(SMOKE, dotted=["preflight.model_preset=no-such-model"])
    assert "no-such-model" in measure_kv(pb, PLAYBOOKS, qps=1.0)["error"]


async def test_probe_link_to_a_real_server_judged_against_demand() -> None:
    pb = load_playbook(
        SMOKE,
        dotted=["preflight.probe_duration_s=0.3", "preflight.probe_chunk_seconds=0.2",
                "preflight.probe_chunk_sizes=256KiB", "preflight.probe_streams=1"],
    )  # fmt: skip
    probe = await run_probe("127.0.0.1", None, functools.partial(probe_args, pb.preflight))
    assert "error" not in probe, probe
    assert probe["server"].startswith("127.0.0.1:") and "--secret" not in probe["command"]
    report = probe["report"]
    assert report["rtt_ms"]["samples"] > 0 and report["throughput"]["down_gbps"] > 0
    assert [c["chunk_bytes"] for c in report["chunks"]] == [256 * 1024]
    down = report["throughput"]["down_gbps"]
    # demand far under 70 % of the measured store->decode goodput: the bandwidth rule passes
    judge_demand(probe, (48, 24576), 10.0, "test", ttft_budget_ms=2000)
    bw = next(r for r in report["verdict"]["rules"] if r["name"] == "kv_bandwidth")
    assert bw["status"] == "pass" and bw["measured"] == pytest.approx(24576 * 10 * 8 / 1e9)
    assert bw["threshold"] == pytest.approx(0.7 * down)
    # ... and a demand of twice the measured goodput fails it, and the whole link verdict
    rps = 2 * down * 1e9 / (24576 * 8)
    judge_demand(probe, (48, 24576), rps, "test", ttft_budget_ms=2000)
    s = summary(probe)
    assert s is not None and s["verdict"] == "NO-GO"
    assert {r["name"]: r["status"] for r in s["rules"]}["kv_bandwidth"] == "fail"
    text = "\n".join(preflight_lines({"probe_link": {**probe, "summary": s}}))
    assert "link verdict **NO-GO**" in text and "RTT p50" in text


async def test_probe_link_failure_is_reported_not_raised() -> None:
    pb = load_playbook(SMOKE, dotted=["preflight.probe_duration_s=0.2"])
    # not an address: the server cannot bind
    probe = await run_probe("127.0.0.256", None, functools.partial(probe_args, pb.preflight))
    assert probe["error"].startswith("probe-link could not run: probe server failed to start")


def test_probe_and_netns_need_a_deploy_target() -> None:
    url = ["target.deploy=null", "target.url=http://127.0.0.1:1", "matrix.network=[normal]"]
    with pytest.raises(ConfigError) as exc:
        load_playbook(SMOKE, dotted=[*url, "preflight.probe_link=true"])
    assert "preflight.probe_link needs target.deploy" in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        load_playbook(
            SMOKE, dotted=[*url, "preflight.probe_link=false", "target.netns.enabled=true"]
        )
    assert "target.netns needs target.deploy" in str(exc.value)


def test_netns_accepts_a_link_break_for_the_decode_side_proxy() -> None:
    pb = load_playbook(SMOKE, dotted=["target.netns.enabled=true"])  # smoke has a link break
    assert pb.target.netns.enabled and pb.conditions["link-break"].link_down_at_s == 4


def test_netns_without_root_exits_2_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(netns_target.os, "geteuid", lambda: 1000)
    args = ["accept", str(PLAYBOOKS / "netns-smoke.yaml"), "--out", str(tmp_path), "--no-progress"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "error: target.netns.enabled needs root (CAP_NET_ADMIN)" in result.output
    assert "Traceback" not in result.output
    data = json.loads(next(tmp_path.glob("*/report.json")).read_text())
    assert not data["complete"] and "needs root" in data["problems"][0]
    assert data["steps"] == [] and data["target"] == {}  # nothing was deployed
