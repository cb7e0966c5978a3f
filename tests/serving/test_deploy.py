"""``pdx deploy``: config validation through the CLI, and the real command end to end."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from live_deploy import pids_with, read_endpoints
from typer.testing import CliRunner

from pdx.cli.main import app
from pdx.serving.deploy_config import load_deploy_config

runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--set", "decode.count=0"], "decode.count"),
        (["--set", "kv.kv_ttl_seconds=10"], "kv.kv_ttl_seconds"),
        (["--set", "kv.codec=gzip"], "kv.codec"),
        (["--set", "gateway.colour=blue"], "gateway.colour: unknown key"),
        (["--set", "model.backend=onnx"], "model.backend"),
        (["--port", "70000"], "--port"),
        (["--config", "/nonexistent/deploy.yaml"], "config"),
        (["--render", "helm", "out"], "--render"),
        (["--render", "k8s"], "OUT_DIR"),
        (["somewhere"], "OUT_DIR"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(args: list[str], needle: str) -> None:
    result = runner.invoke(app, ["deploy", *args])
    assert result.exit_code == 2, result.output
    assert needle in result.output
    assert "Traceback" not in result.output


def test_bad_yaml_file_names_every_problem(tmp_path: Path) -> None:
    cfg = tmp_path / "deploy.yaml"
    cfg.write_text("decode:\n  max_batch: 0\nrouter:\n  degrade_p99_ms: -1\n")
    result = runner.invoke(app, ["deploy", "--config", str(cfg)])
    assert result.exit_code == 2
    assert "decode.max_batch" in result.output and "router.degrade_p99_ms" in result.output


def test_parametrised_codec_names_are_accepted() -> None:
    """Any name get_codec understands (int4-g16: a group size not in the fixed list) is valid."""
    assert load_deploy_config(dotted=["kv.codec=int4-g16"]).kv.codec == "int4-g16"
    result = runner.invoke(app, ["deploy", "--set", "kv.codec=int4-gx"])
    assert result.exit_code == 2 and "int{4|8}[-g<N>]" in result.output


def test_loopback_proxy_with_decode_in_another_namespace_is_refused() -> None:
    sets = ["kv.via_proxy=true", "decode.netns=pdx-decode", "tls.enabled=false",
            "security.allow_plaintext=true"]  # fmt: skip
    result = runner.invoke(app, ["deploy", *[a for s in sets for a in ("--set", s)]])
    assert result.exit_code == 2, result.output
    assert "kv.proxy_host: 127.0.0.1 is loopback" in result.output
    assert "Traceback" not in result.output
    # Run in the decode namespace (decode.netns unset), loopback is the decode side: accepted.
    cfg = load_deploy_config(dotted=["kv.via_proxy=true", "prefill.netns=pdx-prefill",
                                     "prefill.host=10.77.1.1", "tls.enabled=false",
                                     "security.allow_plaintext=true"])  # fmt: skip
    assert cfg.kv.proxy_host == "127.0.0.1" and cfg.kv.proxy_control_host == "127.0.0.1"


@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        (["prefill.netns=a", "prefill.host=10.77.1.1", "tls.enabled=false"],
         "prefill.netns 'a' and decode.netns None differ) and tls.enabled: false"),
        (["prefill.host=192.0.2.7", "tls.enabled=false"], "prefill.host is 192.0.2.7"),
        (["engine=vllm", "vllm.prefill_urls=[http://192.0.2.7:8000]",
          "vllm.decode_urls=[http://127.0.0.1:9]"], "engine: vllm sends the prefill call"),
    ],
)  # fmt: skip
def test_plaintext_between_sites_needs_allow_plaintext(sets: list[str], needle: str) -> None:
    result = runner.invoke(app, ["deploy", *[a for s in sets for a in ("--set", s)]])
    assert result.exit_code == 2 and needle in result.output, result.output
    assert "set security.allow_plaintext: true to run it anyway" in result.output
    load_deploy_config(dotted=[*sets, "security.allow_plaintext=true"])  # asked for: accepted
    if "tls.enabled=false" in sets and not any(s.startswith("prefill.netns") for s in sets):
        load_deploy_config(dotted=[s for s in sets if s != "tls.enabled=false"])  # TLS on: fine


def test_print_config_round_trips(tmp_path: Path) -> None:
    result = runner.invoke(app, ["deploy", "--print-config", "--set", "decode.count=3"])
    assert result.exit_code == 0
    path = tmp_path / "deploy.yaml"
    path.write_text(result.output)
    cfg = load_deploy_config(path)
    assert cfg.decode.count == 3
    assert cfg == load_deploy_config(dotted=["decode.count=3"])


def test_embedded_default_is_the_documented_pair() -> None:
    cfg = load_deploy_config()
    assert (cfg.prefill.count, cfg.decode.count) == (1, 1)
    assert cfg.model.backend == "transformers" and cfg.model.preset == "tiny-llama"
    assert cfg.tls.enabled and cfg.gateway.host == "127.0.0.1" and cfg.gateway.port == 8000
    assert cfg.kv.kv_transfer_timeout_ms is None and cfg.kv.kv_retry_budget == 2  # derived


# --- the real command -------------------------------------------------------------------


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def processes_under(work_dir: str) -> list[int]:
    """Pids whose command line names this deployment's work dir (its children)."""
    return pids_with(work_dir)


