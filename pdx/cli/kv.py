"""``pdx kv-serve``, ``pdx kv-bench`` and ``pdx certs init``: the KV store from the shell."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from pdx.tls import DEFAULT_NAMES


def register(app: typer.Typer) -> None:
    """Attach the KV commands."""
    app.command("kv-serve")(kv_serve)
    app.command("kv-bench")(kv_bench)
    certs = typer.Typer(
        help="Certificates for mutual TLS between pdx services.", no_args_is_help=True
    )
    certs.command("init")(certs_init)
    app.add_typer(certs, name="certs")


def _tls(tls_dir: Path | None, name: str) -> dict[str, Any] | None:
    return None if tls_dir is None else {"cert_dir": str(tls_dir), "name": name}


def kv_serve(
    config: Path | None = typer.Option(None, "--config", help="YAML file with store settings."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind."),
    port: int = typer.Option(0, "--port", help="Port to bind (0 = pick a free one)."),
    budget_gb: float | None = typer.Option(None, "--budget-gb", help="Byte budget, GB (1e9)."),
    ttl_s: int | None = typer.Option(None, "--ttl-s", help="Default TTL, 60-300 s."),
    tls_dir: Path | None = typer.Option(None, "--tls-dir", help="Directory from `pdx certs init`."),
    tls_name: str = typer.Option("kv-store", "--tls-name", help="This server's name in --tls-dir."),
    audit: Path | None = typer.Option(None, "--audit", help="Append the audit log (JSONL) here."),
    data_port: int | None = typer.Option(
        None, "--data-port", help="Port of the bulk data plane (0 = pick a free one)."
    ),
    no_data_plane: bool = typer.Option(
        False, "--no-data-plane", help="Serve Put/Get over gRPC only."
    ),
    metrics_port: int | None = typer.Option(
        None, "--metrics-port", help="Serve Prometheus metrics."
    ),
    set_: list[str] = typer.Option([], "--set", help="Override a setting: key=value."),
    as_json: bool = typer.Option(False, "--json", help="Print the ready line as JSON."),
) -> None:
    """Run a standalone KV store server until Ctrl-C / SIGTERM."""
    import asyncio

    from pdx.cli.output import emit
    from pdx.config import build_config, read_yaml
    from pdx.transfer.contract import KVStoreConfig
    from pdx.transfer.server import serve_kv

    overrides = {
        "host": host,
        "port": port,
        "budget_bytes": int(budget_gb * 1e9) if budget_gb is not None else None,
        "kv_ttl_seconds": ttl_s,
        "tls": _tls(tls_dir, tls_name),
        "audit_path": str(audit) if audit else None,
        "data_port": data_port,
        "data_plane": False if no_data_plane else None,
    }
    base = read_yaml(config) if config else {}
    cfg = build_config(
        KVStoreConfig, source=str(config or "kv-serve"), base=base, overrides=overrides, dotted=set_
    )

    def ready(bound: int, data_bound: int | None) -> None:
        data = {
            "listening": f"{cfg.host}:{bound}",
            "port": bound,
            "data_port": data_bound,
            "tls": cfg.tls is not None,
        }

        def render(con: Any, d: dict[str, Any]) -> None:
            plane = f"data plane on port {d['data_port']}" if d["data_port"] else "no data plane"
            tls = "on" if d["tls"] else "off"
            con.print(f"kv store listening on {d['listening']}, {plane} (tls {tls})")

        emit(data, as_json=as_json, render=render)

    asyncio.run(serve_kv(cfg, ready, metrics_port=metrics_port))


def kv_bench(
    total_bytes: str = typer.Option(
        "256MB", "--bytes", help="Bytes to push through, e.g. 256MB, 1GB."
    ),
    chunk_kb: int = typer.Option(1024, "--chunk-kb", help="Chunk size in KiB (64-8192)."),
    tls: bool = typer.Option(False, "--tls", help="Mutual TLS with throw-away certificates."),
    codec: str = typer.Option(
        "raw", "--codec", help="Codec for a random bf16 tensor (raw: random bytes as they are)."
    ),
    streams: int = typer.Option(
        1,
        "--streams",
        help="Parallel streams per object (1: digest sent last).",
    ),
    connections: int = typer.Option(1, "--connections", help="TCP connections per client."),
    transport: str = typer.Option(
        "auto", "--transport", help="auto | data | grpc: how Put/Get bytes travel."
    ),
    repeat: int = typer.Option(3, "--repeat", help="Runs; the median is reported."),
    target: str | None = typer.Option(
        None, "--target", help="HOST:PORT of a running store (default: start one on loopback)."
    ),
    tls_dir: Path | None = typer.Option(
        None, "--tls-dir", help="With --target: directory from `pdx certs init` (mutual TLS)."
    ),
    tls_name: str = typer.Option("decode", "--tls-name", help="Client identity in --tls-dir."),
    congestion_control: str = typer.Option(
        "bbr", "--congestion-control", help="bbr | cubic | system: TCP algorithm of the data plane."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Put N bytes into a store and Get them back; print goodput (GB = 1e9 B). Starts a store
    on loopback, or talks to a running one with --target."""
    from pdx.cli.output import emit
    from pdx.transfer.bench import parse_size, render_bench, run_bench

    result = run_bench(
        parse_size(total_bytes, "--bytes"),
        chunk_kb=chunk_kb,
        tls=tls,
        codec=codec,
        streams=streams,
        connections=connections,
        transport=transport,
        repeat=repeat,
        target=target,
        tls_dir=tls_dir,
        tls_name=tls_name,
        congestion_control=congestion_control,
    )
    emit(result, as_json=as_json, render=render_bench)


def certs_init(
    directory: Path = typer.Argument(..., metavar="DIR", help="Directory to create the files in."),
    names: list[str] = typer.Option(
        list(DEFAULT_NAMES), "--name", help="Service identity to issue (repeatable)."
    ),
    days: int = typer.Option(30, "--days", min=1, max=3650, help="Validity in days."),
    hosts: list[str] = typer.Option(
        [],
        "--host",
        help="Another address or DNS name the certificates are valid for (repeatable).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Create a private CA and one certificate + key per service (for local and test use)."""
    from pdx.cli.output import emit
    from pdx.tls import ca_key_dir, init_certs

    files = init_certs(directory, names, days=days, hosts=hosts)
    keys = ca_key_dir(directory)
    data = {
        "dir": str(directory),
        "files": [p.name for p in files if p.parent != keys],
        "ca_key": str(keys / "ca.key"),
    }
    emit(data, as_json=as_json, render=_render_certs)


def _render_certs(con: Any, d: dict[str, Any]) -> None:
    con.print(f"wrote {len(d['files'])} files to {d['dir']}:")
    for name in d["files"]:
        con.print(f"  {name}")
    con.print(f"the CA's key is apart, in {d['ca_key']} (give services only {d['dir']})")
