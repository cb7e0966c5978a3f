"""KV transfer across an emulated WAN (root only): connect and move objects at 50, 150 and
300 ms RTT with and without mutual TLS, under derived deadlines; warm connections after idle.

One topology for the module (the router hop delays every packet, so TCP itself sees the RTT);
a plaintext and a TLS store run in the prefill site (``pdx kv-serve``); each client is a fresh
process in the decode site, so every case starts cold: gRPC channel, TLS, data-plane dial.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdx.faults import netns
from pdx.tcp import available_congestion_controls
from pdx.tls import init_certs

pytestmark = [
    pytest.mark.system,
    pytest.mark.slow,
    pytest.mark.alone,
    pytest.mark.skipif(
        any(shutil.which(t) is None for t in ("ip", "tc")) or not os.path.exists("/dev/net/tun"),
        reason="needs iproute2 and /dev/net/tun",
    ),
]

STORE_ADDR = "10.77.1.1"
PDX = str(Path(sys.executable).with_name("pdx"))

_CLIENT = r"""
import asyncio, json, os, sys, time
from pathlib import Path
from pdx.tls import TLSConfig
from pdx.transfer.client import KVClient
from pdx.transfer.contract import KVClientConfig

async def main(target, size, tls_dir, idle_s):
    tls = TLSConfig(cert_dir=Path(tls_dir), name="decode") if tls_dir else None
    cfg = KVClientConfig(kv_retry_budget=0)  # derived deadlines; no retry hides a failure
    data = os.urandom(size)
    out = {"rounds": []}
    async with KVClient(target, cfg, tls=tls) as kv:
        for i in range(3 if idle_s else 1):
            if i == 2:
                await asyncio.sleep(idle_s)  # the pooled connection sits idle
            t0 = time.perf_counter()
            kv_id = await kv.put(data)
            obj = await kv.get(kv_id, size_hint=size)
            assert bytes(obj.data) == data
            await kv.release(kv_id)
            out["rounds"].append(time.perf_counter() - t0)
        out["records"] = [r.as_dict() for r in kv.records()]
    print(json.dumps(out), flush=True)

asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])))
"""


def _store(ns: str, *args: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        ["ip", "netns", "exec", ns, PDX, "kv-serve", "--host", STORE_ADDR, "--port", "0",
         "--json", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    text = ""
    for line in proc.stdout:  # the ready document (printed indented)
        text += line
        if line.startswith("}"):
            return proc, int(json.loads(text)["port"])
    proc.kill()
    raise AssertionError(f"kv-serve did not start: {proc.stderr.read() if proc.stderr else ''}")


@pytest.fixture(scope="module")
def wan(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    certs = tmp_path_factory.mktemp("certs")
    init_certs(certs, hosts=[STORE_ADDR])
    cfg = netns.make_config(prefix=f"pdxk{os.getpid() % 10000}", emulator="userspace", seed=3)
    procs = []
    try:
        netns.up(cfg)
        plain, plain_port = _store(cfg.prefill)
        procs.append(plain)
        tls, tls_port = _store(cfg.prefill, "--tls-dir", str(certs), "--tls-name", "kv-store")
        procs.append(tls)
        yield {"cfg": cfg, "certs": certs, "plain": plain_port, "tls": tls_port}
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=10)
        netns.down(cfg)


def _client(wan: dict[str, Any], *, tls: bool, size: int, idle_s: float = 0) -> dict[str, Any]:
    cfg = wan["cfg"]
    port = wan["tls" if tls else "plain"]
    certs = str(wan["certs"]) if tls else ""
    out = subprocess.run(
        ["ip", "netns", "exec", cfg.decode, sys.executable, "-c", _CLIENT,
         f"{STORE_ADDR}:{port}", str(size), certs, str(idle_s)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-1500:]
    data: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return data


@pytest.mark.parametrize("rtt_ms", [50, 150, 300])
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "mtls"])
def test_connects_and_transfers_at_any_rtt_under_derived_deadlines(wan, rtt_ms, tls) -> None:
    cfg = wan["cfg"]
    netns.up(netns.make_config(prefix=cfg.prefix, emulator="userspace", seed=3,
                               delay_ms=rtt_ms / 2))  # fmt: skip
    out = _client(wan, tls=tls, size=4 << 20)
    put, get = (next(r for r in out["records"] if r["op"] == op) for op in ("put", "get"))
    for rec in (put, get):
        assert rec["outcome"] == "ok" and rec["retries"] == 0
        assert rec["transport"] == "data" and rec["deadline_source"] == "derived"
        # the deadline follows the path: it was derived from the RTT TCP itself measured
        assert rec["rtt_ms"] == pytest.approx(rtt_ms, abs=3)
        assert rec["deadline_ms"] >= 10 * rtt_ms
        assert rec["ms"] < rec["deadline_ms"]
    assert put["congestion_control"] in ("bbr", "cubic", "reno")


def test_a_transfer_after_idle_is_as_fast_as_back_to_back(wan) -> None:
    cfg = wan["cfg"]
    netns.up(netns.make_config(prefix=cfg.prefix, emulator="userspace", seed=3, delay_ms=25,
                               rate_mbit=1000))  # fmt: skip
    out = _client(wan, tls=False, size=16 << 20, idle_s=10)
    _cold, back_to_back, after_idle = out["rounds"]
    # BBR (the default per socket) is exempt from slow start after idle: the pooled
    # connection keeps its window over 10 s of silence.
    assert after_idle <= 1.15 * back_to_back, out["rounds"]
    puts = [r for r in out["records"] if r["op"] == "put"]
    if "bbr" in available_congestion_controls():
        assert {r["congestion_control"] for r in puts} == {"bbr"}
