"""``pdx faults``: the fault proxy, its control client, timelines and the two-site netns network."""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path
from typing import Any

import typer

from pdx.cli.output import emit, err_console
from pdx.errors import InputError

faults_app = typer.Typer(
    help="Inject faults: a TCP/UDP proxy (delay, jitter, rate, loss, stalls, resets, link "
    "down) and kernel shaping between network namespaces.",
    no_args_is_help=True,
)
toxic_app = typer.Typer(help="List, add, update and remove toxics of a running proxy (--api).")
link_app = typer.Typer(help="Take a running proxy's link down or up (--api).")
netns_app = typer.Typer(
    help="Prefill/router/decode network namespaces with a WAN between them: packet-level "
    "delay, jitter, loss, reordering, duplication, rate and cuts (netem or userspace)."
)

API_OPT = typer.Option(..., "--api", help="Control API of the running proxy, HOST:PORT.")
JSON_OPT = typer.Option(False, "--json", help="Print JSON.")


def register(app: typer.Typer) -> None:
    """Attach ``pdx faults`` to the top-level app."""
    faults_app.command("proxy")(proxy_cmd)
    faults_app.command("timeline")(timeline_cmd)
    faults_app.command("stats")(stats_cmd)
    toxic_app.command("list")(toxic_list)
    toxic_app.command("add")(toxic_add)
    toxic_app.command("update")(toxic_update)
    toxic_app.command("remove")(toxic_remove)
    link_app.command("down")(link_down)
    link_app.command("up")(link_up)
    netns_app.command("up")(netns_up)
    netns_app.command("down")(netns_down)
    netns_app.command("status")(netns_status)
    netns_app.command("timeline")(netns_timeline)
    faults_app.add_typer(toxic_app, name="toxic")
    faults_app.add_typer(link_app, name="link")
    faults_app.add_typer(netns_app, name="netns")
    app.add_typer(faults_app, name="faults")


# -- proxy -----------------------------------------------------------------------------------
def proxy_cmd(
    listen: str = typer.Option(
        ..., "--listen", help="Where clients connect, HOST:PORT (port 0 = any)."
    ),
    upstream: str = typer.Option(..., "--upstream", help="The real server, HOST:PORT."),
    udp: bool = typer.Option(False, "--udp", help="Proxy UDP datagrams instead of TCP."),
    latency_ms: float = typer.Option(0.0, "--latency-ms", help="Added delay per direction, ms."),
    jitter_ms: float = typer.Option(
        0.0, "--jitter-ms", help="Jitter: ± range (uniform) or σ (normal), ms."
    ),
    jitter_dist: str = typer.Option("uniform", "--jitter-dist", help="uniform or normal."),
    bandwidth_mbps: float | None = typer.Option(
        None, "--bandwidth-mbps", help="Rate cap per direction, Mbit/s."
    ),
    loss: float = typer.Option(
        0.0, "--loss", help="Loss probability 0-1 (UDP: per datagram; TCP: stall per chunk)."
    ),
    direction: str = typer.Option(
        "both", "--direction", help="both, upstream (client→server) or downstream."
    ),
    api: str | None = typer.Option(None, "--api", help="Serve the control API on HOST:PORT."),
    api_token: str | None = typer.Option(
        None,
        "--api-token",
        help="Require this bearer token on the control API ('generate': a random one, printed).",
    ),
    timeline: Path | None = typer.Option(
        None, "--timeline", help="YAML fault timeline to run from start."
    ),
    seed: int | None = typer.Option(None, "--seed", help="Seed for every random choice."),
    duration_s: float | None = typer.Option(
        None, "--duration-s", help="Stop after this many seconds."
    ),
    as_json: bool = JSON_OPT,
) -> None:
    """Run the fault proxy until Ctrl-C/SIGTERM (or --duration-s), then print its counters."""
    from pdx.faults.proxy import parse_hostport
    from pdx.faults.runner import ProxyOptions, serve, toxics_from_options
    from pdx.faults.timeline import load_timeline

    opts = ProxyOptions(
        listen=parse_hostport(listen, "--listen"),
        upstream=parse_hostport(upstream, "--upstream"),
        udp=udp,
        latency_ms=latency_ms,
        jitter_ms=jitter_ms,
        jitter_dist=jitter_dist,
        bandwidth_mbps=bandwidth_mbps,
        loss=loss,
        direction=direction,
        api=parse_hostport(api, "--api") if api else None,
        api_token=secrets.token_urlsafe(16) if api_token == "generate" else api_token,
        seed=seed,
    )
    toxics_from_options(opts)  # validate before binding anything
    if duration_s is not None and not (0 < duration_s < float("inf")):
        raise InputError("--duration-s", duration_s, "a finite number of seconds > 0")
    plan = load_timeline(timeline) if timeline else None

    def ready(info: dict[str, Any]) -> None:
        host, port = info["listen"]
        api_text = f"; control API {info['api']}" if info["api"] else ""
        if info["api"] and opts.api_token:
            api_text += f" (bearer token {opts.api_token})"
        mode = "udp" if udp else "tcp"
        err_console().print(
            f"listening on {host}:{port} ({mode}) → {upstream}{api_text}", soft_wrap=True
        )

    stats = asyncio.run(serve(opts, timeline=plan, duration_s=duration_s, on_ready=ready))
    emit(stats, as_json=as_json, render=_render_stats)


