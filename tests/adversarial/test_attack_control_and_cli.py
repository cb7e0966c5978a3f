"""Row L outside the KV store: the fault proxy's control API (cross-site requests, tokens,
absurd values), `pdx certs init` (the CA key apart from what services get), and `--set`
values that are YAML tags. Real proxy, real HTTP, real CLI processes.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from attack import PDX

from pdx.faults import FaultProxy
from pdx.faults.api import ControlServer


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
    writer.close()


@pytest.fixture
async def proxied() -> AsyncIterator[tuple[FaultProxy, ControlServer]]:
    echo = await asyncio.start_server(_echo, "127.0.0.1", 0)
    upstream = ("127.0.0.1", echo.sockets[0].getsockname()[1])
    try:
        async with (
            FaultProxy(("127.0.0.1", 0), upstream) as proxy,
            ControlServer(proxy, token="s3cret-token") as control,
        ):
            yield proxy, control
    finally:
        echo.close()


async def test_cross_site_post_is_refused_and_the_link_stays_up(
    proxied: tuple[FaultProxy, ControlServer],
) -> None:
    proxy, control = proxied
    auth = {"Authorization": "Bearer s3cret-token"}
    async with aiohttp.ClientSession() as http:
        # What a web page's form can send without a CORS preflight.
        page = {"Origin": "http://evil.example", "Content-Type": "text/plain", **auth}
        async with http.post(f"{control.url}/link/down", data='{"mode": "reset"}',
                             headers=page) as r:  # fmt: skip
            assert r.status == 403 and "Origin" in (await r.json())["error"]
        async with http.get(f"{control.url}/link", headers=auth) as r:
            assert (await r.json())["link"] == "up"
        same_site = {"Origin": control.url, **auth}
        async with http.get(f"{control.url}/link", headers=same_site) as r:
            assert r.status == 200
    assert not proxy.link_blocked


async def test_without_the_token_only_health_answers(
    proxied: tuple[FaultProxy, ControlServer],
) -> None:
    _, control = proxied
    async with aiohttp.ClientSession() as http:
        for path in ("/toxics", "/stats", "/link", "/metrics"):
            async with http.get(control.url + path) as r:
                assert r.status == 401, path
            async with http.get(control.url + path,
                                headers={"Authorization": "Bearer wrong"}) as r:  # fmt: skip
                assert r.status == 401, path
        async with http.get(control.url + "/health") as r:
            assert r.status == 200


@pytest.mark.parametrize(
    ("toxic", "field"),
    [
        ({"type": "latency", "latency_ms": 1e12}, "latency_ms"),
        ({"type": "latency", "latency_ms": 10, "jitter_ms": float("1e300")}, "jitter_ms"),
        ({"type": "bandwidth", "rate_mbps": 1e15}, "rate_mbps"),
        ({"type": "slicer", "average_size": 2**40}, "average_size"),
    ],
)
async def test_absurd_values_are_a_400_naming_the_field(
    proxied: tuple[FaultProxy, ControlServer], toxic: dict[str, object], field: str
) -> None:
    proxy, control = proxied
    auth = {"Authorization": "Bearer s3cret-token"}
    url = f"{control.url}/toxics"
    async with aiohttp.ClientSession() as http, http.post(url, json=toxic, headers=auth) as r:
        body = await r.json()
        assert r.status == 400 and field in body["error"], body
    assert proxy.list_toxics() == []


def test_proxy_generates_and_prints_a_token(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as upstream:
        port = upstream.getsockname()[1]
        cmd = [*PDX, "faults", "proxy", "--listen", "127.0.0.1:0", "--upstream",
               f"127.0.0.1:{port}", "--api", "127.0.0.1:0", "--api-token", "generate",
               "--duration-s", "1"]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "bearer token " in done.stderr


def test_certs_init_keeps_the_ca_key_out_of_the_service_directory(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    done = subprocess.run([*PDX, "certs", "init", str(certs)], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    handed_out = sorted(p.name for p in certs.iterdir())
    assert "ca.key" not in handed_out and "ca.pem" in handed_out
    ca_key = tmp_path / "certs.ca-key" / "ca.key"
    assert ca_key.is_file() and ca_key.stat().st_mode & 0o077 == 0
    assert all(p.stat().st_mode & 0o077 == 0 for p in certs.glob("*.key"))


@pytest.mark.parametrize(
    "value",
    ["!!python/object/apply:os.system ['echo pwned']", "!!python/name:os.system", "[1, 2", "{a: 1"],
)
@pytest.mark.parametrize("command", [["deploy", "--print-config"], ["kv-serve"], ["simulate"]])
def test_set_with_a_yaml_tag_is_one_line_and_exit_2(
    tmp_path: Path, command: list[str], value: str
) -> None:
    key = "kv.streams" if command[0] != "kv-serve" else "ttl_s"
    env = {**os.environ, "COLUMNS": "200"}
    done = subprocess.run([*PDX, *command, "--set", f"{key}={value}"], capture_output=True,
                          text=True, timeout=60, env=env, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --set "), done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "pwned").exists()
