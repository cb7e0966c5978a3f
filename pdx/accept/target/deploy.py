"""Starting the pair under test with ``pdx deploy``, with a fault proxy on its KV link if asked."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdx.accept.playbook import Target
from pdx.accept.target.process import DeployProcess, wait_ready
from pdx.errors import InputError, MeasurementError, PdxError

if TYPE_CHECKING:
    from pdx.accept.target.netns import Topology


@dataclass
class StartedDeploy:
    """A ready deploy: its process, gateway URL, the KV-link proxy (if any) and report info."""

    process: DeployProcess
    url: str
    proxy: Any = None
    info: dict[str, Any] = field(default_factory=dict)


def deploy_args(target: Target, playbook_dir: Path, port: int) -> list[str]:
    """``pdx deploy`` arguments: config (unless the embedded default), port, overrides."""
    args = ["--port", str(port)]
    if target.deploy not in (None, "default"):
        path = Path(str(target.deploy))
        path = path if path.is_absolute() else playbook_dir / path
        if not path.is_file():
            raise InputError("target.deploy", str(path), "'default' or an existing deploy YAML")
        args += ["--config", str(path)]
    for item in target.deploy_set:
        args += ["--set", item]
    return args


async def _endpoints(out_path: Path, proc: Any, timeout_s: float) -> dict[str, Any]:
    """The endpoints JSON ``pdx deploy --json`` prints once every process is up."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.returncode is not None:
            raise MeasurementError(
                f"pdx deploy exited with code {proc.returncode} before ready; see {out_path.parent}"
            )
        try:
            data: dict[str, Any] = json.loads(out_path.read_text())
            return data
        except (OSError, ValueError):
            await asyncio.sleep(0.2)
    raise MeasurementError(f"pdx deploy not ready after {timeout_s:g} s; see {out_path.parent}")


async def start_deploy(
    target: Target,
    *,
    playbook_dir: Path,
    raw_dir: Path,
    needs_proxy: bool,
    on_process: Callable[[DeployProcess], None],
    topology: Topology | None = None,
) -> StartedDeploy:
    """Start ``pdx deploy`` (ephemeral gateway port), read its endpoints, wait for readiness.

    Relative deploy paths are read from ``playbook_dir``; the deploy's log and endpoints JSON
    go to ``raw_dir``. ``on_process`` gets the process before it starts, so the caller can
    stop it whatever happens next. With network conditions to apply, ``kv.via_proxy=true``
    makes the deploy put a fault proxy on every prefill's KV endpoint; pdx drives it through
    the proxy's control API. With a namespace ``topology`` the deploy runs in the decode site
    and prefill in the prefill site.
    """
    from pdx.faults.client import ControlClient

    args = [*deploy_args(target, playbook_dir, 0), "--json"]
    prefix: list[str] = []
    across: str | None = None  # what protects the traffic between the sites
    if topology is not None:
        across = _across_sites(target, playbook_dir)
        for item in topology.deploy_overrides(via_proxy=needs_proxy, tls=across == TLS_ACROSS):
            args += ["--set", item]
        prefix = topology.command_prefix()
    elif needs_proxy:
        args += ["--set", "kv.via_proxy=true"]
    out_path = raw_dir / "deploy-endpoints.json"
    proc = DeployProcess(args, raw_dir / "deploy.log", stdout_path=out_path, prefix=prefix)
    on_process(proc)
    popen = await proc.start()
    endpoints = await _endpoints(out_path, popen, target.ready_timeout_s)
    url = str(endpoints["gateway"]).rstrip("/")
    waited = await wait_ready(url + target.ready_path, target.ready_timeout_s, popen)
    proxies = endpoints.get("proxies") or []
    if needs_proxy and not proxies:
        raise MeasurementError("pdx deploy started no KV-link proxy (kv.via_proxy)")
    client = (
        ControlClient(proxies[0]["control"], token=proxies[0].get("control_token"))
        if proxies
        else None
    )
    info = {
        "kind": "deploy",
        "deploy": target.deploy,
        "url": url,
        "ready_after_s": round(waited, 2),
        "deploy_args": args,
        "model": endpoints.get("model", {}),
        "kv_proxies": proxies,
        "kv_store": _kv_store(endpoints),
    }
    if topology is not None:
        info["netns"] = {"prefill": topology.prefill_ns, "decode": topology.decode_ns,
                         "router": topology.cfg.router, "across_sites": across}  # fmt: skip
    return StartedDeploy(proc, url, client, info)


TLS_ACROSS = "mutual TLS 1.3"


def _across_sites(target: Target, playbook_dir: Path) -> str:
    """What protects the traffic between the two sites of a namespace run: pdx's pair keeps
    its mutual TLS (with certificates for the sites' addresses) unless the deploy turned TLS
    off; vLLM's HTTP and NIXL traffic is not encrypted."""
    from pdx.accept.preflight.kv import deploy_config

    try:
        cfg = deploy_config(target, playbook_dir)
    except PdxError:  # pdx deploy itself refuses it, and says why, next
        return TLS_ACROSS
    if cfg.engine == "vllm":
        return "plaintext (engine: vllm: the prefill call and NIXL's pulls are not encrypted)"
    if not cfg.tls.enabled:
        return "plaintext (the deploy's tls.enabled: false)"
    return TLS_ACROSS


def _kv_store(endpoints: dict[str, Any]) -> str | None:
    """``host:port`` of the first prefill's KV store (where the KV link ends)."""
    prefill = endpoints.get("prefill") or []
    return str(prefill[0].get("kv_endpoint")) if prefill and prefill[0].get("kv_endpoint") else None
