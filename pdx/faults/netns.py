"""Two datacenters on one box: prefill and decode namespaces joined through a router namespace.

::

    <prefix>-prefill            <prefix>-router                 <prefix>-decode
    eth-router 10.77.1.1/24 ── eth-prefill 10.77.1.254/24
                               eth-decode  10.77.2.254/24 ── eth-router 10.77.2.1/24

The router forwards between the two sites. Its egress toward each site has a ``tbf``
(``rate_mbit``, a bottleneck queue of ``queue_ms``). Packet-level conditions (delay, normal
jitter, random or Gilbert loss, reordering, duplication, a cut) act on every wire packet in
each direction (``down`` = prefill → decode, ``up`` = decode → prefill) and are applied by
an emulator: the kernel's ``netem`` where it exists, else pdx's userspace delay line
(:mod:`pdx.faults.wan.emulator`), to which the router's policy routes hand every forwarded
packet. ``up`` is declarative and idempotent: run it again with other conditions and they
change live, established connections carrying on. Every address lives inside these
namespaces only. Driving ``ip``/``tc`` is pdx-specific glue, so it is written here by hand.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pdx.config import build_config
from pdx.errors import PdxError
from pdx.faults.wan import control, netem
from pdx.faults.wan.conditions import DIRECTIONS, LinkConditions, WanConditions, make_conditions

SUBNET_PREFILL = "10.77.1"
SUBNET_DECODE = "10.77.2"
NFT_TABLE = "pdx_faults"  # removed if an older pdx left it
# The router's egress device toward each direction's destination, and the arrival device.
EGRESS = {"down": "eth-decode", "up": "eth-prefill"}
INGRESS = {"down": "eth-prefill", "up": "eth-decode"}
RULE_PREF = {"down": 1001, "up": 1002}
_TBF_STATS = re.compile(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+)")
# Options of `make_config` that set the same condition on both directions.
SYMMETRIC = ("delay_ms", "jitter_ms", "loss", "loss_model", "loss_burst", "reorder",
             "duplicate", "rate_mbit", "queue_ms")  # fmt: skip


class NetnsError(PdxError):
    """A namespace operation failed or is not permitted here."""


class NetnsConfig(BaseModel):
    """Shape of the two-site network and the conditions of its router hop."""

    model_config = ConfigDict(extra="forbid")
    prefix: str = Field(default="pdx", pattern=r"^[a-z][a-z0-9]{0,11}$")
    mtu: Annotated[int, Field(ge=576, le=9000)] = 1500
    emulator: Literal["auto", "netem", "userspace"] = "auto"
    wan: WanConditions = Field(default_factory=WanConditions)

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

    @property
    def rate_mbit(self) -> float:
        """The prefill → decode rate cap (``down``)."""
        return self.wan.down.rate_mbit

    @property
    def loss(self) -> float:
        """The prefill → decode per-packet loss (``down``)."""
        return self.wan.down.loss

    @property
    def state_dir(self) -> Path:
        """Where the emulator of this topology keeps its state."""
        return control.state_dir(self.prefix)

    def with_conditions(self, wan: WanConditions) -> NetnsConfig:
        """The same topology with other conditions."""
        return self.model_copy(update={"wan": wan})


def make_config(
    *,
    prefix: str | None = None,
    mtu: int | None = None,
    emulator: str | None = None,
    tbf_latency_ms: float | None = None,
    up: dict[str, Any] | None = None,
    down: dict[str, Any] | None = None,
    cut: bool = False,
    seed: int | None = None,
    **both: Any,
) -> NetnsConfig:
    """Validate options into a :class:`NetnsConfig` (one line per bad field).

    ``both`` holds conditions for both directions (``delay_ms``, ``loss``, ``rate_mbit``, ...,
    see :data:`SYMMETRIC`); ``up`` / ``down`` override them per direction. ``tbf_latency_ms``
    is the older name of ``queue_ms``.
    """
    unknown = sorted(set(both) - set(SYMMETRIC))
    if unknown:
        raise NetnsError(f"unknown netns option(s) {unknown}; known: {', '.join(SYMMETRIC)}")
    if tbf_latency_ms is not None and both.get("queue_ms") is None:
        both["queue_ms"] = tbf_latency_ms
    wan = make_conditions(both, down, up, cut=cut, seed=seed)
    base = {"prefix": prefix, "mtu": mtu, "emulator": emulator}
    cfg = build_config(NetnsConfig, source="netns", base={k: v for k, v in base.items() if v})
    return cfg.with_conditions(wan)


def _require_root() -> None:
    if os.geteuid() != 0:
        raise NetnsError(
            "pdx faults netns needs root (CAP_NET_ADMIN) to create network namespaces; "
            "run it as root or with sudo"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetnsError(f"'{tool}' not found; install iproute2")


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


def _tbf(cfg: NetnsConfig, dev: str, c: LinkConditions) -> None:
    rate_bytes_s = c.rate_mbit * 1e6 / 8
    burst = max(cfg.mtu * 4, int(rate_bytes_s / 250))  # at least 4 ms of traffic at rate
    shape = ["rate", f"{c.rate_mbit}mbit", "burst", str(burst), "latency", f"{c.queue_ms}ms"]
    _run(["tc", "-n", cfg.router, "qdisc", "replace", "dev", dev, "root", "tbf", *shape])


def _drop_legacy_nft(cfg: NetnsConfig) -> None:
    if shutil.which("nft") is None:
        return
    script = f"table inet {NFT_TABLE}\ndelete table inet {NFT_TABLE}\n"
    _run(["ip", "netns", "exec", cfg.router, "nft", "-f", "-"], stdin=script, check=False)


def _sysctl(ns: str, key: str, value: str) -> None:
    _run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}={value}"])


def _gso_segments(cfg: NetnsConfig, segs: int) -> None:
    """Aggregate size the sites' veths send (1 = every frame alone, for netem per packet)."""
    for ns in (cfg.prefill, cfg.decode):
        _run(["ip", "-n", ns, "link", "set", "dev", "eth-router", "gso_max_segs", str(segs)])