def _render_stats(console: Any, stats: dict[str, Any]) -> None:
    from rich.table import Table

    console.print(
        f"{stats['mode']} proxy {stats['listen'][0]}:{stats['listen'][1]} → "
        f"{stats['upstream'][0]}:{stats['upstream'][1]}  link {stats['link']}  "
        f"connections {stats['connections_total']} (refused {stats['connections_refused']})"
    )
    for direction in ("upstream", "downstream"):
        console.print(
            f"  {direction:<10} {stats['bytes_in'].get(direction, 0):>14,} B "
            f"{stats['packets_in'].get(direction, 0):>10,} packets in"
        )
    if stats["toxics"]:
        table = Table("toxic", "type", "direction", "bytes", "packets", title="affected by toxics")
        for row in stats["toxics"]:
            table.add_row(
                row["name"],
                row["type"],
                row["direction"],
                f"{row['bytes']:,}",
                f"{row['packets']:,}",
            )
        console.print(table)
    for event in stats.get("timeline") or []:
        status = "ok" if event["ok"] else f"FAILED: {event['error']}"
        console.print(f"  t={event['actual_s']:>8.3f}s  {event['what']}  {status}")


# -- control client --------------------------------------------------------------------------
def _client(api: str) -> Any:
    """A client of a running proxy's API; its bearer token, if it has one, comes from
    ``PDX_FAULTS_API_TOKEN``."""
    from pdx.faults.client import ControlClient

    return ControlClient(api, token=os.environ.get("PDX_FAULTS_API_TOKEN") or None)


def _parse_assignments(pairs: list[str]) -> dict[str, Any]:
    from pdx.config import yaml_value

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise InputError("attribute", pair, "key=value, e.g. latency_ms=25")
        out[key.strip()] = yaml_value(key.strip(), raw)
    return out


def _render_json(console: Any, data: Any) -> None:
    from pdx.cli.output import dumps

    console.print(dumps(data))


def toxic_list(api: str = API_OPT, as_json: bool = JSON_OPT) -> None:
    """List the toxics of a running proxy."""
    emit(_client(api).list_toxics(), as_json=as_json, render=_render_toxics)


def _render_toxics(console: Any, toxics: list[dict[str, Any]]) -> None:
    if not toxics:
        console.print("no toxics")
    for t in toxics:
        attrs = {k: v for k, v in t.items() if k not in ("name", "type", "direction", "toxicity")}
        text = " ".join(f"{k}={v}" for k, v in attrs.items())
        line = f"{t['name']}: {t['type']} {t['direction']} toxicity={t['toxicity']} {text}"
        console.print(line, soft_wrap=True)


