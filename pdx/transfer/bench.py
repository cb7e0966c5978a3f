"""``kv-bench``: Put N bytes into a store and Get them back; report goodput.

By default the store runs on loopback as its own process (``pdx kv-serve``), as it would
on the prefill host, so client and server do not share one interpreter lock; with
``--target`` the bench talks to a running store over the real path. Goodput counts payload
bytes (GB = 1e9 bytes) over the whole call, checksums and object digest included, after one
unmeasured warm-up round.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdx.errors import InputError, MeasurementError
from pdx.procs import cpu_seconds, stat_fields

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)?\s*$", re.I)
_FACTORS = {
    "": 1,
    "B": 1,
    "KB": 1e3,
    "MB": 1e6,
    "GB": 1e9,
    "TB": 1e12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "K": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
}


def parse_size(text: str, field_name: str) -> int:
    """``256MB`` -> 256e6 bytes, ``1GiB`` -> 2**30; plain integers are bytes."""
    m = _SIZE.match(text)
    unit = (m.group(2) or "").upper() if m else ""
    if m is None or unit not in _FACTORS:
        raise InputError(field_name, text, "a size such as 268435456, 256MB or 1GiB")
    value = int(float(m.group(1)) * _FACTORS[unit])
    if value <= 0:
        raise InputError(field_name, text, "a size above 0")
    return value


@dataclass
class BenchResult:
    """Median goodput of ``repeat`` Put+Get rounds of one object."""

    bytes: int
    payload_bytes: int
    chunk_kb: int
    codec: str
    checksums: bool
    tls: bool
    streams: int
    connections: int
    transport: str
    repeat: int
    put_gbytes_per_s: float
    get_gbytes_per_s: float
    put_runs_gbytes_per_s: list[float] = field(default_factory=list)
    get_runs_gbytes_per_s: list[float] = field(default_factory=list)
    retries: int = 0
    # CPU-seconds per GB moved (medians), client process and store process, all threads.
    # Unlike goodput, these barely move when other work shares the machine.
    put_cpu_s_per_gb: dict[str, float] = field(default_factory=dict)
    get_cpu_s_per_gb: dict[str, float] = field(default_factory=dict)
    # the store bench talked to (loopback process, or --target) and what the path showed
    target: str = ""
    rtt_ms: float | None = None
    congestion_control: str | None = None


def process_cpu_s(pid: int | None = None) -> float | None:
    """CPU seconds (user + system, all threads) used so far by ``pid`` (default: this one).

    Another process's time comes from ``/proc``; None where that is not available.
    """
    if pid is None:
        return time.process_time()
    fields = stat_fields(pid)
    try:
        return cpu_seconds(fields) if fields else None
    except (ValueError, IndexError):
        return None


def _payload(total_bytes: int, codec: str) -> tuple[bytes, Any]:
    """Random bytes; for a codec other than raw, a bf16 tensor encoded with it."""
    if codec == "raw":
        return os.urandom(total_bytes), None
    import torch

    from pdx.transfer.objects import encode_tensors

    x = torch.randn(total_bytes // 2, dtype=torch.float32).to(torch.bfloat16)
    payload, layout = encode_tensors([x], codec, ["value"])
    return payload, layout


class StoreProcess:
    """``pdx kv-serve`` in a child process; its port is read from the ready line."""

    def __init__(self, args: list[str]) -> None:
        code = (
            "import sys; from pdx.cli.main import main; sys.argv = ['pdx', *sys.argv[1:]]; main()"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, "kv-serve", "--json", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        lines = []
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # the JSON ready document, pretty-printed
            lines.append(line)
            if line.startswith("}"):
                break
        try:
            self.port = int(json.loads("".join(lines))["port"])
        except (ValueError, KeyError):
            err = self.proc.stderr.read() if self.proc.stderr else ""
            self.stop()
            raise MeasurementError(f"kv-serve did not start: {err.strip()[-400:]}") from None

    def stop(self) -> None:
        """SIGTERM (graceful), then wait."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class _CpuMeter:
    """CPU seconds per GB of one phase, for this process and the store process."""

    def __init__(self, store_pid: int | None) -> None:
        self.store_pid = store_pid  # None: a remote store (--target), not measured
        self.samples: dict[str, list[tuple[float, float | None]]] = {"put": [], "get": []}
        self._start: tuple[float, float | None] = (0.0, None)

    def start(self) -> None:
        """Mark the beginning of a phase."""
        self._start = (time.process_time(), self._store_cpu_s())

    def stop(self, phase: str, nbytes: int) -> None:
        """Record the phase that began at :meth:`start`, moving ``nbytes``."""
        client0, store0 = self._start
        store1 = self._store_cpu_s()
        gb = nbytes / 1e9
        store = (store1 - store0) / gb if store0 is not None and store1 is not None else None
        self.samples[phase].append(((time.process_time() - client0) / gb, store))

    def _store_cpu_s(self) -> float | None:
        return process_cpu_s(self.store_pid) if self.store_pid is not None else None

    def medians(self, phase: str) -> dict[str, float]:
        """``{"client": .., "store": ..}`` medians (store omitted where unknown)."""
        rows = self.samples[phase]
        out = {"client": round(statistics.median(c for c, _ in rows), 3)}
        stores = [s for _, s in rows if s is not None]
        if stores:
            out["store"] = round(statistics.median(stores), 3)
        return out