def resolve_emulator(cfg: NetnsConfig) -> str:
    """``netem`` or ``userspace`` for this config on this kernel (``auto`` prefers netem)."""
    if cfg.emulator == "userspace":
        return "userspace"
    has = netem.available(cfg.router)
    if cfg.emulator == "netem" and not has:
        raise NetnsError(
            "--emulator netem: this kernel has no sch_netem (tc: 'Specified qdisc kind is "
            "unknown'); use --emulator userspace or auto"
        )
    return "netem" if has else "userspace"


def _topology(cfg: NetnsConfig) -> None:
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
    _sysctl(cfg.router, "net.ipv4.ip_forward", "1")
    # Packets come back out of the TUN devices with the other site's source address.
    _sysctl(cfg.router, "net.ipv4.conf.all.rp_filter", "0")
    _sysctl(cfg.router, "net.ipv4.conf.default.rp_filter", "0")


def _rules(cfg: NetnsConfig, on: bool) -> None:
    """Policy routes sending each direction through its TUN device (blackhole if it is gone)."""
    for d in DIRECTIONS:
        table, pref = str(control_table(d)), str(RULE_PREF[d])
        _run(["ip", "-n", cfg.router, "rule", "del", "pref", pref], check=False)
        if on:
            _run(["ip", "-n", cfg.router, "route", "replace", "blackhole", "default",
                  "metric", "4000", "table", table])  # fmt: skip
            _run(["ip", "-n", cfg.router, "rule", "add", "iif", INGRESS[d], "lookup", table,
                  "pref", pref])  # fmt: skip


def control_table(direction: str) -> int:
    """The router's routing table for one direction (shared with the emulator)."""
    return control.TABLES[direction]


