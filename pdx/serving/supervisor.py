"""Running a deployment: child processes, readiness, restart with backoff, clean shutdown.

``Deployment(cfg).start()`` generates mutual-TLS material (unless given), starts N prefill
and M decode processes (each binds an ephemeral port unless told otherwise and announces
itself on stdout with one ``PDX-READY {json}`` line), optionally puts a fault proxy in front
of each KV store, then starts the gateway in this process. A child that dies is restarted
on the same ports, for as long as the deployment runs, after the back-off of
:mod:`pdx.serving.restarts`; its :class:`RestartBoard` is how the gateway (same process)
learns which child is down and when the next attempt is. ``stop()`` shuts everything down
(SIGTERM, grace, then SIGKILL).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdx.errors import PdxError
from pdx.serving.deploy_config import DeployConfig
from pdx.serving.node import READY_PREFIX
from pdx.serving.restarts import RestartBoard

CERT_NAMES = ("kv-store", "prefill", "decode", "gateway")
REAP_WAIT_S = 10.0  # at stop: how long an engine's SIGKILLed processes get to be gone
log = logging.getLogger("pdx.deploy")


class DeployError(PdxError):
    """The deployment could not start, or its supervision itself failed."""


@dataclass
class Child:
    """One supervised process."""

    role: str
    index: int
    proc: asyncio.subprocess.Process | None = None
    info: dict[str, Any] = field(default_factory=dict)
    log_path: Path | None = None

    @property
    def name(self) -> str:
        """``prefill-0``, ``decode-1``, ..."""
        return f"{self.role}-{self.index}"

    def address(self, host: str) -> str:
        """gRPC address of its service."""
        return f"{host}:{self.info['port']}"


@dataclass
class Endpoints:
    """Where things listen once the deployment is up."""

    gateway: str
    prefill: list[dict[str, Any]]
    decode: list[dict[str, Any]]
    proxies: list[dict[str, Any]]
    tls_dir: str | None
    work_dir: str
    model: dict[str, Any]


class Deployment:
    """The whole pair on one machine, started from one validated config."""

    def __init__(
        self, cfg: DeployConfig, *, work_dir: Path | None = None, role: str = "all"
    ) -> None:
        self.cfg = cfg
        self.role = role  # pdx.serving.roles: "all", or one site's part
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if work_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="pdx-deploy-")
            work_dir = Path(self._tmp.name)
        self.work_dir = work_dir
        self.cert_dir: Path | None = None
        self.children: list[Child] = []
        self.proxies: list[Any] = []
        self.controls: list[Any] = []
        self.gateway: Any = None
        self.engines: Any = None  # VLLMEngines with engine: vllm
        self.board = RestartBoard(cfg.supervisor)
        self.failed: str | None = None  # supervision itself broke (never a child's crash)
        self._stopping = False
        self._watchers: list[asyncio.Task[None]] = []
        self._remote_model: dict[str, Any] | None = None  # --role gateway: from decode's Status

    # --- start ---------------------------------------------------------------------

    async def start(self) -> Endpoints:
        """Start every process and the gateway; raise DeployError if any cannot start."""
        from pdx.serving.roles import CHILD_ROLES, check_role

        check_role(self.cfg, self.role)
        if (self.cfg.prefill.netns or self.cfg.decode.netns) and os.geteuid() != 0:
            raise DeployError("prefill.netns / decode.netns need root (ip netns exec)")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.cert_dir = self._certs() if self.cfg.engine == "pdx" else None
        cfg_path = self.work_dir / "deploy.json"
        cfg_path.write_text(self.cfg.model_dump_json())
        starts = CHILD_ROLES[self.role]
        if "prefill" in starts:
            self.children = [Child("prefill", i) for i in range(self.cfg.prefill.count)]
        if "decode" in starts:
            self.children += [Child("decode", i) for i in range(self.cfg.decode.count)]
        if self.cfg.engine == "vllm":
            self.children = await self._prepare_engines()
        for c in self.children:
            self.board.add(c.role, c.index)
        try:
            await asyncio.gather(*(self._spawn(c) for c in self.children))
            if self.role in ("all", "gateway"):
                await self._start_proxies()
                await self._start_gateway()
        except BaseException:
            await self.stop()
            raise
        self._watchers = [asyncio.create_task(self._watch(c)) for c in self.children]
        return self.endpoints()

    def _certs(self) -> Path | None:
        tls = self.cfg.tls
        if not tls.enabled:
            return None
        if tls.dir is not None:
            return tls.dir
        from pdx.tls import init_certs

        cert_dir = self.work_dir / "certs"
        if not (cert_dir / "ca.pem").exists():
            init_certs(cert_dir, CERT_NAMES, days=7)
        return cert_dir

    def _argv(self, child: Child) -> list[str]:
        module = f"pdx.serving.{child.role}"
        argv = [sys.executable, "-m", module, str(self.work_dir / "deploy.json"), str(child.index)]
        netns = self.cfg.prefill.netns if child.role == "prefill" else self.cfg.decode.netns
        if netns:
            argv = ["ip", "netns", "exec", netns, *argv]
        if self.cert_dir:
            argv += ["--cert-dir", str(self.cert_dir)]
        if child.info:  # a restart: the same ports as before, so peers keep their addresses
            argv += ["--port", str(child.info["port"])]
            if child.info.get("kv_port"):
                argv += ["--kv-port", str(child.info["kv_port"])]
        return argv

    async def _prepare_engines(self) -> list[Child]:
        """vLLM instances: environment, model and ports fixed once (none when fronting)."""
        from pdx.serving.engines.vllm import VLLMEngines

        self.engines = VLLMEngines(self.cfg, self.work_dir)
        await asyncio.to_thread(self.engines.prepare)
        return [Child(role, i) for role, i in self.engines.children_roles()]

    async def _spawn_engine(self, child: Child) -> None:
        from pdx.serving.engines.vllm import EngineStartError

        try:
            await self.engines.spawn(child)
        except EngineStartError as exc:
            raise DeployError(f"{child.name}: {exc}") from None

    async def _spawn(self, child: Child) -> None:
        self.board.starting(child.name)
        if self.engines is not None:
            await self._spawn_engine(child)
        else:
            await self._spawn_node(child)
        self.board.up(child.name)

    async def _spawn_node(self, child: Child) -> None:
        child.log_path = self.work_dir / f"{child.name}.log"
        logf = child.log_path.open("ab")
        try:
            child.proc = await asyncio.create_subprocess_exec(
                *self._argv(child), stdout=asyncio.subprocess.PIPE, stderr=logf
            )
        finally:
            logf.close()
        timeout = self.cfg.supervisor.ready_timeout_s
        try:
            info = await asyncio.wait_for(self._read_ready(child), timeout)
        except TimeoutError:
            raise DeployError(f"{child.name} not ready within {timeout:g} s") from None
        child.info = {**info, "pid": child.proc.pid}

    async def _read_ready(self, child: Child) -> dict[str, Any]:
        assert child.proc is not None and child.proc.stdout is not None
        while True:
            line = await child.proc.stdout.readline()
            if not line:
                tail = _tail(child.log_path)
                raise DeployError(f"{child.name} exited before it was ready: {tail}")
            text = line.decode(errors="replace").strip()
            if text.startswith(READY_PREFIX):
                info: dict[str, Any] = json.loads(text[len(READY_PREFIX) :])
                return info

    async def _start_proxies(self) -> None:
        if not self.cfg.kv.via_proxy:
            return
        from pdx.faults.api import ControlServer
        from pdx.faults.proxy import FaultProxy

        # The proxy listens on the decode side (this process's namespace, where decode's
        # KV reads start) and forwards to the prefill site, so it also works when prefill
        # sits in another namespace whose address this one cannot bind.
        kv = self.cfg.kv
        for _name, _address, kv_endpoint in self._prefill_targets():
            host, _, kv_port = kv_endpoint.rpartition(":")
            upstream = (host, int(kv_port))
            proxy = FaultProxy((kv.proxy_host, 0), upstream)
            await proxy.start()
            self.proxies.append(proxy)
            # A bearer token, handed to whoever reads the endpoints (pdx accept).
            control = ControlServer(
                proxy, kv.proxy_control_host, 0, token=secrets.token_urlsafe(16)
            )
            await control.start()
            self.controls.append(control)

    async def _start_engine_gateway(self) -> None:
        from pdx.serving.gateway.engine_app import gateway_for_engines

        self.gateway = await gateway_for_engines(self.cfg, self.engines, restarts=self.board)
        await self.gateway.start(self.cfg.gateway.host, self.cfg.gateway.port)

    async def _start_gateway(self) -> None:
        if self.engines is not None:
            await self._start_engine_gateway()
            return
        from pdx.serving.backends.tokenizer import ByteTokenizer
        from pdx.serving.gateway import build_gateway
        from pdx.tls import tls_for

        cfg = self.cfg
        prefills = [(name, address) for name, address, _ in self._prefill_targets()]
        decodes = self._decode_targets()
        tokenizer = await asyncio.to_thread(_tokenizer, cfg) if cfg.model.checkpoint else None
        info = await self._gateway_model_info()
        self.gateway = build_gateway(
            cfg,
            prefills,
            decodes,
            tls=tls_for(self.cert_dir, "gateway"),
            tokenizer=tokenizer or ByteTokenizer(),
            max_context_tokens=int(info.get("max_context_tokens", 1024)),
            model_name=str(info.get("model", cfg.model.preset)),
            synthetic=bool(info.get("synthetic", False)),
            restarts=self.board,
        )
        targets = self._prefill_targets() if self.proxies else []
        for proxy, (_name, _address, real) in zip(self.proxies, targets, strict=True):
            self.gateway.kv_route[real] = f"{proxy.address[0]}:{proxy.port}"
        await self.gateway.start(cfg.gateway.host, cfg.gateway.port)

    def _prefill_targets(self) -> list[tuple[str, str, str]]:
        """(name, gRPC address, KV endpoint) of every prefill: started here, or configured."""
        from pdx.serving.roles import remotes

        if self.role == "gateway":
            return [(r.name, r.address, r.kv_endpoint) for r in remotes(self.cfg, "prefill")]
        host = self.cfg.prefill.host
        return [(c.name, c.address(host), str(c.info["kv_endpoint"])) for c in self.children
                if c.role == "prefill"]  # fmt: skip

    def _decode_targets(self) -> list[tuple[str, str]]:
        from pdx.serving.roles import remotes

        if self.role == "gateway":
            return [(r.name, r.address) for r in remotes(self.cfg, "decode")]
        return [(c.name, c.address(self.cfg.decode.host)) for c in self.children
                if c.role == "decode"]  # fmt: skip

    async def _gateway_model_info(self) -> dict[str, Any]:
        if self.role != "gateway":
            return self._model_info()
        from pdx.serving.roles import decode_model_info, remotes
        from pdx.tls import tls_for

        first = remotes(self.cfg, "decode")[0]
        self._remote_model = await decode_model_info(
            self.cfg, tls_for(self.cert_dir, "gateway"), first
        )
        return self._remote_model

    def _model_info(self) -> dict[str, Any]:
        if self.engines is not None:
            info: dict[str, Any] = self.engines.model_dict()
            return info
        if self._remote_model is not None:
            return self._remote_model
        child = next((c for c in self.children if c.role == "decode"), None)
        child = child or next(c for c in self.children if c.role == "prefill")
        return child.info

    def endpoints(self) -> Endpoints:
        """The addresses a user (or a test) needs."""
        gw = self.gateway
        if self.engines is not None:
            return self._engine_endpoints()
        from pdx.serving.roles import remotes

        rows: dict[str, list[dict[str, Any]]] = {}
        for role in ("prefill", "decode"):
            rows[role] = [{"name": c.name, **c.info} for c in self.children if c.role == role]
            if self.role == "gateway":
                rows[role] = [r.row() for r in remotes(self.cfg, role)]
        return Endpoints(
            gateway=f"http://{self.cfg.gateway.host}:{gw.port}" if gw else "",
            prefill=rows["prefill"],
            decode=rows["decode"],
            proxies=[
                {
                    "listen": f"{p.address[0]}:{p.port}",
                    "upstream": list(p.upstream),
                    "control": c.url,
                    "control_token": c.token,
                }
                for p, c in zip(self.proxies, self.controls, strict=True)
            ],
            tls_dir=str(self.cert_dir) if self.cert_dir else None,
            work_dir=str(self.work_dir),
            model=self._model_info() if self.children or self._remote_model else {},
        )

    def _engine_endpoints(self) -> Endpoints:
        """Each vLLM instance with its ``url`` (started ones also with pid and ports)."""
        started = {c.name: c for c in self.children}
        rows: dict[str, list[dict[str, Any]]] = {"prefill": [], "decode": []}
        for inst in self.engines.instances.values():
            child = started.get(inst.name)
            info = child.info if child and child.info else self.engines.describe(inst)
            rows[inst.role].append({"name": inst.name, **info})
        gw = self.gateway
        return Endpoints(
            gateway=f"http://{self.cfg.gateway.host}:{gw.port}" if gw else "",
            prefill=rows["prefill"], decode=rows["decode"], proxies=[], tls_dir=None,
            work_dir=str(self.work_dir), model=self._model_info(),
        )  # fmt: skip

    # --- supervision ---------------------------------------------------------------

    async def _watch(self, child: Child) -> None:
        try:
            await self._restart_forever(child)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here would silently end the restarts: stop loudly
            log.exception("supervising %s failed", child.name)
            self.failed = f"supervising {child.name} failed: {exc!r}"

    async def _restart_forever(self, child: Child) -> None:
        """Restart ``child`` each time it exits, after the board's back-off; never give up."""
        while not self._stopping:
            assert child.proc is not None
            code = await child.proc.wait()
            if self._stopping:
                return
            delay = self.board.crashed(child.name, code)
            streak = self.board.children[child.name].streak
            log.warning("%s exited with %s (crash %d in a row); restart in %.1f s", child.name,
                        code, streak, delay)  # fmt: skip
            await asyncio.sleep(delay)
            if self._stopping:
                return
            try:
                await self._spawn(child)
            except DeployError as exc:
                # Not ready in time, or exited first: make sure it is gone, so the next
                # round of the loop counts it as a crash and backs off further.
                log.error("%s", exc)
                await self._terminate(child)

    async def wait(self) -> str:
        """Block until supervision itself fails (a crashed child is restarted); return why."""
        while self.failed is None:
            await asyncio.sleep(0.2)
        return self.failed

    # --- stop ----------------------------------------------------------------------

    async def stop(self) -> None:
        """Gateway first, then SIGTERM every child, SIGKILL after the grace period."""
        self._stopping = True
        for task in self._watchers:
            task.cancel()
        if self.gateway is not None:
            await self.gateway.stop()
        for control in self.controls:
            await control.stop()
        for proxy in self.proxies:
            await proxy.stop()
        await asyncio.gather(*(self._terminate(c) for c in self.children))
        if self.engines is not None:
            self.engines.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    async def _terminate(self, child: Child) -> None:
        proc = child.proc
        if proc is None or proc.returncode is not None:
            if proc is not None and self.engines is not None:
                await self._reap_engine(child, proc.pid)
            return
        # Signalled by pid, not with proc.send_signal()/kill(): those poll with waitpid()
        # first and can reap a child that just died before asyncio's child watcher does,
        # which then reports exit code 255 instead of the real one (say -9). Until the
        # watcher reaps it the pid cannot have been reused.
        _signal_pid(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), self.cfg.supervisor.shutdown_grace_s + 2)
        except TimeoutError:
            _signal_pid(proc.pid, signal.SIGKILL)
            await proc.wait()
        if self.engines is not None:  # an engine's own children (its engine core, workers)
            await self._reap_engine(child, proc.pid)

    async def _reap_engine(self, child: Child, pgid: int) -> None:
        """An engine instance's process group killed to its last process, and what those
        processes left in /dev/shm removed."""
        from pdx.serving.engines.vllm import group_gone, kill_group

        kill_group(pgid)
        if await group_gone(pgid, REAP_WAIT_S):
            await self.engines.release_leftovers(child.name)


