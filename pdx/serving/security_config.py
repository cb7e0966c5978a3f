"""``security:`` of the deploy config: whether traffic between the sites may cross unencrypted.

A deployment crosses sites when prefill and decode are in different network namespaces, or
either listens on (or is dialled at) an address other than loopback. It is plaintext across
them when pdx's own pair runs with ``tls.enabled: false``, or with ``engine: vllm``, whose
prefill call (HTTP) and KV pulls (NIXL over UCX/TCP) pdx does not encrypt. Such a deployment is
refused unless ``security.allow_plaintext: true`` says it is meant.
"""

from __future__ import annotations

import ipaddress
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field


class SecurityConfig(BaseModel):
    """The deploy config's ``security:``."""

    model_config = ConfigDict(extra="forbid")
    allow_plaintext: bool = Field(
        False,
        description="let traffic between the sites cross unencrypted (tls.enabled: false, or "
        "engine: vllm, whose prefill call and KV pulls pdx does not encrypt); pdx accept's "
        "headline then says PLAINTEXT",
    )


def _remote(host: str) -> bool:
    if host in ("localhost", ""):
        return False
    try:
        return not ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return True  # a name other than localhost: another host


def across_sites(cfg: Any) -> str | None:
    """Where the deployment (a DeployConfig) leaves this host or namespace, in words; None
    when everything is on one host's loopback."""
    if cfg.prefill.netns != cfg.decode.netns:
        return f"prefill.netns {cfg.prefill.netns!r} and decode.netns {cfg.decode.netns!r} differ"
    hosts = [("prefill.host", cfg.prefill.host), ("decode.host", cfg.decode.host)]
    if cfg.engine == "vllm":
        hosts += [("vllm.prefill_urls", urlsplit(u).hostname or "") for u in cfg.vllm.prefill_urls]
    for key, host in hosts:
        if _remote(host):
            return f"{key} is {host}"
    return None


def plaintext_refusal(cfg: Any) -> str | None:
    """Why the deployment may not run as configured (plaintext across sites, not allowed)."""
    if cfg.security.allow_plaintext or cfg.prefill.count == 0:
        return None
    why = across_sites(cfg)
    if why is None:
        return None
    if cfg.engine == "vllm":
        plain = (
            "engine: vllm sends the prefill call and the KV across them unencrypted (pdx does "
            "not encrypt that path yet)"
        )
    elif not cfg.tls.enabled:
        plain = "tls.enabled: false sends the gRPC calls and the KV across them unencrypted"
    else:
        return None
    return (
        f"security.allow_plaintext: the sites are apart ({why}) and {plain}; set "
        "security.allow_plaintext: true to run it anyway"
        + ("" if cfg.engine == "vllm" else ", or keep TLS on (tls.dir)")
    )
