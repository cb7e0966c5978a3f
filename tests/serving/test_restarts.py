"""Restart back-off and the board the gateway reads: the policy on a fake clock, then a real
gateway (synthetic pair in this process) answering from the board: 503 + Retry-After while
decode is down, local prefill while prefill is down, /readyz and /metrics naming both."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from pdx.errors import ConfigError
from pdx.serving.backends.tokenizer import ByteTokenizer
from pdx.serving.decode import DecodeNode
from pdx.serving.deploy_config import NodeOptions, SupervisorConfig, load_deploy_config
from pdx.serving.gateway import Gateway, build_gateway
from pdx.serving.prefill import PrefillNode
from pdx.serving.restarts import RestartBoard, backoff_s
from pdx.serving.supervisor import Child, Deployment


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def sup(**fields: Any) -> SupervisorConfig:
    return SupervisorConfig.model_validate(fields)


def test_backoff_holds_for_max_restarts_then_doubles_to_the_cap() -> None:
    cfg = sup(max_restarts=2, backoff_initial_s=1, backoff_max_s=8)
    assert [backoff_s(cfg, n) for n in range(1, 8)] == [1, 1, 2, 4, 8, 8, 8]
    no_grace = sup(max_restarts=0, backoff_initial_s=0.5, backoff_max_s=60)
    assert [backoff_s(no_grace, n) for n in (1, 2, 3)] == [1, 2, 4]
    assert backoff_s(no_grace, 10**6) == 60  # no overflow however long the crash loop


def test_defaults_and_a_cap_below_the_start_is_refused() -> None:
    cfg = sup()
    assert (cfg.max_restarts, cfg.backoff_initial_s, cfg.backoff_max_s) == (3, 1.0, 60.0)
    with pytest.raises(ConfigError, match=r"supervisor\.backoff_max_s: 0\.5 is below"):
        load_deploy_config(dotted=["supervisor.backoff_max_s=0.5"])


def test_the_board_backs_off_a_crash_loop_and_forgets_it_after_a_long_run() -> None:
    clock = Clock()
    board = RestartBoard(sup(max_restarts=1, backoff_initial_s=1, backoff_max_s=4,
                             restart_window_s=60), clock)  # fmt: skip
    board.add("prefill", 0)
    board.add("decode", 0)
    for name in ("prefill-0", "decode-0"):
        board.starting(name)
        board.up(name)
    assert board.roles_down() == [] and board.children["decode-0"].restarts == 0
    delays = []
    for _ in range(4):  # crashes seconds apart: the back-off climbs
        delays.append(board.crashed("decode-0", -9))
        assert board.is_down("decode-0") and board.roles_down() == ["decode"]
        assert board.next_attempt_in_s("decode") == delays[-1]
        clock.now += delays[-1]
        board.starting("decode-0")
        assert board.next_attempt_in_s("decode") is None  # starting: no attempt scheduled
        clock.now += 2
        board.up("decode-0")
    assert delays == [1, 2, 4, 4]
    assert board.children["decode-0"].restarts == 4
    clock.now += 60  # up a whole restart_window_s: the next crash starts a fresh run
    assert board.crashed("decode-0", 1) == 1
    row = next(r for r in board.describe() if r["name"] == "decode-0")
    assert row == {"name": "decode-0", "role": "decode", "index": 0, "state": "backoff",
                   "restarts": 4, "next_attempt_in_s": 1.0, "last_exit_code": 1}  # fmt: skip
    assert not board.is_down("prefill-0") and not board.is_down("not-supervised")


async def test_a_child_killed_while_starting_keeps_its_real_exit_code() -> None:
    """A child SIGKILLed as soon as it exists: the supervisor sees its stdout end, stops it
    (as after a failed start), and its exit code stays -9 every time; signalling it through
    asyncio's Process polled it with waitpid() first and could reap it under the child
    watcher, which then reported 255 (seen about once in 30 rounds)."""
    dep = Deployment(load_deploy_config(dotted=["supervisor.shutdown_grace_s=1"]))
    codes = []
    for _ in range(30):
        child = Child("decode", 0)
        child.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "import time; time.sleep(30)", stdout=asyncio.subprocess.PIPE
        )
        os.kill(child.proc.pid, signal.SIGKILL)
        assert child.proc.stdout is not None
        await child.proc.stdout.read()  # its end, as _read_ready sees it
        await dep._terminate(child)
        codes.append(await child.proc.wait())
    assert codes == [-signal.SIGKILL] * 30


def test_the_board_exports_restarts_up_and_backoff_series() -> None:
    clock = Clock()
    board = RestartBoard(sup(max_restarts=0, backoff_initial_s=1, backoff_max_s=60), clock)
    board.add("decode", 1)
    board.starting("decode-1")
    board.up("decode-1")
    registry = CollectorRegistry()
    board.export(registry)

    def sample(name: str) -> float | None:
        return registry.get_sample_value(name, {"role": "decode", "instance": "1"})

    assert (sample("pdx_restarts_total"), sample("pdx_role_up")) == (0, 1)
    board.crashed("decode-1", -9)
    clock.now += 0.5
    assert sample("pdx_role_up") == 0 and sample("pdx_role_backoff_seconds") == 1.5
    clock.now += 1.5
    board.starting("decode-1")
    assert sample("pdx_restarts_total") == 1 and sample("pdx_role_backoff_seconds") == 0


# --- a real gateway reading the board -----------------------------------------------------


@pytest.fixture
async def gateway() -> AsyncIterator[tuple[Gateway, RestartBoard, Clock]]:
    cfg = load_deploy_config(
        dotted=["model.backend=synthetic", "router.local_prefill_max_tokens=1"]
    )
    prefill = await PrefillNode.start(cfg, NodeOptions())
    decode = await DecodeNode.start(cfg, NodeOptions())
    clock = Clock()
    board = RestartBoard(cfg.supervisor, clock)
    for role in ("prefill", "decode"):
        board.add(role, 0)
        board.starting(f"{role}-0")
        board.up(f"{role}-0")
    gw = build_gateway(
        cfg, [("prefill-0", f"127.0.0.1:{prefill.port}")],
        [("decode-0", f"127.0.0.1:{decode.port}")], tls=None, tokenizer=ByteTokenizer(),
        max_context_tokens=1024, model_name="tiny-llama", synthetic=True, restarts=board,
    )  # fmt: skip
    await gw.start("127.0.0.1", 0)
    yield gw, board, clock
    await gw.stop()
    await decode.stop(0.5)
    await prefill.stop(0.5)


async def call(gw: Gateway, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any, str]:
    """(status, JSON body, Retry-After) of one request."""
    url = f"http://127.0.0.1:{gw.port}{path}"
    async with aiohttp.ClientSession() as s:
        req = s.post(url, json=body) if body is not None else s.get(url)
        async with req as r:
            return r.status, await r.json(), r.headers.get("Retry-After", "")


ASK = {"prompt": "a prompt for two sites", "max_tokens": 3, "pdx_route": "disaggregated"}


async def test_decode_down_is_503_with_the_next_attempt_and_back_up_serves(
    gateway: tuple[Gateway, RestartBoard, Clock],
) -> None:
    gw, board, clock = gateway
    status, body, _ = await call(gw, "/v1/completions", ASK)
    assert status == 200 and body["pdx"]["route"] == "disaggregated"
    board.crashed("decode-0", -9)  # a fresh run: backoff_initial_s (1 s)
    board.crashed("decode-0", -9)
    board.crashed("decode-0", -9)
    board.crashed("decode-0", -9)  # the 4th in a row, past max_restarts 3: 2 s
    clock.now += 0.3
    status, body, retry = await call(gw, "/v1/completions", ASK)
    assert status == 503 and retry == "2", (status, body)
    assert body["error"]["code"] == "decode_unavailable"
    assert body["error"]["type"] == "server_error"
    status, ready, retry = await call(gw, "/readyz")
    assert status == 503 and retry == "2" and ready["ready"] is False
    assert ready["roles_down"] == [{"role": "decode", "next_attempt_in_s": 1.7}]
    assert {c["name"]: c["state"] for c in ready["children"]} == {
        "prefill-0": "up", "decode-0": "backoff"}  # fmt: skip
    clock.now += 1.7
    board.starting("decode-0")
    status, _, retry = await call(gw, "/v1/completions", ASK)
    assert status == 503 and retry == str(gw.cfg.retry_after_s)  # starting: no attempt time
    board.up("decode-0")
    status, body, _ = await call(gw, "/v1/completions", ASK)
    assert status == 200 and body["choices"][0]["text"] is not None
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{gw.port}/metrics") as r:
        text = await r.text()
    assert 'pdx_restarts_total{instance="0",role="decode"} 1.0' in text
    assert 'pdx_role_up{instance="0",role="decode"} 1.0' in text
    assert 'pdx_gateway_rejections_total{reason="decode_unavailable"} 2.0' in text


async def test_prefill_down_still_serves_through_local_prefill(
    gateway: tuple[Gateway, RestartBoard, Clock],
) -> None:
    gw, board, _ = gateway
    board.crashed("prefill-0", -9)
    status, body, _ = await call(gw, "/v1/completions", ASK)
    assert status == 200
    assert (
        body["pdx"]["route"] == "local" and body["pdx"]["degrade_reason"] == "prefill_unavailable"
    )
    status, ready, _ = await call(gw, "/readyz")
    assert status == 200 and ready["ready"] is True
    assert ready["roles_down"] == [{"role": "prefill", "next_attempt_in_s": 1.0}]
