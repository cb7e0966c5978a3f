"""The two-site namespaces (root only): up twice, ping across, MTU, rate and loss, down."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from pdx.faults import netns


@pytest.mark.system
@pytest.mark.slow
@pytest.mark.skipif(
    any(shutil.which(tool) is None for tool in ("ip", "tc", "ping")),
    reason="needs iproute2 and ping",
)
def test_netns_up_ping_shape_and_down() -> None:
    cfg = netns.make_config(prefix=f"pdxt{os.getpid() % 100000}", rate_mbit=50, loss=0.0, mtu=1400)
    try:
        netns.up(cfg)
        state = netns.up(cfg)  # idempotent: a second run reconfigures, does not fail
        assert state["up"]
        assert "rate 50Mbit" in state["qdiscs"]["eth-decode"]
        in_prefill = ["ip", "netns", "exec", cfg.prefill]
        decode = state["decode_addr"]
        ping = subprocess.run(
            [*in_prefill, "ping", "-c", "3", "-i", "0.2", "-W", "1", state["decode_addr"]],
            capture_output=True,
            text=True,
            timeout=20,
        )
        assert ping.returncode == 0, ping.stdout + ping.stderr
        assert " 0% packet loss" in ping.stdout

        # MTU 1400 on the path: a 1372-byte payload fits (1400 - 28), 1373 does not.
        def df_ping(size: int) -> int:
            return subprocess.run(
                [*in_prefill, "ping", "-c", "1", "-W", "1", "-M", "do", "-s", str(size), decode],
                capture_output=True,
                timeout=10,
            ).returncode

        assert df_ping(1372) == 0 and df_ping(1373) != 0
        lossy_cfg = netns.make_config(prefix=cfg.prefix, rate_mbit=50, loss=0.5, mtu=1400)
        lossy = netns.up(lossy_cfg)
        assert lossy["wan"]["running"] and lossy["wan"]["conditions"]["down"]["loss"] == 0.5
        ping = subprocess.run(
            [*in_prefill, "ping", "-c", "40", "-i", "0.01", "-W", "1", "-q", decode],
            capture_output=True,
            text=True,
            timeout=30,
        )
        # Each ping crosses the router twice: P(reply) = 0.25, so about 10 of 40 come back.
        received = int(re.search(r"(\d+) received", ping.stdout).group(1))  # type: ignore[union-attr]
        assert 2 <= received <= 22, ping.stdout
        wan = netns.status(cfg)["wan"]
        dropped = [c.get("dropped_loss", c.get("dropped", 0)) for c in wan["counters"].values()]
        assert sum(dropped) > 0
    finally:
        netns.down(cfg)
    assert not any(netns.status(cfg)["namespaces"].values())
