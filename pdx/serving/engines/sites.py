"""Where an engine instance sits on the network: free ports and UCX's device, per namespace.

An instance placed in a network namespace (``prefill.netns``) listens on an address this
process may not hold (``10.77.1.1`` of the prefill site while ``pdx deploy`` runs in the
decode site), so its free ports are asked for inside that namespace. UCX, left to itself,
offers the peer every interface it finds (loopback and host links included) and may open the
KV connection on one the other site cannot route; :func:`ucx_net_device` names the one
interface an instance's KV traffic should use (``UCX_NET_DEVICES``).
"""

from __future__ import annotations

import ipaddress
import subprocess
import sys

from pdx.errors import ServingError
from pdx.netaddr import listen_ports

# Run inside the namespace: its ephemeral range and its free ports are its own.
_FREE_PORTS = (
    "import sys\n"
    "from pdx.netaddr import listen_ports\n"
    "print(*listen_ports(sys.argv[1], int(sys.argv[2])))\n"
)


class PlacementError(ServingError):
    """An instance's namespace or address cannot be used (the message says which)."""


def free_ports(host: str, count: int, netns: str | None = None) -> list[int]:
    """``count`` distinct ports free on ``host`` now, in ``netns`` when given, outside the
    kernel's ephemeral range (the instance binds them shortly after; see
    :func:`pdx.netaddr.listen_ports`)."""
    if not netns:
        return listen_ports(host, count)
    out = _ip_netns(netns, [sys.executable, "-c", _FREE_PORTS, host, str(count)])
    return [int(p) for p in out.split()]


def is_loopback(host: str) -> bool:
    """``127.x``, ``::1`` or ``localhost``."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def ucx_net_device(own_host: str, peer_host: str | None, netns: str | None) -> str | None:
    """The interface UCX should use (``UCX_NET_DEVICES``), or None to leave UCX's choice.

    The one holding ``own_host`` when that is a routable address (where the instance's NIXL
    side channel listens, so its KV too), else the one the route to ``peer_host`` leaves by;
    None when both are loopback (one box, one namespace: UCX's own choice works).
    """
    if own_host and not is_loopback(own_host) and own_host not in ("0.0.0.0", "::"):
        out = _ip(netns, ["-o", "addr", "show", "to", own_host])
        fields = out.split()
        if len(fields) > 1:
            return fields[1]
        raise PlacementError(f"no interface holds {own_host}" + (f" in {netns}" if netns else ""))
    if peer_host and not is_loopback(peer_host):
        fields = _ip(netns, ["route", "get", peer_host]).split()
        if "dev" in fields:
            return fields[fields.index("dev") + 1]
        raise PlacementError(f"no route to {peer_host}" + (f" from {netns}" if netns else ""))
    return None


def _ip(netns: str | None, args: list[str]) -> str:
    prefix = ["ip", "-n", netns] if netns else ["ip"]
    return _run([*prefix, *args])


def _ip_netns(netns: str, argv: list[str]) -> str:
    return _run(["ip", "netns", "exec", netns, *argv])


def _run(argv: list[str]) -> str:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PlacementError(f"{' '.join(argv[:4])} ...: {exc}") from None
    if proc.returncode != 0:
        raise PlacementError(f"{' '.join(argv[:5])} ... failed: {proc.stderr.strip()[-300:]}")
    return proc.stdout
