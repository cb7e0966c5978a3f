"""The KV chunk sweep over the real gRPC KV path, against an in-process KV store."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdx.cli.main import app
from pdx.errors import InputError, MeasurementError
from pdx.link.chunks import (
    chunk_transport_names,
    get_chunk_transport,
    measure_chunk_size,
    run_chunk_sweep,
)
from pdx.link.client import ProbeSession
from pdx.link.kv_transport import (
    KVChunkTransport,
    KVSweepSettings,
    kv_chunk_transport,
    kv_sweep_settings,
)
from pdx.link.server import ProbeServer
from pdx.netaddr import listen_port
from pdx.tls import TLSConfig, init_certs
from pdx.transfer.contract import KVStoreConfig
from pdx.transfer.server import KVServer, create_kv_server
from pdx.units import KIB, MIB

SIZES = [64 * KIB, 256 * KIB, 1 * MIB]


class _StoreThread:
    """A real KV store server on 127.0.0.1:0, on its own event loop thread."""

    def __init__(self, tls: TLSConfig | None = None, budget_bytes: int = 1 << 30) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        cfg = KVStoreConfig(port=0, tls=tls, budget_bytes=budget_bytes)
        started = asyncio.run_coroutine_threadsafe(create_kv_server(cfg), self.loop)
        self.server: KVServer
        self.server, self.port = started.result(timeout=10)

    def objects(self) -> int:
        return len(self.server.store)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0.5), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture
def kv_store() -> Iterator[_StoreThread]:
    store = _StoreThread()
    try:
        yield store
    finally:
        store.stop()


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    init_certs(tmp_path, ["kv-store", "decode"])
    return tmp_path


@pytest.fixture
def tls_store(certs: Path) -> Iterator[_StoreThread]:
    store = _StoreThread(TLSConfig(cert_dir=certs, name="kv-store"))
    try:
        yield store
    finally:
        store.stop()


def _sweep(settings: KVSweepSettings) -> list[dict[str, object]]:
    session = ProbeSession("127.0.0.1", 1, None)  # the grpc transport never touches it
    with kv_chunk_transport(settings):
        sweep = run_chunk_sweep(
            session, SIZES, transport="grpc", seconds=0.15, window=2, max_chunks=25
        )
    assert sweep.transport == "grpc" and sweep.recommended_bytes in SIZES
    return [vars(c) for c in sweep.chunks]


def _check_rows(rows: list[dict[str, object]], op: str, tls: bool) -> None:
    assert [r["chunk_bytes"] for r in rows] == SIZES
    for r in rows:
        assert r["transport"] == "grpc"
        assert 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"]  # type: ignore[operator]
        assert r["gbps"] > 0 and 0 < r["count"] <= 25  # type: ignore[operator]
        detail = r["transport_detail"]
        assert isinstance(detail, dict)
        assert detail["kv_op"] == op and detail["tls"] is tls
        assert detail["objects_released"] == detail["objects_stored"] > 0
        assert detail["release_errors"] == []
        if op == "put":  # one object per timed chunk, plus the warm-up ones
            assert detail["objects_stored"] > r["count"]  # type: ignore[operator]
        else:  # one object read again and again
            assert detail["objects_stored"] == 1


@pytest.mark.parametrize("op", ["get", "put"])
def test_sweep_over_plaintext_grpc_leaves_the_store_empty(kv_store: _StoreThread, op: str) -> None:
    rows = _sweep(KVSweepSettings(f"127.0.0.1:{kv_store.port}", op))  # type: ignore[arg-type]
    _check_rows(rows, op, tls=False)
    assert kv_store.objects() == 0
    assert kv_store.server.metrics.registry.get_sample_value("pdx_kv_released_total") == sum(
        r["transport_detail"]["objects_released"] for r in rows
    )  # type: ignore[index]


def test_long_get_sweep_swaps_in_fresh_objects_and_releases_all(
    kv_store: _StoreThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Objects live 300 s; pretend that is 50 ms so the refresh path runs within the test.
    monkeypatch.setattr("pdx.link.kv_transport.REFRESH_AFTER_S", 0.05)
    transport = KVChunkTransport(KVSweepSettings(f"127.0.0.1:{kv_store.port}"))
    payload = memoryview(os.urandom(256 * KIB))
    result = measure_chunk_size(transport, payload, seconds=0.3, window=2, max_chunks=400)
    detail = result.transport_detail
    assert result.count > 0 and detail["objects_stored"] > 1
    assert detail["objects_released"] == detail["objects_stored"]
    assert kv_store.objects() == 0


@pytest.mark.parametrize("op", ["get", "put"])
def test_a_store_that_refuses_the_chunk_is_a_measurement_error(op: str) -> None:
    store = _StoreThread(budget_bytes=512 * KIB)  # smaller than one 1 MiB chunk
    try:
        settings = KVSweepSettings(f"127.0.0.1:{store.port}", op)  # type: ignore[arg-type]
        transport = KVChunkTransport(settings)
        with pytest.raises(MeasurementError, match=r"KV_INVALID: .*above budget"):
            measure_chunk_size(
                transport, memoryview(bytes(MIB)), seconds=0.2, window=2, max_chunks=5
            )
        assert store.objects() == 0
    finally:
        store.stop()


def test_sweep_over_mtls(tls_store: _StoreThread, certs: Path) -> None:
    settings = kv_sweep_settings(f"127.0.0.1:{tls_store.port}", "get", certs, "decode", SIZES)
    _check_rows(_sweep(settings), "get", tls=True)
    assert tls_store.objects() == 0


def test_plaintext_client_is_refused_by_an_mtls_store(tls_store: _StoreThread) -> None:
    settings = KVSweepSettings(f"127.0.0.1:{tls_store.port}", connect_timeout_s=2)
    with pytest.raises(MeasurementError, match="KV store unreachable over plaintext"):
        _sweep(settings)


def test_grpc_is_listed_but_needs_a_store() -> None:
    assert "grpc" in chunk_transport_names()
    with pytest.raises(InputError, match="--kv-target"):
        get_chunk_transport("grpc")(ProbeSession("127.0.0.1", 1, None))


def _run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


CHUNKS_ONLY = ["--phases", "chunks", "--chunk-transport", "grpc", "--chunk-seconds", "0.15"]


def test_cli_sweeps_over_the_kv_store(
    probe_server: ProbeServer, tls_store: _StoreThread, certs: Path
) -> None:
    code, out, err = _run(
        "probe-link",
        f"127.0.0.1:{probe_server.tcp_port}",
        *CHUNKS_ONLY,
        "--chunk-sizes",
        "64KiB,1MiB",
        "--kv-target",
        f"127.0.0.1:{tls_store.port}",
        "--tls-dir",
        str(certs),
        "--json",
    )
    # A chunk sweep alone judges nothing (no loss, RTT or KV rule measured): INCONCLUSIVE.
    assert code == 3, err
    report = json.loads(out)
    assert report["verdict"]["result"] == "INCONCLUSIVE" and report["verdict"]["go"] is False
    assert report["chunk_transport"] == "grpc"
    assert [c["chunk_bytes"] for c in report["chunks"]] == [64 * KIB, 1 * MIB]
    for c in report["chunks"]:
        assert set(c) >= {"chunk_bytes", "gbps", "p50_ms", "p99_ms", "transport"}
        assert c["transport"] == "grpc" and c["transport_detail"]["tls"] is True
    assert report["chunk_recommended_bytes"] in (64 * KIB, 1 * MIB)
    assert tls_store.objects() == 0


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ([], "--kv-target"),
        (["--kv-target", "nowhere"], "--kv-target"),
        (["--kv-target", "127.0.0.1:5", "--kv-op", "steal"], "--kv-op"),
        (["--kv-target", "127.0.0.1:5", "--chunk-sizes", "16KiB"], "--chunk-sizes"),
        (["--kv-target", "127.0.0.1:5", "--chunk-sizes", "9MiB"], "--chunk-sizes"),
        (["--kv-target", "127.0.0.1:5", "--tls-dir", "/nonexistent"], "--tls-dir"),
    ],
)
def test_bad_kv_options_are_one_line(extra: list[str], field: str) -> None:
    code, out, err = _run("probe-link", "127.0.0.1:5301", *CHUNKS_ONLY, *extra)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"error: {field}: got "), err


def test_kv_target_without_grpc_transport_is_refused() -> None:
    code, _, err = _run("probe-link", "127.0.0.1:5301", "--kv-target", "127.0.0.1:5")
    assert code == 2 and err.startswith("error: --kv-target: got '127.0.0.1:5', expected only")


def test_unreachable_kv_store_exits_2_before_probing() -> None:
    port = listen_port()
    # The probe server address is unreachable too: the KV store is checked first.
    code, out, err = _run(
        "probe-link", "127.0.0.1:1", *CHUNKS_ONLY, "--kv-target", f"127.0.0.1:{port}"
    )
    assert code == 2 and out == ""
    assert err.startswith(f"error: --kv-target 127.0.0.1:{port}: KV store unreachable"), err
    assert err.count("\n") == 1
