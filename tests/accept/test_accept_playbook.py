"""Playbook validation, overrides, step expansion and condition → toxics."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from pdx.accept.playbook import Condition, NetnsTarget, load_playbook
from pdx.accept.steps import expand_steps, step_criteria
from pdx.accept.target.netns import Topology
from pdx.accept.target.proxy import condition_toxics, counters, proxy_acts
from pdx.cli.main import app
from pdx.errors import ConfigError
from pdx.faults.toxics import parse_toxic

PLAYBOOKS = Path(__file__).resolve().parents[2] / "playbooks"


@pytest.mark.parametrize(
    "name", ["smoke", "cross-dc-reference", "external-endpoint", "netns-smoke"]
)
def test_shipped_playbooks_validate(name: str) -> None:
    pb = load_playbook(PLAYBOOKS / f"{name}.yaml")
    assert pb.name == name and expand_steps(pb)


def test_reference_matrix_is_the_full_cross_dc_matrix() -> None:
    pb = load_playbook(PLAYBOOKS / "cross-dc-reference.yaml")
    steps = expand_steps(pb)
    assert len(steps) == 3 * 3 * 4 * 6
    assert {s.input_tokens for s in steps} == {1024, 8192, 32768}
    nets = {"normal", "delay", "loss", "link-break", "idle-5", "idle-60"}
    assert {s.network for s in steps} == nets
    assert [pb.conditions[n].idle_s for n in ("idle-5", "idle-60")] == [5, 60]
    assert all(s.duration_s == 600 for s in steps)
    assert "model.backend=synthetic" in pb.target.deploy_set
    # The gates, each with its default threshold, and client aborts so stranded KV is exercised.
    c = pb.criteria
    assert (c.silent_fallback_max, c.output_mismatch_max, c.overdue_requests_max) == (0.01, 0, 0)
    assert c.kv_stranded_max_s == "auto" and c.idle_ttft_ratio_max == 2.0
    assert pb.load.abort_fraction > 0 and pb.judgement.confidence == 0.95


def test_smoke_has_a_fault_step_and_fits_five_minutes() -> None:
    pb = load_playbook(PLAYBOOKS / "smoke.yaml")
    steps = expand_steps(pb)
    assert any(pb.conditions[s.network].is_fault for s in steps)
    assert sum(s.duration_s for s in steps) <= 120  # load time; the rest is startup


def test_set_overrides_by_dotted_path() -> None:
    pb = load_playbook(
        PLAYBOOKS / "smoke.yaml",
        dotted=["criteria.ttft_p99_ms=0.001", "matrix.concurrency=[1,3]", "matrix.duration_s=9"],
    )
    assert pb.criteria.ttft_p99_ms == 0.001
    assert [s.concurrency for s in expand_steps(pb)] == [1, 3, 1, 3]
    fault = next(s for s in expand_steps(pb) if s.network == "link-break")
    assert step_criteria(pb, fault).degrade_rate_max is None  # condition override
    assert step_criteria(pb, fault).ttft_p99_ms == 0.001  # global value kept


def test_offload_policies_run_each_cell_in_alternating_order() -> None:
    sets = ["matrix.concurrency=[1,3]", "matrix.network=[normal]",
            "matrix.offload=[uncached,length]", "matrix.offload_rounds=2"]  # fmt: skip
    steps = expand_steps(load_playbook(PLAYBOOKS / "smoke.yaml", dotted=sets))
    assert [(s.cell, s.offload) for s in steps] == [
        (0, "uncached"), (0, "length"), (0, "length"), (0, "uncached"),
        (1, "uncached"), (1, "length"), (1, "length"), (1, "uncached"),
    ]  # fmt: skip
    assert [s.index for s in steps] == list(range(8))
    assert steps[1].id == "s01-in48-out8-c1-normal-length"
    trace = expand_steps(load_playbook(PLAYBOOKS / "trace-replay.yaml",
                                       dotted=["matrix.offload=[length,break_even]"]))  # fmt: skip
    assert [s.id.rsplit("-", 1)[1] for s in trace] == ["length", "break_even"]
    for bad, says in ((["matrix.offload=[uncached,uncached]"], "each policy once"),
                      (["matrix.offload=[uncached,cheapest]"], "matrix.offload[1]"),
                      (["matrix.offload=[uncached]"], "matrix.offload"),
                      (["matrix.offload=[uncached,length]", "baseline=colocated"],
                       "compare one at a time"),
                      (["matrix.offload=[uncached,length]", "search.param=rate"],
                       "one policy at a time")):  # fmt: skip
        with pytest.raises(ConfigError) as err:
            load_playbook(PLAYBOOKS / "smoke.yaml", dotted=bad)
        assert says in str(err.value), (bad, str(err.value))


BAD = {
    "name": "bad name!",
    "target": {"url": "http://127.0.0.1:1"},
    "matrix": {
        "input_tokens": [128, 0],
        "output_tokens": [],
        "concurrency": [1, 8, -2],
        "duration_s": 0,
        "colour": "blue",
    },
    "criteria": {"ttft_p99_ms": -5, "transfer_success_min": 1.5},
    "validity": {"min_requests": 0},
}


def test_a_condition_may_run_its_steps_longer_or_shorter() -> None:
    sets = ["matrix.duration_s=9", "conditions.link-break.duration_s=30"]
    pb = load_playbook(PLAYBOOKS / "smoke.yaml", dotted=sets)
    lengths = {(s.network, s.duration_s) for s in expand_steps(pb)}
    assert lengths == {("normal", 9.0), ("link-break", 30.0)}
    # A fault is timed against its own condition's length, and the error names that field.
    with pytest.raises(ConfigError) as err:
        load_playbook(PLAYBOOKS / "vllm-pd.yaml", dotted=["conditions.prefill-killed.duration_s=3"])
    assert "kill_prefill_at_s must be < conditions.prefill-killed.duration_s (4.0 >= 3.0)" in str(
        err.value
    )


def test_bad_playbook_lists_every_problem_with_its_path(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(BAD))
    with pytest.raises(ConfigError) as info:
        load_playbook(path)
    text = "\n".join(info.value.problems)
    for where in (
        "name:",
        "matrix.input_tokens[1]:",
        "matrix.output_tokens:",
        "matrix.concurrency[2]:",
        "matrix.duration_s:",
        "matrix.colour: unknown key",
        "criteria.ttft_p99_ms:",
        "criteria.transfer_success_min:",
        "validity.min_requests:",
    ):
        assert where in text, (where, text)
    assert "greater than 0 (got -2)" in text


def test_bad_playbook_cli_exit_2_one_line_per_problem(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(BAD))
    result = CliRunner().invoke(app, ["accept", str(path), "--out", str(tmp_path / "r")])
    assert result.exit_code == 2
    err = result.stderr
    assert err.startswith("error: ") and "Traceback" not in err
    assert "matrix.concurrency[2]: Input should be greater than 0 (got -2)" in err
    assert len([ln for ln in err.splitlines() if ln.startswith("  ")]) == 9
    assert not (tmp_path / "r").exists()  # nothing ran


def test_cross_field_rules(tmp_path: Path) -> None:
    doc = {
        "name": "x",
        "target": {"url": "http://127.0.0.1:1"},
        "matrix": {
            "input_tokens": [1],
            "output_tokens": [1],
            "concurrency": [1],
            "network": ["normal", "cut"],
            "duration_s": 10,
        },
        "conditions": {"normal": {}, "cut": {"link_down_at_s": 3, "link_down_for_s": 2}},
    }
    path = tmp_path / "x.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=r"network faults need target\.deploy"):
        load_playbook(path)
    doc["matrix"]["network"] = ["nowhere"]  # type: ignore[index]
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=r"\['nowhere'\] not defined under conditions"):
        load_playbook(path)
    result = CliRunner().invoke(app, ["accept", str(path), "--set", "matrix"])
    assert result.exit_code == 2 and "--set" in result.stderr


def test_conditions_become_valid_fault_toxics() -> None:
    c = Condition(delay_ms=20, jitter_ms=5, loss=0.01, bandwidth_mbps=100)
    toxics = [parse_toxic(t) for t in condition_toxics(c)]
    assert [t.type for t in toxics] == ["latency", "stall", "bandwidth"]
    assert condition_toxics(Condition()) == []
    assert not Condition().is_fault and Condition(link_down_at_s=1, link_down_for_s=1).is_fault


def test_under_netns_the_proxy_gets_only_cuts() -> None:
    c = Condition(delay_ms=20, jitter_ms=5, loss=0.01, bandwidth_mbps=100)
    assert condition_toxics(c, kernel_shaping=True) == []  # the router hop applies them all
    assert not proxy_acts(Condition(loss=0.01, bandwidth_mbps=5), kernel_shaping=True)
    assert proxy_acts(Condition(loss=0.01, bandwidth_mbps=5))
    assert proxy_acts(Condition(link_down_at_s=1, link_down_for_s=1), kernel_shaping=True)
    assert not proxy_acts(Condition(jitter_ms=1), kernel_shaping=True)


def test_netns_deploy_puts_the_proxy_control_on_the_host_link() -> None:
    topo = Topology(NetnsTarget(enabled=True, prefix="pdxunit"))
    assert not any(i.startswith("kv.") for i in topo.deploy_overrides(tls=False))
    items = topo.deploy_overrides(via_proxy=True, tls=False)
    assert not any(i.startswith("tls.") for i in items)  # the deploy's own TLS settings stand
    # the site end of the first /30 of 10.77.3.0/24 free on this host (10.77.3.2 unless a
    # namespace run beside this one holds that link)
    site = topo.site_addr
    assert site.startswith("10.77.3.") and int(site.rsplit(".", 1)[1]) % 4 == 2
    assert "kv.via_proxy=true" in items and f"kv.proxy_control_host={site}" in items


def test_netns_playbook_accepts_delay_and_cuts() -> None:
    pb = load_playbook(PLAYBOOKS / "netns-smoke.yaml")
    cut = pb.conditions["wan-break"]
    assert pb.target.netns.enabled and cut.delay_ms and cut.link_down_at_s is not None


def test_proxy_counters_sum_both_directions_of_a_toxic() -> None:
    rows = [
        {"name": "delay", "type": "latency", "direction": "downstream", "bytes": 900, "packets": 3},
        {"name": "delay", "type": "latency", "direction": "upstream", "bytes": 100, "packets": 2},
    ]
    c = counters({"toxics": rows})
    assert c["per_toxic"] == {"delay": {"bytes": 1000, "chunks": 5}} and c["toxic_bytes"] == 1000


def test_cross_traffic_is_a_netns_condition_with_bounded_flows() -> None:
    pb = load_playbook(PLAYBOOKS / "cross-dc-lite.yaml")
    shared = pb.conditions["wan40-shared"].cross_traffic
    assert shared is not None and (shared.flows, shared.cc, shared.direction) == (
        2,
        "cubic",
        "down",
    )
    assert pb.conditions["wan40-shared"].is_fault
    with pytest.raises(ConfigError, match=r"conditions.normal.cross_traffic need target.netns"):
        load_playbook(
            PLAYBOOKS / "smoke.yaml", dotted=["conditions.normal.cross_traffic={flows: 1}"]
        )
    with pytest.raises(ConfigError, match=r"flows"):
        load_playbook(PLAYBOOKS / "cross-dc-lite.yaml",
                      dotted=["conditions.wan40-shared.cross_traffic={flows: 0}"])  # fmt: skip
    too_long = "conditions.wan40-shared.cross_traffic={max_seconds: 99999}"
    with pytest.raises(ConfigError, match=r"max_seconds"):
        load_playbook(PLAYBOOKS / "cross-dc-lite.yaml", dotted=[too_long])
