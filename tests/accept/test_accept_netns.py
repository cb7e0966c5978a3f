"""``target.netns``: the pair deployed across a router namespace, kernel conditions per step."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdx.cli.main import app

PLAYBOOK = Path(__file__).resolve().parents[2] / "playbooks" / "netns-smoke.yaml"
PREFIX = "pdxacct"  # not the playbook's own prefix: a test never touches a user's namespaces

pytestmark = [
    pytest.mark.system,
    pytest.mark.skipif(
        any(shutil.which(t) is None for t in ("ip", "tc", "nft")), reason="needs ip, tc and nft"
    ),
]

FAST = [
    f"target.netns.prefix={PREFIX}",
    "matrix.duration_s=6",
    "validity.min_duration_s=4",
    "preflight.probe_duration_s=0.5",
    "preflight.probe_chunk_seconds=0.3",
    "preflight.probe_chunk_sizes=256KiB",
]


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if line.startswith(PREFIX)]


def _run(tmp_path: Path, extra: list[str]) -> tuple[int, str, dict]:
    args = ["accept", str(PLAYBOOK), "--out", str(tmp_path), "--no-progress"]
    for item in [*FAST, *extra]:
        args += ["--set", item]
    result = CliRunner().invoke(app, args)
    data = json.loads(next(tmp_path.glob("*/report.json")).read_text())
    return result.exit_code, result.output, data


def test_kernel_conditions_and_proxy_faults_across_namespaces(tmp_path: Path) -> None:
    code, output, data = _run(tmp_path, [])
    assert code == 0, (output, data["recommendations"], data["problems"])
    assert data["target"]["netns"]["prefill"] == f"{PREFIX}-prefill"
    normal, capped, cut = data["steps"]
    assert normal["kernel"]["rate_mbit"] == 1000 and capped["kernel"]["rate_mbit"] == 5
    assert "rate 5Mbit" in capped["kernel"]["qdiscs"]["eth-prefill"]
    # The cap really acted on the KV bytes: tbf held packets back over its rate ...
    counters = capped["kernel"]["router_counters"]
    assert counters["tbf_bytes"] > 0 and counters["tbf_overlimits"] > 0
    assert normal["kernel"]["router_counters"]["tbf_overlimits"] == 0
    # ... so a 48-token request's KV (48 x 512 B) takes at least (24 576 - 6 000 B tbf burst)
    # x 8 / 5 Mbit/s = 29.7 ms to cross, where the uncapped link moves it in a few ms.
    assert capped["summary"]["transfer_ms"]["p50"] >= 29.0
    assert normal["summary"]["routes"].get("disaggregated", 0) > 0
    assert capped["proxy"] is None  # the cap is the kernel's alone
    _check_proxy_faults(data, cut)
    # The pre-flight probe ran between the sites, through the router's 1 Gbit/s cap.
    probe = data["preflight"]["probe_link"]
    assert probe["server_netns"] == f"{PREFIX}-prefill" and probe["server"].startswith("10.77.1.1:")
    assert 0 < probe["summary"]["down_gbps"] <= 1.05
    md = next(tmp_path.glob("*/report.md")).read_text()
    assert "kernel condition on the router namespace: tbf rate 5 Mbit/s" in md
    assert "nft random loss 0.001" in md and "link-down events 1" in md
    assert _namespaces() == []  # everything torn down


def _check_proxy_faults(data: dict, cut: dict) -> None:
    """Delay and the cut fired in the decode-side proxy; loss stayed in the kernel only."""
    assert data["target"]["kv_proxies"][0]["control"].startswith("http://10.77.3.2:")
    assert cut["kernel"]["loss"] == 0.001 and cut["kernel"]["nft"]
    proxy = cut["proxy"]
    assert set(proxy["per_toxic"]) == {"delay"} and proxy["per_toxic"]["delay"]["chunks"] > 0
    assert proxy["per_toxic"]["delay"]["bytes"] == proxy["toxic_bytes"] > 0
    assert proxy["link_down_events"] == 1
    assert proxy["connections_refused"] + cut["summary"]["retries"] > 0
    assert cut["summary"]["degraded"] > 0 and cut["summary"]["failed"] == 0
    # every KV chunk waits 20 ms in the proxy
    assert cut["summary"]["transfer_ms"]["p50"] >= 20.0


def test_namespaces_removed_when_the_deploy_fails(tmp_path: Path) -> None:
    code, output, data = _run(tmp_path, ["target.deploy_set=[decode.count=0]"])
    assert code == 2, output
    assert "pdx deploy exited" in data["problems"][0] and not data["complete"]
    assert _namespaces() == []
