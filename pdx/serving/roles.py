"""``pdx deploy --role``: one site's part of a deployment, the others found by address.

``all`` (the default) runs the whole pair on one machine. ``prefill`` runs only the prefill
instances (each with its KV store), ``decode`` only the decode instances, ``gateway`` only
the gateway (and, with ``kv.via_proxy``, the KV fault proxies; they sit on decode's side, so
that role then runs on decode's host). A split role cannot learn the others' ports from their
start-up lines, so every address is configured: instance ``i`` of prefill listens on
``prefill.host:prefill.port+i`` (its KV store on ``prefill.kv_port+i``), of decode on
``decode.host:decode.port+i``; the host is both the address a role binds and the one the
others dial. Mutual TLS, when on, needs ``tls.dir``: one set made by ``pdx certs init DIR
--host A --host B`` and copied to every host (the CA key stays in ``DIR.ca-key``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from pdx.errors import InputError, ServingError
from pdx.serving.deploy_config import DeployConfig
from pdx.serving.kv_settings import dialable

ROLES = ("all", "prefill", "decode", "gateway")
# What each role starts: its child processes, and whether the gateway runs in it.
CHILD_ROLES = {"all": ("prefill", "decode"), "prefill": ("prefill",), "decode": ("decode",),
               "gateway": ()}  # fmt: skip


def check_role(cfg: DeployConfig, role: str) -> None:
    """Refuse a role that cannot find its peers: the first field in the way, and why."""
    if role not in ROLES:
        raise InputError("--role", role, "one of " + ", ".join(ROLES))
    if role == "all":
        return
    if cfg.engine != "pdx":
        raise InputError(
            "--role", role, "engine: pdx (for vLLM start each site's instances there and front "
            "them from the gateway's host with vllm.prefill_urls / vllm.decode_urls)",
        )  # fmt: skip
    needs = {
        "prefill": [("prefill.port", cfg.prefill.port), ("prefill.kv_port", cfg.prefill.kv_port)],
        "decode": [("decode.port", cfg.decode.port)],
        "gateway": [("prefill.port", cfg.prefill.port), ("prefill.kv_port", cfg.prefill.kv_port),
                    ("decode.port", cfg.decode.port)],
    }[role]  # fmt: skip
    for name, value in needs:
        if value == 0:
            raise InputError(
                name, value, f"a fixed port (--role {role}: the other hosts dial it; 0 = "
                "ephemeral is only known inside one `pdx deploy`)",
            )  # fmt: skip
    if role == "prefill" and cfg.prefill.count == 0:
        raise InputError("prefill.count", 0, "at least 1 for --role prefill")
    if cfg.tls.enabled and cfg.tls.dir is None:
        raise InputError(
            "tls.dir", None, f"a certificate directory for --role {role} (every host needs the "
            "same CA: `pdx certs init DIR --host A --host B`, then copy DIR to each host), or "
            "tls.enabled=false",
        )  # fmt: skip


@dataclass(frozen=True)
class Remote:
    """An instance another host runs, as this one dials it."""

    role: str
    index: int
    host: str
    port: int
    kv_port: int = 0

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def address(self) -> str:
        return f"{dialable(self.host)}:{self.port}"

    @property
    def kv_endpoint(self) -> str:
        """The KV store's address as its prefill advertises it (bind host, no override)."""
        return f"{dialable(self.host)}:{self.kv_port}"

    def row(self) -> dict[str, Any]:
        """Its line in ``pdx deploy --json`` (started elsewhere: no pid)."""
        row: dict[str, Any] = {"name": self.name, "pid": None, "host": self.host,
                               "port": self.port, "remote": True}  # fmt: skip
        if self.role == "prefill":
            row["kv_port"], row["kv_endpoint"] = self.kv_port, self.kv_endpoint
        return row


def remotes(cfg: DeployConfig, role: str) -> list[Remote]:
    """The configured instances of ``role`` (``prefill`` or ``decode``)."""
    if role == "prefill":
        pc = cfg.prefill
        return [Remote("prefill", i, pc.host, pc.port + i, pc.kv_port + i)
                for i in range(pc.count)]  # fmt: skip
    dc = cfg.decode
    return [Remote("decode", i, dc.host, dc.port + i) for i in range(dc.count)]


async def decode_model_info(cfg: DeployConfig, tls: Any, decode: Remote) -> dict[str, Any]:
    """What the gateway learns from a decode it did not start (its Status call), waiting up to
    ``supervisor.ready_timeout_s`` for it to answer."""
    import grpc

    from pdx._proto import serving_pb2, serving_pb2_grpc
    from pdx.serving.rpc import channel

    timeout = cfg.supervisor.ready_timeout_s
    t0, last = time.monotonic(), "no answer"
    async with channel(decode.address, tls) as ch:
        stub = serving_pb2_grpc.DecodeStub(ch)
        while time.monotonic() - t0 < timeout:
            try:
                st = await stub.Status(serving_pb2.DecodeStatusRequest(), timeout=2.0)
            except grpc.aio.AioRpcError as exc:
                last = f"{exc.code().name}: {exc.details()}"
                await asyncio.sleep(0.5)
                continue
            return {
                "model": cfg.model.checkpoint or cfg.model.preset,
                "model_version": st.model_version,
                "synthetic": cfg.model.backend == "synthetic",
                "max_context_tokens": int(st.max_context_tokens) or 1024,
            }
    raise ServingError(
        f"{decode.name} at {decode.address} did not answer within {timeout:g} s "
        f"(supervisor.ready_timeout_s; last: {last})"
    )