def toxic_add(
    toxic_type: str = typer.Argument(..., metavar="TYPE", help="latency, bandwidth, stall, ..."),
    attributes: list[str] = typer.Argument(None, help="key=value attributes, e.g. latency_ms=25"),
    name: str | None = typer.Option(None, "--name", help="Toxic name (default TYPE_DIRECTION)."),
    direction: str = typer.Option("both", "--direction", help="both, upstream or downstream."),
    api: str = API_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Add a toxic to a running proxy (validated here first)."""
    from pdx.faults.toxics import parse_toxic

    spec = {"type": toxic_type, "direction": direction} | _parse_assignments(attributes or [])
    if name:
        spec["name"] = name
    toxic = parse_toxic(spec)
    emit(_client(api).add_toxic(toxic), as_json=as_json, render=lambda c, t: _render_toxics(c, [t]))


def toxic_update(
    name: str = typer.Argument(..., help="Toxic name."),
    attributes: list[str] = typer.Argument(..., help="key=value attributes to change."),
    api: str = API_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Change a toxic's attributes on a running proxy."""
    result = _client(api).update_toxic(name, _parse_assignments(attributes))
    emit(result, as_json=as_json, render=lambda c, t: _render_toxics(c, [t]))


def toxic_remove(name: str = typer.Argument(..., help="Toxic name."), api: str = API_OPT) -> None:
    """Remove a toxic from a running proxy."""
    _client(api).remove_toxic(name)
    err_console().print(f"removed {name}")


def link_down(
    for_s: float | None = typer.Option(
        None, "--for-s", help="Come back up after this many seconds."
    ),
    mode: str = typer.Option("reset", "--mode", help="reset (RST, fail fast) or blackhole (hang)."),
    api: str = API_OPT,
) -> None:
    """Take the link down."""
    if for_s is not None and not (0 <= for_s < float("inf")):
        raise InputError("--for-s", for_s, "a finite number of seconds >= 0")
    if mode not in ("reset", "blackhole"):
        raise InputError("--mode", mode, "reset or blackhole")
    state = _client(api).link_down(duration_s=for_s, mode=mode)
    err_console().print(f"link {state['link']} ({state['mode']})")


def link_up(api: str = API_OPT) -> None:
    """Bring the link back up."""
    state = _client(api).link_up()
    err_console().print(f"link {state['link']}")


def stats_cmd(api: str = API_OPT, as_json: bool = JSON_OPT) -> None:
    """Counters of a running proxy (per direction and per toxic)."""
    stats = _client(api).stats()
    stats.setdefault("timeline", None)
    emit(stats, as_json=as_json, render=_render_stats)


def timeline_cmd(
    file: Path = typer.Argument(..., help="Timeline YAML."),
    api: str | None = typer.Option(None, "--api", help="Run it against this proxy's control API."),
    as_json: bool = JSON_OPT,
) -> None:
    """Validate a fault timeline; with --api, run it against a running proxy."""
    from pdx.faults.timeline import load_timeline, run_timeline

    plan = load_timeline(file)
    if api is None:
        rows = [
            {"at_s": e.at_s, "what": e.describe()}
            for e in sorted(plan.events, key=lambda e: e.at_s)
        ]
        data: dict[str, Any] = {"valid": True, "duration_s": plan.duration_s, "events": rows}
        emit(data, as_json=as_json, render=_render_plan)
        return
    records = asyncio.run(run_timeline(_client(api), plan))
    emit({"events": records}, as_json=as_json, render=_render_records)


def _plan_size(declared: int, changes: int) -> str:
    """``3 events (4 changes: ...)``: a timed cut adds its own restore to what runs."""
    extra = f" ({changes} changes: each timed cut ends with its own restore)"
    return f"{declared} events" + (extra if changes != declared else "")


def _render_plan(console: Any, data: dict[str, Any]) -> None:
    size = _plan_size(data.get("declared_events", len(data["events"])), len(data["events"]))
    console.print(f"timeline valid: {size} over {data['duration_s']:g} s", markup=False)
    for row in data["events"]:
        console.print(f"  at {row['at_s']:>8g} s  {row['what']}")


def _render_records(console: Any, data: dict[str, Any]) -> None:
    for event in data["events"]:
        status = "ok" if event["ok"] else f"FAILED: {event['error']}"
        console.print(f"  t={event['actual_s']:>8.3f}s  {event['what']}  {status}")


# -- netns -----------------------------------------------------------------------------------
PREFIX_OPT = typer.Option("pdx", "--prefix", help="Namespace name prefix (<prefix>-prefill, ...).")


def netns_up(
    prefix: str = PREFIX_OPT,
    rate_mbit: float = typer.Option(
        1000.0, "--rate-mbit", help="Rate cap of the router hop, each direction, Mbit/s."
    ),
    queue_ms: float = typer.Option(
        50.0, "--queue-ms", help="Bottleneck queue: backlog (ms at the rate) before tail drops."
    ),
    delay_ms: float = typer.Option(
        0.0, "--delay-ms", help="One-way delay each direction, ms (RTT = 2 x this + the path's)."
    ),
    jitter_ms: float = typer.Option(
        0.0, "--jitter-ms", help="Normal jitter (std dev) on the delay, ms; never reorders."
    ),
    loss: float = typer.Option(0.0, "--loss", help="Loss per wire packet, each direction, 0-1."),
    loss_model: str = typer.Option(
        "random", "--loss-model", help="random (independent) or gilbert (bursts)."
    ),
    loss_burst: float = typer.Option(
        1.0, "--loss-burst", help="gilbert: mean burst length, packets (> 1)."
    ),
    reorder: float = typer.Option(
        0.0, "--reorder", help="Share of packets sent on without the delay (overtaking), 0-1."
    ),
    duplicate: float = typer.Option(0.0, "--duplicate", help="Share of packets sent twice, 0-1."),
    up_dir: str = typer.Option(
        "", "--up", help="decode → prefill overrides, e.g. 'delay_ms=40,loss=0.001'."
    ),
    down_dir: str = typer.Option(
        "", "--down", help="prefill → decode overrides, e.g. 'rate_mbit=200'."
    ),
    emulator: str = typer.Option(
        "auto", "--emulator", help="auto (netem if the kernel has it), netem or userspace."
    ),
    seed: int | None = typer.Option(None, "--seed", help="Seed of every random choice."),
    mtu: int = typer.Option(1500, "--mtu", help="MTU of every veth link."),
    as_json: bool = JSON_OPT,
) -> None:
    """Create (or reconfigure live) prefill, router and decode namespaces and the WAN between
    them. Needs root."""
    from pdx.faults import netns
    from pdx.faults.wan.conditions import parse_direction

    cfg = netns.make_config(
        prefix=prefix, mtu=mtu, emulator=emulator, seed=seed, rate_mbit=rate_mbit,
        queue_ms=queue_ms, delay_ms=delay_ms, jitter_ms=jitter_ms, loss=loss,
        loss_model=loss_model, loss_burst=loss_burst, reorder=reorder, duplicate=duplicate,
        up=parse_direction(up_dir, "--up"), down=parse_direction(down_dir, "--down"),
    )  # fmt: skip
    emit(netns.up(cfg), as_json=as_json, render=_render_netns)


def netns_down(prefix: str = PREFIX_OPT, as_json: bool = JSON_OPT) -> None:
    """Stop the emulator and delete the namespaces (no-op when absent). Needs root."""
    from pdx.faults import netns

    result = netns.down(netns.make_config(prefix=prefix))
    emit(
        result,
        as_json=as_json,
        render=lambda c, d: c.print(f"removed: {', '.join(d['removed']) or 'nothing'}"),
    )


def netns_status(prefix: str = PREFIX_OPT, as_json: bool = JSON_OPT) -> None:
    """Namespaces, addresses, the conditions in force, which emulator applies them, and its
    counters. Needs root."""
    from pdx.faults import netns

    emit(netns.status(netns.make_config(prefix=prefix)), as_json=as_json, render=_render_netns)


def netns_timeline(
    path: Path = typer.Argument(..., help="Timeline YAML (events with at_s and one action)."),
    prefix: str = PREFIX_OPT,
    check: bool = typer.Option(False, "--check", help="Only validate and print the plan."),
    as_json: bool = JSON_OPT,
) -> None:
    """Change the router hop's conditions over time (live) on a topology that is up. Needs root."""
    from pdx.faults import netns
    from pdx.faults.wan.timeline import load_wan_timeline, run_wan_timeline

    plan = load_wan_timeline(path)
    if check:
        rows = [{"at_s": at, "what": e.describe()} for at, e in plan.plan()]
        data: dict[str, Any] = {
            "valid": True,
            "duration_s": plan.duration_s,
            "events": rows,
            "declared_events": len(plan.events),
        }
        emit(data, as_json=as_json, render=_render_plan)
        return
    start = netns.current(prefix).wan
    err_console().print(f"running {_plan_size(len(plan.events), len(plan.plan()))}", markup=False)
    records = run_wan_timeline(plan, start, lambda wan: netns.set_conditions(prefix, wan))
    emit({"events": records}, as_json=as_json, render=_render_records)


def _render_netns(console: Any, data: dict[str, Any]) -> None:
    for ns, present in data["namespaces"].items():
        console.print(f"{ns:<20} {'up' if present else 'absent'}")
        for row in data["addresses"].get(ns, []):
            console.print(f"    {' '.join(row)}")
    for dev, text in data["qdiscs"].items():
        console.print(f"router {dev}: {text}", soft_wrap=True)
    wan = data.get("wan")
    if wan:
        _render_wan(console, wan)
    if data["up"]:
        console.print(
            f"prefill {data['prefill_addr']} ↔ decode {data['decode_addr']} via the router"
        )


def _render_wan(console: Any, wan: dict[str, Any]) -> None:
    from pdx.faults.wan.conditions import WanConditions

    if wan.get("conditions"):
        console.print("conditions: " + WanConditions.model_validate(wan["conditions"]).summary())
    running = {True: "running", False: "NOT RUNNING", None: "-"}[wan.get("running")]
    console.print(f"emulator: {wan['emulator']} ({running}); traffic {wan['traffic']}")
    keys = ("packets_in", "packets_out", "dropped_loss", "dropped_queue", "dropped_cut",
            "reordered", "duplicated", "held_packets", "queue_ms")  # fmt: skip
    for d, c in wan.get("counters", {}).items():
        shown = ", ".join(f"{k} {c[k]:,}" for k in keys if k in c)
        console.print(f"  {d}: {shown}", soft_wrap=True)
    if wan.get("error"):
        console.print(f"  {wan['error']}; log: {wan.get('log') or '-'}", soft_wrap=True)
