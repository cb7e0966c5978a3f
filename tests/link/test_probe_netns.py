"""probe-link across a packet-level WAN (root only): its advice agrees with its own figures.

On a 20 ms RTT, 0.2 % loss namespace link one TCP stream stays well under the link's rate while
four fill it; probe-link must recommend the streams its own 1- vs N-stream table shows are
needed, and a chunk size that passes its own chunk rule when one does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdx.faults import netns
from pdx.link.stats import clopper_pearson

pytestmark = [
    pytest.mark.system,
    pytest.mark.slow,
    pytest.mark.alone,
    pytest.mark.skipif(
        any(shutil.which(t) is None for t in ("ip", "tc")) or not os.path.exists("/dev/net/tun"),
        reason="needs iproute2 and /dev/net/tun",
    ),
]

PREFILL_ADDR = "10.77.1.1"  # the topology's own addresses (pdx.faults.netns)
PDX = str(Path(sys.executable).with_name("pdx"))


@pytest.fixture(scope="module")
def lossy_link() -> Iterator[netns.NetnsConfig]:
    """Prefill and decode sites 20 ms apart with 0.2 % loss per wire packet each way."""
    cfg = netns.make_config(
        prefix=f"pdxl{os.getpid() % 10000}", emulator="userspace", seed=1, delay_ms=10, loss=0.002
    )
    try:
        netns.up(cfg)
        yield cfg
    finally:
        netns.down(cfg)


def _probe(cfg: netns.NetnsConfig, *args: str) -> dict[str, Any]:
    """``pdx probe-link --json`` from decode to a probe server in prefill."""
    server = subprocess.Popen(
        ["ip", "netns", "exec", cfg.prefill, PDX, "probe-server", "--bind", PREFILL_ADDR,
         "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        found = re.search(r"tcp (\d+)", line)
        assert found, line
        out = subprocess.run(
            ["ip", "netns", "exec", cfg.decode, PDX, "probe-link",
             f"{PREFILL_ADDR}:{found.group(1)}", *args, "--json"],
            capture_output=True, text=True, timeout=90, check=False,
        )  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert out.returncode in (0, 1, 3), out.stderr
    report: dict[str, Any] = json.loads(out.stdout)
    return report


def _fewest_streams(runs: list[dict[str, Any]], direction: str) -> int:
    mine = sorted((r for r in runs if r["direction"] == direction), key=lambda r: r["streams"])
    best = max(r["gbps"] for r in mine)
    return next(r["streams"] for r in mine if r["gbps"] >= 0.95 * best)


def test_probe_link_advice_agrees_with_its_own_measurements(lossy_link) -> None:
    report = _probe(
        lossy_link, "--duration", "2", "--omit", "0.5", "--max-duration", "2.5",
        "--interval-ms", "5", "--phases", "latency,throughput,chunks",
        "--chunk-sizes", "256KiB,1MiB,4MiB,8MiB", "--chunk-seconds", "0.5",
        "--kv-gbps", "0.3", "--ttft-budget-ms", "500", "--kv-direction", "both",
    )  # fmt: skip
    assert report["rtt_ms"]["p50"] == pytest.approx(20, abs=2)
    rec = report["recommendations"]
    # streams: the fewest within 5 % of the best measured, in each direction (both carry KV)
    runs = report["throughput"]["runs"]
    need = max(_fewest_streams(runs, "up"), _fewest_streams(runs, "down"))
    assert rec["set"]["kv.streams"] == need, rec["why"]
    for direction in ("up", "down"):
        for run in runs:
            if run["direction"] == direction:
                assert f"×{run['streams']} {run['gbps']:.3f} [" in rec["why"]
    one = {r["direction"]: r["gbps"] for r in runs if r["streams"] == 1}
    many = {r["direction"]: r["gbps"] for r in runs if r["streams"] == 4}
    if any(one[d] < 0.95 * many[d] for d in one):  # the case the user hit: 1 stream falls short
        assert rec["set"]["kv.streams"] == 4, rec["why"]
    # chunks: the recommended size passes the verdict's own rule whenever one size does
    limit = 0.15 * 500
    passing = [c["chunk_bytes"] for c in report["chunks"] if c["p99_ms"] <= limit]
    rule = next(r for r in report["verdict"]["rules"] if r["name"] == "chunk_p99")
    assert [s["status"] == "pass" for s in rule["sizes"]] == [
        c["p99_ms"] <= limit for c in report["chunks"]
    ]
    chosen = report["chunk_recommended_bytes"]
    if passing:
        assert chosen in passing and rule["status"] == "pass", rule["detail"]
        assert rec["set"]["kv.chunk_size_kb"] == chosen // 1024
        assert [s["chunk_bytes"] for s in rule["sizes"] if s["recommended"]] == [chosen]
    else:
        assert chosen is None and rule["status"] == "fail", rule["detail"]
        assert "kv.chunk_size_kb" not in rec["set"]


def _set_loss(cfg: netns.NetnsConfig, loss: float) -> None:
    """Change the link's loss live (the other conditions as the fixture made them)."""
    netns.up(netns.make_config(prefix=cfg.prefix, emulator="userspace", seed=1, delay_ms=10,
                               loss=loss))  # fmt: skip


