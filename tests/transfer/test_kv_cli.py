"""`pdx kv-serve`, `pdx kv-bench`, `pdx certs init` through the real CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdx.cli.main import app

runner = CliRunner()


def test_certs_init_then_refuses_to_overwrite(tmp_path: Path) -> None:
    d = tmp_path / "certs"
    ok = runner.invoke(
        app, ["certs", "init", str(d), "--name", "kv-store", "--name", "decode", "--json"]
    )
    assert ok.exit_code == 0, ok.output
    out = json.loads(ok.stdout)
    assert sorted(out["files"]) == sorted(
        ["ca.pem", "kv-store.pem", "kv-store.key", "decode.pem", "decode.key"]
    )
    # the CA's private key is never in the directory handed to services
    assert not (d / "ca.key").exists() and out["ca_key"] == str(
        tmp_path / "certs.ca-key" / "ca.key"
    )
    assert (tmp_path / "certs.ca-key").stat().st_mode & 0o077 == 0
    again = runner.invoke(app, ["certs", "init", str(d)])
    assert again.exit_code == 2
    assert again.stderr.startswith("error: DIR:") and "refusing to overwrite" in again.stderr
    assert "Traceback" not in again.output


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["kv-bench", "--bytes", "lots"], "--bytes: got 'lots'"),
        (["kv-bench", "--bytes", "8MB", "--chunk-kb", "32"], "chunk_size_kb"),
        (["kv-bench", "--bytes", "8MB", "--codec", "nope"], "codec: got 'nope'"),
        (["kv-bench", "--bytes", "8MB", "--transport", "udp"], "transport"),
        (["kv-serve", "--data-port", "70000"], "data_port"),
        (["kv-serve", "--ttl-s", "30"], "kv_ttl_seconds"),
        (["kv-serve", "--set", "max_inflight_kv=0"], "max_inflight_kv"),
        (["kv-serve", "--tls-dir", "/nonexistent", "--port", "0"], "tls"),
    ],
)
def test_bad_input_is_one_clear_error(args: list[str], needle: str) -> None:
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith("error: ") and needle in res.stderr
    assert "Traceback" not in res.output


@pytest.mark.slow
def test_kv_bench_json_runs_a_real_store_process() -> None:
    res = runner.invoke(
        app, ["kv-bench", "--bytes", "16MB", "--chunk-kb", "256", "--repeat", "1", "--json"]
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["put_gbytes_per_s"] > 0 and out["get_gbytes_per_s"] > 0
    assert out["chunk_kb"] == 256 and out["checksums"] is True and out["tls"] is False
    assert out["payload_bytes"] == 16_000_000 and out["retries"] == 0
    assert out["transport"] == "data"  # the default: the store's data plane
    for phase in ("put_cpu_s_per_gb", "get_cpu_s_per_gb"):
        # The store's share is read in clock ticks (10 ms): 16 MB may show as 0.
        assert out[phase]["client"] > 0 and out[phase]["store"] >= 0


@pytest.mark.slow
def test_kv_bench_with_tls() -> None:
    args = ["kv-bench", "--bytes", "4MB", "--tls", "--repeat", "1", "--json"]
    for transport in ("data", "grpc"):
        res = runner.invoke(app, [*args, "--transport", transport])
        assert res.exit_code == 0, res.output
        out = json.loads(res.stdout)
        assert out["tls"] is True and out["transport"] == transport


def test_process_cpu_s_reads_this_and_another_process() -> None:
    import subprocess
    import sys

    from pdx.transfer.bench import process_cpu_s

    mine = process_cpu_s()
    assert mine is not None and mine > 0
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        other = process_cpu_s(child.pid)
        assert other is not None and other >= 0
    finally:
        child.kill()
        child.wait()
    assert process_cpu_s(2**22 + 7) is None  # above Linux's pid_max: no such process