async def _rounds(
    target: str, payload: bytes, layout: Any, cfg: Any, tls: Any, repeat: int, meter: _CpuMeter
) -> dict[str, Any]:
    from pdx.transfer.client import KVClient

    put_runs, get_runs = [], []
    async with KVClient(target, cfg, tls=tls) as kv:
        # One unmeasured round: connects, and pays the first-touch page faults a fresh
        # process takes once (a long-running store reuses its heap).
        warm = await kv.put(payload, layout)
        back = await kv.get(warm)
        del back
        await kv.release(warm)
        for _ in range(repeat):
            meter.start()
            t0 = time.perf_counter()
            kv_id = await kv.put(payload, layout)
            put_s = time.perf_counter() - t0
            meter.stop("put", len(payload))
            meter.start()
            t1 = time.perf_counter()
            obj = await kv.get(kv_id)
            get_s = time.perf_counter() - t1
            meter.stop("get", len(payload))
            if len(obj) != len(payload):
                raise MeasurementError("kv-bench: object came back with the wrong size")
            del obj
            await kv.release(kv_id)
            put_runs.append(len(payload) / put_s / 1e9)
            get_runs.append(len(payload) / get_s / 1e9)
        records = kv.records()
        retries = sum(r.retries for r in records)
        used = "data" if await kv.data_endpoint() is not None else "grpc"
        cc = next((r.congestion_control for r in reversed(records) if r.congestion_control), None)
        rtt = round(kv.path.rtt_ms, 3) if kv.path.rtt_ms is not None else None
    return {"put": put_runs, "get": get_runs, "retries": retries, "transport": used,
            "congestion_control": cc, "rtt_ms": rtt}  # fmt: skip


def run_bench(
    total_bytes: int,
    *,
    chunk_kb: int = 1024,
    tls: bool = False,
    codec: str = "raw",
    streams: int = 2,
    connections: int = 1,
    transport: str = "auto",
    repeat: int = 3,
    target: str | None = None,
    tls_dir: Path | None = None,
    tls_name: str = "decode",
    congestion_control: str = "bbr",
) -> BenchResult:
    """Time ``repeat`` Put+Get rounds of one object: against a store process started on
    loopback, or against ``target`` (a running store, over the real path)."""
    from pdx.config import build_config
    from pdx.tls import TLSConfig
    from pdx.transfer.contract import KVClientConfig

    cfg = build_config(
        KVClientConfig,
        source="kv-bench",
        base={
            "chunk_size_kb": chunk_kb,
            "streams": streams,
            "connections": connections,
            "kv_transfer_timeout_ms": 600_000,
            "client_id": "kv-bench",
            "transport": transport,
            "congestion_control": congestion_control,
        },
    )
    if repeat < 1:
        raise InputError("--repeat", repeat, "at least 1")
    if target is not None:
        from pdx.netaddr import parse_hostport

        parse_hostport(target, "--target")
        if tls and tls_dir is None:
            raise InputError("--tls", True, "--tls-dir DIR (the store's CA and a client identity)")
    from pdx.transfer.server import tune_malloc

    tune_malloc()
    payload, layout = _payload(total_bytes, codec)
    with tempfile.TemporaryDirectory(prefix="pdx-kv-bench-") as tmp:
        client_tls = None
        store: StoreProcess | None = None
        if target is not None:
            if tls_dir is not None:
                client_tls = TLSConfig(cert_dir=tls_dir, name=tls_name)
            meter = _CpuMeter(None)
            where = target
        else:
            args = ["--budget-gb", str(max(4.0, 3 * len(payload) / 1e9))]
            if tls:
                from pdx.tls import init_certs

                init_certs(Path(tmp))
                args += ["--tls-dir", tmp]
                client_tls = TLSConfig(cert_dir=Path(tmp), name="decode")
            store = StoreProcess(args)
            meter = _CpuMeter(store.proc.pid)
            where = f"127.0.0.1:{store.port}"
        try:
            runs = asyncio.run(_rounds(where, payload, layout, cfg, client_tls, repeat, meter))
        finally:
            if store is not None:
                store.stop()
    return BenchResult(
        bytes=total_bytes,
        payload_bytes=len(payload),
        chunk_kb=chunk_kb,
        codec=codec,
        checksums=True,
        tls=client_tls is not None,
        streams=streams,
        connections=connections,
        transport=runs["transport"],
        repeat=repeat,
        put_gbytes_per_s=round(statistics.median(runs["put"]), 3),
        get_gbytes_per_s=round(statistics.median(runs["get"]), 3),
        put_runs_gbytes_per_s=[round(x, 3) for x in runs["put"]],
        get_runs_gbytes_per_s=[round(x, 3) for x in runs["get"]],
        retries=runs["retries"],
        put_cpu_s_per_gb=meter.medians("put"),
        get_cpu_s_per_gb=meter.medians("get"),
        target=where if target is not None else "loopback",
        rtt_ms=runs["rtt_ms"],
        congestion_control=runs["congestion_control"],
    )


def render_bench(con: Any, r: BenchResult) -> None:
    """Human summary of a :class:`BenchResult`."""
    con.print(
        f"kv-bench: {r.payload_bytes / 1e6:.1f} MB object, chunk {r.chunk_kb} KiB, codec {r.codec}"
    )
    con.print(
        f"  store {r.target} (RTT {r.rtt_ms} ms), transport {r.transport}, tls "
        f"{'on' if r.tls else 'off'}, congestion control {r.congestion_control or 'system'}, "
        f"checksums on, {r.streams} stream(s) over {r.connections} connection(s), "
        f"median of {r.repeat}"
    )
    con.print(f"  put {r.put_gbytes_per_s:.3f} GB/s   get {r.get_gbytes_per_s:.3f} GB/s")
    cpu = [
        f"{op} client {d['client']:.2f} store "
        + (f"{d['store']:.2f}" if "store" in d else "- (remote)")
        for op, d in (("put", r.put_cpu_s_per_gb), ("get", r.get_cpu_s_per_gb))
    ]
    con.print(f"  CPU-s per GB: {'   '.join(cpu)}")