def _rules_present(cfg: NetnsConfig) -> bool:
    out = _run(["ip", "-n", cfg.router, "rule", "show"], check=False)
    return any(f"lookup {control_table(d)}" in out for d in DIRECTIONS)


def _save_mode(cfg: NetnsConfig, mode: str) -> None:
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    data = {"mode": mode, "config": cfg.model_dump(mode="json")}
    (cfg.state_dir / "netns.json").write_text(json.dumps(data))


def saved(prefix: str) -> dict[str, Any] | None:
    """What the last ``up`` of this prefix set (mode and config), if anything."""
    try:
        data: dict[str, Any] = json.loads((control.state_dir(prefix) / "netns.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data


def _apply_userspace(cfg: NetnsConfig) -> None:
    sdir = cfg.state_dir
    if control.running(sdir):
        control.configure(sdir, cfg.wan)
    else:
        control.stop(sdir)  # a supervisor that gave up, or a stale one
        control.start(cfg.router, sdir, cfg.wan)
    _rules(cfg, on=True)


def _apply_netem(cfg: NetnsConfig) -> None:
    per_packet = any(netem.per_packet(getattr(cfg.wan, d)) for d in DIRECTIONS)
    _gso_segments(cfg, 1 if per_packet else 65535)
    for d in DIRECTIONS:
        c = getattr(cfg.wan, d)
        if cfg.wan.cut:
            c = c.model_copy(update={"loss": 1.0, "loss_model": "random"})
        cmd = ["tc", "-n", cfg.router, "qdisc", "replace", "dev", EGRESS[d], "root", "netem"]
        _run([*cmd, *netem.args(c, cfg.mtu)])


def up(cfg: NetnsConfig) -> dict[str, Any]:
    """Create or reconfigure namespaces, links, shaping and conditions; returns :func:`status`."""
    _require_root()
    _topology(cfg)
    _drop_legacy_nft(cfg)
    mode = resolve_emulator(cfg) if cfg.wan.needs_delay_line else "none"
    previous = (saved(cfg.prefix) or {}).get("mode")
    if mode != "userspace":
        _rules(cfg, on=False)  # direct forwarding first, then the emulator may go
        control.stop(cfg.state_dir)
    if previous == "netem" and mode != "netem":
        _gso_segments(cfg, 65535)
    if mode == "netem":
        _apply_netem(cfg)
    elif mode == "userspace":
        # The emulator is the bottleneck too (rate, queue, tail drop per wire packet): a
        # tbf would drop whole 64 KB aggregates when its queue overflows.
        _apply_userspace(cfg)
        for dev in EGRESS.values():
            _run(["tc", "-n", cfg.router, "qdisc", "del", "dev", dev, "root"], check=False)
    else:
        for d in DIRECTIONS:
            _tbf(cfg, EGRESS[d], getattr(cfg.wan, d))
    _save_mode(cfg, mode)
    return status(cfg)


def current(prefix: str) -> NetnsConfig:
    """The config the last ``up`` of ``prefix`` applied."""
    last = saved(prefix)
    if last is None:
        raise NetnsError(f"no topology {prefix!r} is up here; run `pdx faults netns up` first")
    return NetnsConfig.model_validate(last["config"])


def set_conditions(prefix: str, wan: WanConditions) -> dict[str, Any]:
    """Change the conditions of a topology that is up, keeping its shape and emulator choice.

    With the userspace emulator already running this is one control request (milliseconds,
    for timelines); otherwise it is a full :func:`up`.
    """
    cfg = current(prefix).with_conditions(wan)
    live = (saved(prefix) or {}).get("mode") == "userspace" and wan.needs_delay_line
    if live and control.running(cfg.state_dir):
        control.configure(cfg.state_dir, wan)
        _save_mode(cfg, "userspace")
        return {"conditions": wan.model_dump(mode="json"), "emulator": "userspace"}
    return up(cfg)


def down(cfg: NetnsConfig) -> dict[str, Any]:
    """Stop the emulator and delete the namespaces (their veths go with them); no-op when absent."""
    _require_root()
    stopped = control.stop(cfg.state_dir)
    have = existing_namespaces()
    removed = []
    for ns in cfg.namespaces:
        if ns in have:
            _run(["ip", "netns", "del", ns])
            removed.append(ns)
    shutil.rmtree(cfg.state_dir, ignore_errors=True)
    return {"removed": removed, "emulator_stopped": stopped,
            "namespaces": {ns: False for ns in cfg.namespaces}}  # fmt: skip


def _tbf_counters(text: str) -> dict[str, int]:
    """A tbf's counters (its ``packets`` are skbs: a 64 KB aggregate counts once)."""
    m = _TBF_STATS.search(text)
    if not m:
        return {}
    keys = ("bytes_out", "skbs_out", "dropped_queue", "overlimits")
    return {k: int(v) for k, v in zip(keys, m.groups(), strict=True)}


def wan_status(cfg: NetnsConfig) -> dict[str, Any]:
    """Which emulator applies which conditions, whether it runs, and its counters."""
    last = saved(cfg.prefix)
    mode = (last or {}).get("mode", "none")
    conditions = (last or {}).get("config", {}).get("wan")
    out: dict[str, Any] = {"emulator": mode, "conditions": conditions, "running": None,
                           "traffic": "forwarded directly (no packet-level conditions)",
                           "counters": {}, "queue_drops": {}}  # fmt: skip
    for d in DIRECTIONS:
        text = _run(["tc", "-s", "-n", cfg.router, "qdisc", "show", "dev", EGRESS[d]], check=False)
        qd = netem.counters(text) if mode == "netem" else _tbf_counters(text)
        if mode != "userspace":
            out["queue_drops"][d] = qd.get("dropped", 0)
            out["counters"][d] = qd
    if mode == "netem":
        out["running"] = True
        out["traffic"] = "through netem on the router"
    if mode == "userspace":
        sup = control.supervisor_state(cfg.state_dir)
        out["supervisor"] = sup
        try:
            emu = control.request(cfg.state_dir, "status", timeout_s=2.0)
        except control.EmulatorError as exc:
            out["running"] = False
            routed = _rules_present(cfg)
            out["traffic"] = (
                "DROPPED: the emulator is not running and the router's routes end in a "
                "blackhole (run `pdx faults netns up` again)"
                if routed
                else "forwarded directly"
            )
            out["error"] = str(exc)
            out["log"] = control.log_tail(cfg.state_dir)
        else:
            out["running"] = True
            out["traffic"] = "through the userspace emulator"
            out["pid"] = emu["pid"]
            out["conditions"] = emu["conditions"]
            out["counters"] = emu["counters"]
            out["queue_drops"] = {d: c.get("dropped_queue", 0) for d, c in out["counters"].items()}
            if sup is not None:
                out["restarts"] = sup.get("restarts", 0)
    return out


def status(cfg: NetnsConfig) -> dict[str, Any]:
    """What exists now: namespaces, addresses, qdiscs, and the WAN emulation with its counters."""
    _require_root()
    have = existing_namespaces()
    data: dict[str, Any] = {
        "namespaces": {ns: ns in have for ns in cfg.namespaces},
        "addresses": {},
        "qdiscs": {},
        "prefill_addr": f"{SUBNET_PREFILL}.1",
        "decode_addr": f"{SUBNET_DECODE}.1",
    }
    for ns in cfg.namespaces:
        if ns in have:
            out = _run(["ip", "-n", ns, "-br", "addr", "show"], check=False)
            data["addresses"][ns] = [line.split() for line in out.splitlines() if line.strip()]
    data["up"] = all(data["namespaces"].values())
    if cfg.router in have:
        for dev in EGRESS.values():
            out = _run(["tc", "-n", cfg.router, "qdisc", "show", "dev", dev], check=False)
            data["qdiscs"][dev] = out.strip()
        with contextlib.suppress(NetnsError):
            data["wan"] = wan_status(cfg)
    return data
