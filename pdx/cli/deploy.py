"""``pdx deploy``: start the prefill/decode pair and its gateway from one YAML, or render it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from pdx.cli.output import emit, err_console, to_jsonable
from pdx.errors import InputError

GATEWAY_PATHS = "(OpenAI API: /v1/completions, /v1/chat/completions, /v1/models; /metrics, /readyz)"


def deploy(
    config: Path | None = typer.Option(
        None, "--config", "-c", help="Deploy YAML (default: the embedded one; see --print-config)."
    ),
    port: int | None = typer.Option(
        None, "--port", "-p", help="Gateway port (overrides gateway.port; 0 = ephemeral)."
    ),
    set_: list[str] = typer.Option(
        [], "--set", help="Override a config value, e.g. --set decode.count=2 (repeatable)."
    ),
    render: str | None = typer.Option(
        None, "--render", help="Render manifests instead of starting: 'k8s'."
    ),
    out_dir: Path | None = typer.Argument(None, help="Output directory for --render."),
    print_config: bool = typer.Option(
        False, "--print-config", help="Print the validated config as YAML and exit."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print endpoints as JSON once ready."),
    role: str = typer.Option(
        "all",
        "--role",
        help="What this host runs: all (default), or one site's part: prefill, decode, gateway "
        "(the others found at their configured host:port; see docs/deploy.md 'On two hosts').",
    ),
) -> None:
    """Start the gateway, prefill and decode processes (Ctrl-C / SIGTERM stops them cleanly)."""
    from pdx.serving.deploy_config import load_deploy_config, to_yaml

    dotted = list(set_)
    if port is not None:
        if not 0 <= port <= 65535:
            raise InputError("--port", port, "an integer in 0..65535")
        dotted.append(f"gateway.port={port}")
    from pdx.serving.roles import ROLES, check_role

    if role not in ROLES:
        raise InputError("--role", role, "one of " + ", ".join(ROLES))
    cfg = load_deploy_config(config, dotted=dotted)
    if print_config:
        typer.echo(to_yaml(cfg), nl=False)
        return
    if render is not None:
        _render(cfg, render, out_dir, as_json)
        return
    if out_dir is not None:
        raise InputError("OUT_DIR", str(out_dir), "no positional argument unless --render is given")
    check_role(cfg, role)
    _serve(cfg, as_json, role)


def _render(cfg: Any, kind: str, out_dir: Path | None, as_json: bool) -> None:
    from pdx.serving.k8s import render_k8s

    if kind != "k8s":
        raise InputError("--render", kind, "'k8s'")
    if out_dir is None:
        raise InputError("OUT_DIR", None, "a directory to write the manifests into")
    written = render_k8s(cfg, out_dir)
    emit({"rendered": "k8s", "files": [str(p) for p in written]}, as_json=as_json, render=_files)


def _files(con: Any, data: dict[str, Any]) -> None:
    for name in data["files"]:
        con.print(f"wrote {name}")


def _serve(cfg: Any, as_json: bool, role: str) -> None:
    import asyncio

    from pdx.serving.supervisor import serve_forever

    def ready(endpoints: Any) -> None:
        emit(to_jsonable(endpoints), as_json=as_json, render=_render_endpoints)
        err_console().print("ready; Ctrl-C or SIGTERM stops every process")

    message = asyncio.run(serve_forever(cfg, ready, role))
    err_console().print(message)


def _render_endpoints(con: Any, ep: dict[str, Any]) -> None:
    from rich.table import Table

    model = ep["model"]
    if model.get("engine") == "vllm":
        _render_engines(con, ep)
        return
    label = " (synthetic)" if model.get("synthetic") else ""
    if ep["gateway"]:
        con.print(f"gateway  {ep['gateway']}  {GATEWAY_PATHS}")
    con.print(f"model    {model.get('model')}{label}  version {model.get('model_version')}")
    table = Table("process", "pid", "grpc port", "kv store", box=None)

    def pid(row: dict[str, Any]) -> str:  # another host's instance: its address, no pid
        return "-" if row.get("pid") is None else str(row["pid"])

    for p in ep["prefill"]:
        where = f"{p['host']}:{p['port']}" if p.get("remote") else str(p["port"])
        table.add_row(p["name"], pid(p), where, p["kv_endpoint"])
    for d in ep["decode"]:
        where = f"{d['host']}:{d['port']}" if d.get("remote") else str(d["port"])
        table.add_row(d["name"], pid(d), where, "-")
    con.print(table)
    for proxy in ep["proxies"]:
        con.print(
            f"kv proxy {proxy['listen']} -> {proxy['upstream']}  control {proxy['control']}"
            f"  token {proxy['control_token']}"
        )
    con.print(f"mTLS     {ep['tls_dir'] or 'off'}")


def _render_engines(con: Any, ep: dict[str, Any]) -> None:
    from rich.table import Table

    model, env = ep["model"], ep["model"].get("environment") or {}
    con.print(f"gateway  {ep['gateway']}  {GATEWAY_PATHS}")
    blocks = f"KV {model.get('kv_dtype')}, blocks of {model.get('block_size')} tokens"
    con.print(f"model    {model.get('model')}  {model.get('model_path')}  ({blocks})")
    if env:
        con.print(f"engine   vLLM {env.get('vllm_version')} on {model.get('device')}, "
                  f"NIXL {env.get('nixl_version')}  ({env.get('python')})")  # fmt: skip
    table = Table("instance", "pid", "url", "cpus", "nixl side channel", box=None)
    for inst in [*ep["prefill"], *ep["decode"]]:
        cpus = ",".join(map(str, inst.get("cpus") or [])) or "-"
        table.add_row(inst["name"], str(inst.get("pid", "-")), inst["url"], cpus,
                      inst.get("nixl_side_channel", "-"))  # fmt: skip
    con.print(table)


def register(app: typer.Typer) -> None:
    """Add ``pdx deploy``."""
    app.command("deploy")(deploy)