def test_link_watch_sees_the_rtt_and_fails_the_loss_rule_when_loss_rises(lossy_link) -> None:
    """link-watch across the namespaces: RTT as the emulator sets it; the loss rule fails once
    a live change raises loss to 1 % (and not before, on a clean link)."""
    server = subprocess.Popen(
        ["ip", "netns", "exec", lossy_link.prefill, PDX, "probe-server", "--bind", PREFILL_ADDR,
         "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    _set_loss(lossy_link, 0.0)
    try:
        assert server.stdout is not None
        found = re.search(r"tcp (\d+)", server.stdout.readline())
        assert found
        watch = subprocess.Popen(
            ["ip", "netns", "exec", lossy_link.decode, PDX, "link-watch",
             f"{PREFILL_ADDR}:{found.group(1)}", "--window", "2", "--interval-ms", "5",
             "--judge-window", "4", "--goodput-every", "0", "--mtu-every", "0",
             "--metrics-port", "-1", "--ttft-budget-ms", "500", "--duration", "15", "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert watch.stdout is not None
        records = [json.loads(watch.stdout.readline()) for _ in range(2)]
        _set_loss(lossy_link, 0.01)
        changed = time.time()  # the emulator drops 1 % from here on
        out, err = watch.communicate(timeout=60)
        records += [json.loads(line) for line in out.splitlines()]
    finally:
        _set_loss(lossy_link, 0.002)
        server.terminate()
        server.wait(timeout=10)
    assert watch.returncode == 1, err  # NO-GO: the last judged window fails the loss rule
    windows = [r for r in records if "summary" not in r]
    assert all(w["error"] is None for w in windows)
    clean = windows[:2]
    # a window is judged on every window that ended within --judge-window of its end: lossy ones
    # are those whose judged windows all began after the change (or within 0.5 s before it: a
    # window's probing starts as soon as the last one's report is out, while the change is made)
    lossy = [
        w for w in windows
        if all(v["at"] - v["window_s"] >= changed - 0.5 for v in windows
               if w["at"] - 4 <= v["at"] <= w["at"])
    ]  # fmt: skip
    assert len(lossy) >= 2, [(w["at"] - changed, w["window_s"]) for w in windows]
    for w in windows:
        assert w["rtt_ms"]["p50"] == pytest.approx(20.0, rel=0.05)
    assert all(w["judged"]["rules"]["loss"]["status"] != "fail" for w in clean)
    assert all(w["judged"]["rules"]["loss"]["status"] == "fail" for w in lossy)
    # the round-trip loss of the probes sent after the change: 1 % each way is 1.99 %; the
    # sample (~800 probes) must not rule that out (exact binomial bounds at 99.9 % each side)
    after = [w for w in windows if w["at"] - w["window_s"] >= changed] or lossy
    lost = sum(w["lost"]["up"] + w["lost"]["down"] for w in after)
    sent = sum(w["probes"] for w in after)
    low, high = clopper_pearson(lost, sent, 0.999)
    assert lost > 0 and low <= 1 - 0.99**2 <= high, (lost, sent, low, high)
