"""Two datacenters on one box: prefill and decode namespaces joined through a router namespace.

::

    <prefix>-prefill            <prefix>-router                 <prefix>-decode
    eth-router 10.77.1.1/24 ── eth-prefill 10.77.1.254/24
                               eth-decode  10.77.2.254/24 ── eth-router 10.77.2.1/24

The router forwards between the two sites. On both of its interfaces a ``tbf`` qdisc caps the
rate (``rate_mbit``), and an nft ``numgen random`` rule drops forwarded packets with
``loss`` probability, so drops happen on a forwarding hop, as in a real network. Every address
lives inside these namespaces only. ``up`` is idempotent (it reconfigures what exists).
Driving ``ip``/``tc``/``nft`` is pdx-specific glue, so it is written here by hand.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from pdx.config import build_config
from pdx.errors import PdxError

SUBNET_PREFILL = "10.77.1"
SUBNET_DECODE = "10.77.2"
NFT_TABLE = "pdx_faults"
LOSS_SCALE = 1_000_000


class NetnsError(PdxError):
    """A namespace operation failed or is not permitted here."""


class NetnsConfig(BaseModel):
    """Shape of the two-site network."""

    model_config = ConfigDict(extra="forbid")
    prefix: str = Field(default="pdx", pattern=r"^[a-z][a-z0-9]{0,11}$")
    rate_mbit: Annotated[float, Field(gt=0, le=100_000, allow_inf_nan=False)] = 1000.0
    loss: Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)] = 0.0
    mtu: Annotated[int, Field(ge=576, le=9000)] = 1500
    tbf_latency_ms: Annotated[float, Field(gt=0, le=10_000, allow_inf_nan=False)] = 50.0

    @property
    def prefill(self) -> str:
        """Prefill site namespace."""
        return f"{self.prefix}-prefill"

    @property
    def router(self) -> str:
        """Router namespace between the sites."""
        return f"{self.prefix}-router"

    @property
    def decode(self) -> str:
        """Decode site namespace."""
        return f"{self.prefix}-decode"

    @property
    def namespaces(self) -> list[str]:
        """All three, in path order."""
        return [self.prefill, self.router, self.decode]


def make_config(**values: Any) -> NetnsConfig:
    """Validate options into a :class:`NetnsConfig` (one line per bad field)."""
    return build_config(
        NetnsConfig, source="netns", base={k: v for k, v in values.items() if v is not None}
    )


def _require_root() -> None:
    if os.geteuid() != 0:
        raise NetnsError(
            "pdx faults netns needs root (CAP_NET_ADMIN) to create network namespaces; "
            "run it as root or with sudo"
        )
    for tool in ("ip", "tc", "nft"):
        if shutil.which(tool) is None:
            raise NetnsError(f"'{tool}' not found; install iproute2 and nftables")


def _run(args: list[str], *, stdin: str | None = None, check: bool = True) -> str:
    proc = subprocess.run(args, input=stdin, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        why = (proc.stderr or proc.stdout).strip().splitlines()
        raise NetnsError(f"{' '.join(args)} failed: {why[-1] if why else proc.returncode}")
    return proc.stdout


def existing_namespaces() -> set[str]:
    """Names from ``ip netns list``."""
    out = _run(["ip", "netns", "list"], check=False)
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _link_exists(ns: str, dev: str) -> bool:
    out = subprocess.run(["ip", "-n", ns, "link", "show", dev], capture_output=True, check=False)
    return out.returncode == 0


def _veth(ns_a: str, dev_a: str, ns_b: str, dev_b: str) -> None:
    if _link_exists(ns_a, dev_a) and _link_exists(ns_b, dev_b):
        return
    if _link_exists(ns_a, dev_a):
        _run(["ip", "-n", ns_a, "link", "del", dev_a])
    veth = ["type", "veth", "peer", "name", dev_b, "netns", ns_b]
    _run(["ip", "link", "add", dev_a, "netns", ns_a, *veth])


def _iface(ns: str, dev: str, cidr: str, mtu: int) -> None:
    _run(["ip", "-n", ns, "addr", "replace", cidr, "dev", dev])
    _run(["ip", "-n", ns, "link", "set", "dev", dev, "mtu", str(mtu), "up"])


def _tbf(cfg: NetnsConfig, dev: str) -> None:
    rate_bytes_s = cfg.rate_mbit * 1e6 / 8
    burst = max(cfg.mtu * 4, int(rate_bytes_s / 250))  # at least 4 ms of traffic at rate
    shape = ["rate", f"{cfg.rate_mbit}mbit", "burst", str(burst)]
    shape += ["latency", f"{cfg.tbf_latency_ms}ms"]
    _run(["tc", "-n", cfg.router, "qdisc", "replace", "dev", dev, "root", "tbf", *shape])


def _nft(cfg: NetnsConfig) -> None:
    script = f"table inet {NFT_TABLE}\ndelete table inet {NFT_TABLE}\n"
    if cfg.loss > 0:
        threshold = round(cfg.loss * LOSS_SCALE)
        script += (
            f"table inet {NFT_TABLE} {{\n  chain forward {{\n"
            "    type filter hook forward priority 0; policy accept;\n"
            f"    numgen random mod {LOSS_SCALE} < {threshold} counter drop\n  }}\n}}\n"
        )
    _run(["ip", "netns", "exec", cfg.router, "nft", "-f", "-"], stdin=script)


def up(cfg: NetnsConfig) -> dict[str, Any]:
    """Create or reconfigure the namespaces, links, shaping and loss; returns :func:`status`."""
    _require_root()
    have = existing_namespaces()
    for ns in cfg.namespaces:
        if ns not in have:
            _run(["ip", "netns", "add", ns])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
    _veth(cfg.prefill, "eth-router", cfg.router, "eth-prefill")
    _veth(cfg.decode, "eth-router", cfg.router, "eth-decode")
    _iface(cfg.prefill, "eth-router", f"{SUBNET_PREFILL}.1/24", cfg.mtu)
    _iface(cfg.router, "eth-prefill", f"{SUBNET_PREFILL}.254/24", cfg.mtu)
    _iface(cfg.router, "eth-decode", f"{SUBNET_DECODE}.254/24", cfg.mtu)
    _iface(cfg.decode, "eth-router", f"{SUBNET_DECODE}.1/24", cfg.mtu)
    _run(["ip", "-n", cfg.prefill, "route", "replace", "default", "via", f"{SUBNET_PREFILL}.254"])
    _run(["ip", "-n", cfg.decode, "route", "replace", "default", "via", f"{SUBNET_DECODE}.254"])
    _run(["ip", "netns", "exec", cfg.router, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
    _tbf(cfg, "eth-prefill")
    _tbf(cfg, "eth-decode")
    _nft(cfg)
    return status(cfg)


def down(cfg: NetnsConfig) -> dict[str, Any]:
    """Delete the namespaces (their veths go with them); a no-op when absent."""
    _require_root()
    have = existing_namespaces()
    removed = []
    for ns in cfg.namespaces:
        if ns in have:
            _run(["ip", "netns", "del", ns])
            removed.append(ns)
    return {"removed": removed, "namespaces": {ns: False for ns in cfg.namespaces}}


def status(cfg: NetnsConfig) -> dict[str, Any]:
    """What exists now: namespaces, addresses, qdiscs and the loss rule with its drop counter."""
    _require_root()
    have = existing_namespaces()
    data: dict[str, Any] = {
        "namespaces": {ns: ns in have for ns in cfg.namespaces},
        "addresses": {},
        "qdiscs": {},
        "nft": None,
        "prefill_addr": f"{SUBNET_PREFILL}.1",
        "decode_addr": f"{SUBNET_DECODE}.1",
    }
    for ns in cfg.namespaces:
        if ns in have:
            out = _run(["ip", "-n", ns, "-br", "addr", "show"], check=False)
            data["addresses"][ns] = [line.split() for line in out.splitlines() if line.strip()]
    if cfg.router in have:
        for dev in ("eth-prefill", "eth-decode"):
            out = _run(["tc", "-n", cfg.router, "qdisc", "show", "dev", dev], check=False)
            data["qdiscs"][dev] = out.strip()
        nft = _run(
            ["ip", "netns", "exec", cfg.router, "nft", "list", "table", "inet", NFT_TABLE],
            check=False,
        )
        data["nft"] = nft.strip() or None
    data["up"] = all(data["namespaces"].values())
    return data