async def wait_ready(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url + "/readyz") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise AssertionError("gateway not ready again in time")


async def stream_until_error(url: str, kill_pid: int) -> tuple[int, list[Any]]:
    """Stream a long completion; kill the decode process after a few tokens."""
    body = {"prompt": "hi", "max_tokens": 900, "stream": True, "ignore_eos": True,
            "pdx_route": "local", "return_token_ids": True}  # fmt: skip
    events: list[Any] = []
    tokens = 0
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
            tokens += 1
            if tokens == 5:
                os.kill(kill_pid, signal.SIGKILL)
    return tokens, events


@pytest.mark.slow
@pytest.mark.alone
async def test_pdx_deploy_serves_survives_a_killed_decode_and_stops_cleanly() -> None:
    cmd = [sys.executable, "-c", "from pdx.cli.main import main; main()", "deploy", "--port", "0",
           "--json",
           "--set", "prefill.count=0", "--set", "supervisor.backoff_initial_s=0.2",
           "--set", "router.status_poll_ms=100"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        ep = await asyncio.to_thread(read_endpoints, proc)
        url, decode_pid = ep["gateway"], ep["decode"][0]["pid"]
        assert url.startswith("http://127.0.0.1:") and ep["tls_dir"]
        # Killing decode mid-stream ends the stream with a clear error, never a hang.
        tokens, events = await asyncio.wait_for(stream_until_error(url, decode_pid), 60)
        assert events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert (
            error["type"] == "server_error"
            and error["code"] == "decode_failed"
            and "decode instance decode-0 failed" in (error["message"])
        )
        assert 5 <= tokens < 900
        # The supervisor restarts decode (same port, backoff); service resumes.
        await wait_ready(url, 90)
        ok = {"prompt": "hi", "max_tokens": 3}
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=ok) as r:
            assert r.status == 200
        children = processes_under(ep["work_dir"])
        assert children and decode_pid not in children
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = await asyncio.to_thread(proc.wait, 30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert rc == 0, proc.stderr.read() if proc.stderr else ""
    assert not [p for p in children if alive(p)]


def _handshake(port: int, cert_dir: Path, tls12: bool) -> str | None:
    ctx = ssl.create_default_context(cafile=str(cert_dir / "ca.pem"))
    ctx.load_cert_chain(cert_dir / "gateway.pem", cert_dir / "gateway.key")
    ctx.set_alpn_protocols(["h2"])
    if tls12:
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        return tls.version()


@pytest.mark.slow
async def test_every_grpc_port_of_a_deploy_takes_tls13_and_refuses_tls12() -> None:
    """The contract's TLS 1.3: prefill's, its KV store's and decode's gRPC ports, each in its
    own process as ``pdx deploy`` starts them, refuse a client that offers TLS 1.2 at most."""
    cmd = [sys.executable, "-c", "from pdx.cli.main import main; main()", "deploy", "--port", "0",
           "--json"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        ep = await asyncio.to_thread(read_endpoints, proc)
        certs = Path(ep["tls_dir"])
        ports = [ep["prefill"][0]["port"], ep["prefill"][0]["kv_port"], ep["decode"][0]["port"]]
        for port in ports:
            assert await asyncio.to_thread(_handshake, port, certs, False) == "TLSv1.3"
            with pytest.raises((ssl.SSLError, ConnectionError)):
                await asyncio.to_thread(_handshake, port, certs, True)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, 30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise


CLIENT = """
import json, sys, urllib.request
out = {}
for route in ("local", "disaggregated"):
    body = {"prompt": "across two sites", "max_tokens": 12, "pdx_route": route,
            "return_token_ids": True, "ignore_eos": True}
    req = urllib.request.Request(sys.argv[1], json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        out[route] = json.load(r)
print(json.dumps(out))
"""


@contextlib.asynccontextmanager
async def deploy_in_decode_namespace(
    prefix: str, sets: list[str]
) -> AsyncIterator[tuple[list[str], dict[str, Any]]]:
    """Namespaces up, ``pdx deploy`` inside the decode one with prefill in its own; yields the
    command prefix that runs Python in the decode namespace and the printed endpoints. On exit:
    SIGTERM, then the deploy must have stopped cleanly (exit 0), and the namespaces go."""
    from pdx.faults.netns import down, make_config, up

    net = make_config(prefix=prefix, rate_mbit=1000)
    await asyncio.to_thread(up, net)
    in_decode = ["ip", "netns", "exec", net.decode, sys.executable]
    base = [f"prefill.netns={net.prefill}", "prefill.host=10.77.1.1", "tls.enabled=false",
            "security.allow_plaintext=true"]  # fmt: skip
    set_args = [a for item in [*base, *sets] for a in ("--set", item)]
    cmd = [*in_decode, "-c", "from pdx.cli.main import main; main()", "deploy", "--port", "0",
           "--json", *set_args]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield in_decode, await asyncio.to_thread(read_endpoints, proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = await asyncio.to_thread(proc.wait, 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        await asyncio.to_thread(down, net)
    assert rc == 0


@pytest.mark.slow
@pytest.mark.system
async def test_prefill_in_its_own_namespace_ships_kv_through_the_router_hop() -> None:
    sets = ["kv.kv_transfer_timeout_ms=5000"]
    async with deploy_in_decode_namespace("pdxsv", sets) as (in_decode, ep):
        assert ep["prefill"][0]["kv_endpoint"].startswith("10.77.1.1:")
        url = ep["gateway"] + "/v1/completions"
        client = await asyncio.to_thread(
            subprocess.run, [*in_decode, "-c", CLIENT, url],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert client.returncode == 0, client.stderr
        out = json.loads(client.stdout)
        dis, local = out["disaggregated"], out["local"]
        assert dis["pdx"]["route"] == "disaggregated" and not dis["pdx"]["degraded"]
        assert dis["pdx"]["kv_bytes"] > 0
        assert dis["choices"][0]["token_ids"] == local["choices"][0]["token_ids"]


@pytest.mark.slow
@pytest.mark.alone
async def test_a_restart_that_never_gets_ready_is_killed_and_retried_never_given_up() -> None:
    from pdx.serving.supervisor import Deployment

    sets = ["gateway.port=0", "prefill.count=0", "tls.enabled=false", "supervisor.max_restarts=0",
            "supervisor.backoff_initial_s=0.1", "supervisor.backoff_max_s=0.4",
            "router.status_poll_ms=100"]  # fmt: skip
    dep = Deployment(load_deploy_config(dotted=sets))
    await dep.start()
    try:
        decode = dep.board.children["decode-0"]
        dep.cfg.supervisor.ready_timeout_s = 0.3  # every restart now misses its deadline
        os.kill(dep.endpoints().decode[0]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while decode.restarts < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert decode.restarts >= 3 and decode.state != "up" and dep.failed is None
        # Each one was stopped, not left hanging: at most the current attempt is running.
        assert len(processes_under(str(dep.work_dir))) <= 1
        dep.cfg.supervisor.ready_timeout_s = 120
        await wait_ready(dep.endpoints().gateway, 120)
        assert decode.state == "up"
    finally:
        await dep.stop()


PROXY_CLIENT = """
import json, sys, urllib.request
url, control, token = sys.argv[1], sys.argv[2], sys.argv[3]
auth = {"Authorization": "Bearer " + token}
def post(where, body):
    req = urllib.request.Request(where, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **auth})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)
def ask(route):
    return post(url, {"prompt": "across two sites", "max_tokens": 12, "pdx_route": route,
                      "return_token_ids": True, "ignore_eos": True})
out = {"local": ask("local"), "through_proxy": ask("disaggregated")}
with urllib.request.urlopen(urllib.request.Request(control + "/stats", headers=auth),
                            timeout=10) as r:
    out["stats"] = json.load(r)
post(control + "/link/down", {"mode": "reset"})
out["link_down"] = ask("disaggregated")
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.system
async def test_kv_fault_proxy_binds_on_the_decode_side_under_netns() -> None:
    sets = ["kv.via_proxy=true", "kv.kv_transfer_timeout_ms=5000"]
    async with deploy_in_decode_namespace("pdxpx", sets) as (in_decode, ep):
        (proxy,) = ep["proxies"]
        kv_port = int(ep["prefill"][0]["kv_endpoint"].rsplit(":", 1)[1])
        assert proxy["listen"].startswith("127.0.0.1:")
        assert proxy["upstream"] == ["10.77.1.1", kv_port]
        client = await asyncio.to_thread(
            subprocess.run, [*in_decode, "-c", PROXY_CLIENT, ep["gateway"] + "/v1/completions",
                             proxy["control"], proxy["control_token"]],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert client.returncode == 0, client.stderr
        out = json.loads(client.stdout)
        ok, cut, local = out["through_proxy"], out["link_down"], out["local"]
        assert ok["pdx"]["route"] == "disaggregated" and not ok["pdx"]["degraded"]
        assert out["stats"]["bytes_in"]["downstream"] >= ok["pdx"]["kv_bytes"] > 0
        assert cut["pdx"]["degraded"] and cut["pdx"]["route"] == "local"
        want = local["choices"][0]["token_ids"]
        assert ok["choices"][0]["token_ids"] == want == cut["choices"][0]["token_ids"]
