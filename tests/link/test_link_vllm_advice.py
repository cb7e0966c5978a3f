"""The ``vllm:`` block probe-link prints: the kernel's buffer caps from the path's BDP, BBR on
long or lossy paths (slow start after idle off where it is not), UCX's interface."""

from __future__ import annotations

from typing import Any

from pdx.link.vllm_advice import vllm_block, vllm_settings
from pdx.tcp import window_for


def _report(gbps: float, rtt_ms: float, loss_pct: float = 0.0) -> dict[str, Any]:
    return {
        "throughput": {"up_gbps": gbps, "down_gbps": gbps * 0.9},
        "rtt_ms": {"p50": rtt_ms, "p99": rtt_ms * 1.2},
        "loss": {"up": 0.0, "down": loss_pct},
    }


def test_buffers_follow_the_bdp_and_the_host_cap_follows_them() -> None:
    s = vllm_settings(_report(10.0, 40.0))
    assert s is not None
    want = window_for(int(10e9 / 8 * 0.040))  # 50 MB in flight: 96 MiB buffers
    assert s["sysctl"]["net.ipv4.tcp_wmem"] == f"4096 16384 {want}"
    assert s["sysctl"]["net.ipv4.tcp_rmem"] == f"4096 131072 {want}"
    assert s["sysctl"]["net.ipv4.tcp_congestion_control"] == "bbr"  # a 40 ms path
    assert "net.ipv4.tcp_slow_start_after_idle" not in s["sysctl"]  # BBR is exempt


def test_short_clean_path_keeps_the_hosts_congestion_control_and_buffers() -> None:
    s = vllm_settings(_report(1.0, 0.2))
    assert s is not None and "net.ipv4.tcp_congestion_control" not in s["sysctl"]
    assert "net.ipv4.tcp_rmem" not in s["sysctl"]  # never below the kernel's own 6 MiB
    assert s["sysctl"]["net.ipv4.tcp_slow_start_after_idle"] == "0"
    lossy = vllm_settings(_report(1.0, 0.2, loss_pct=0.1))
    assert lossy is not None and lossy["sysctl"]["net.ipv4.tcp_congestion_control"] == "bbr"


def test_no_goodput_or_rtt_no_advice() -> None:
    assert vllm_settings({"throughput": None, "rtt_ms": {"p50": 1.0}}) is None
    assert vllm_settings({"throughput": {"up_gbps": 1, "down_gbps": 1}, "rtt_ms": None}) is None


def test_block_is_a_vllm_env_mapping_and_one_sysctl_line() -> None:
    s = vllm_settings(_report(1.0, 80.0))  # 10 MB in flight: buffers past the defaults
    assert s is not None
    text = vllm_block(s)
    head, comment = text.rsplit("\n", 1)
    import yaml

    env = yaml.safe_load(head)["vllm"]["env"]
    assert env == s["env"] and env["UCX_TLS"] == "tcp,self"
    assert comment.startswith("# both hosts") and 'net.ipv4.tcp_wmem="4096 16384 ' in comment