def _signal_pid(pid: int, sig: int) -> None:
    """``kill(pid, sig)``; a process already gone is not an error."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _tokenizer(cfg: DeployConfig) -> Any:
    """The checkpoint's own tokenizer (no weights loaded), else byte-level."""
    from pdx.serving.backends.tokenizer import ByteTokenizer, HFTokenizer

    try:
        from transformers import AutoTokenizer

        return HFTokenizer(
            AutoTokenizer.from_pretrained(cfg.model.checkpoint, local_files_only=True)
        )
    except (OSError, ValueError):
        return ByteTokenizer()


def _tail(path: Path | None, lines: int = 3) -> str:
    if path is None or not path.exists():
        return "(no log)"
    text = path.read_text(errors="replace").strip().splitlines()
    return " | ".join(text[-lines:]) or "(empty log)"


async def serve_forever(
    cfg: DeployConfig, on_ready: Callable[[Endpoints], None], role: str = "all"
) -> str:
    """``pdx deploy``: start, report, supervise until SIGINT/SIGTERM or a failure; stop cleanly."""
    dep = Deployment(cfg, role=role)
    endpoints = await dep.start()
    on_ready(endpoints)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    failed = asyncio.create_task(dep.wait())
    stopped = asyncio.create_task(stop.wait())
    t0 = time.monotonic()
    done, _ = await asyncio.wait({failed, stopped}, return_when=asyncio.FIRST_COMPLETED)
    for task in (failed, stopped):
        task.cancel()
    await dep.stop()
    if failed in done:
        raise DeployError(dep.failed or "a child failed")
    return f"stopped cleanly after {time.monotonic() - t0:.1f} s of service"
