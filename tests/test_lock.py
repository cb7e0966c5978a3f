"""The locked dependency sets (requirements/*.txt) and the drift check `make test` runs first."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REQ = ROOT / "requirements"
SCRIPT = ROOT / "scripts" / "check_lock.py"

_spec = importlib.util.spec_from_file_location("check_lock", SCRIPT)
assert _spec and _spec.loader
check_lock = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_lock)


def test_every_locked_pin_is_exact_and_hashed() -> None:
    for name in ("dev", "runtime", "bootstrap", "vllm", "nixl"):
        text = (REQ / f"{name}.txt").read_text()
        assert "make lock" in text.splitlines()[1], f"{name}.txt was not written by make lock"
        blocks = re.split(r"\n(?=[A-Za-z0-9])", text.split("\n", 2)[2])
        pins = [b for b in blocks if check_lock.PIN.match(b)]
        assert pins, name
        for block in pins:
            assert "--hash=sha256:" in block, f"{name}.txt: {block.splitlines()[0]} has no hash"


def test_locks_agree_on_what_they_share() -> None:
    dev = check_lock.read_lock(REQ / "dev.txt")
    runtime = check_lock.read_lock(REQ / "runtime.txt")
    assert set(runtime) < set(dev)
    assert all(dev[name] == version for name, version in runtime.items())
    assert (
        dev["torch"].endswith("+cpu")
        and check_lock.read_lock(REQ / "vllm.txt")["torch"] == (dev["torch"])
    )
    assert not {"torchvision", "torchaudio", "torchcodec"} & set(
        check_lock.read_lock(REQ / "vllm.txt")
    )


def test_the_lock_satisfies_pyproject() -> None:
    pins = check_lock.read_lock(REQ / "dev.txt")
    assert check_lock.pyproject_differences(ROOT / "pyproject.toml", pins, ["dev"]) == []


def test_generated_code_and_lower_bounds_agree() -> None:
    """pdx/_proto refuses a grpcio older than the grpcio-tools it came from: the bound says so."""
    from packaging.requirements import Requirement

    deps = {
        check_lock.canonical(Requirement(d).name): Requirement(d)
        for d in __import__("tomllib").loads((ROOT / "pyproject.toml").read_text())["project"][
            "dependencies"
        ]
    }
    generated = re.search(
        r"GRPC_GENERATED_VERSION = '([^']+)'", (ROOT / "pdx/_proto/serving_pb2_grpc.py").read_text()
    )
    protoc = re.search(
        r"Protobuf Python Version: (\S+)", (ROOT / "pdx/_proto/serving_pb2.py").read_text()
    )
    assert generated and protoc
    assert f">={generated.group(1)}" in str(deps["grpcio"].specifier)
    assert f">={protoc.group(1)}" in str(deps["protobuf"].specifier)
    assert check_lock.read_lock(REQ / "dev.txt")["grpcio-tools"] == generated.group(1)


def test_differences_are_named_one_per_line() -> None:
    pins = {"grpcio-tools": "1.85.4", "torch": "2.13.0+cpu", "six": "1.16.0", "numpy": "2.4.6"}
    have = {"grpcio-tools": "1.85.1", "torch": "2.13.0+cpu", "numpy": "2.4.6", "stray": "0.1"}
    assert check_lock.env_differences(pins, have, own=set()) == [
        "grpcio-tools: locked 1.85.4, installed 1.85.1",
        "six: locked 1.16.0, not installed",
        "stray: installed 0.1, not in the lock",
    ]
    assert (
        check_lock.env_differences({"pip": "1"}, {"pip": "1", "uv": "2", "pdx": "0"}, {"pdx"}) == []
    )
    assert check_lock.same_version("2.13.0", "2.13.0+cpu")
    assert not check_lock.same_version("2.13.0+cpu", "2.13.0")


def test_a_stale_lock_is_named(tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        '[project]\nname = "x"\ndependencies = ["grpcio>=1.90", "newdep>=1"]\n'
        '[project.optional-dependencies]\ndev = ["pytest>=8"]\n'
    )
    pins = {"grpcio": "1.85.4", "pytest": "9.2.0"}
    assert check_lock.pyproject_differences(pyproject, pins, ["dev"]) == [
        "grpcio: the lock's 1.85.4 is outside pyproject.toml's grpcio>=1.90",
        "newdep: in pyproject.toml (newdep>=1), not in the lock",
    ]


@pytest.mark.slow
def test_a_drifted_environment_is_refused_with_what_to_run(tmp_path: Path) -> None:
    """A real, empty venv checked against a lock it does not hold: exit 1, every package
    named, and the command that repairs it."""
    venv.create(tmp_path / "env", with_pip=False)
    lock = tmp_path / "lock.txt"
    lock.write_text("six==1.16.0 \\\n    --hash=sha256:00\n")
    proc = subprocess.run(
        [str(tmp_path / "env" / "bin" / "python"), str(SCRIPT), str(lock)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "env: six: locked 1.16.0, not installed" in proc.stderr
    assert "run `make sync` to install exactly the lock" in proc.stderr
    ok = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            str(REQ / "dev.txt"),
            "--pyproject",
            str(ROOT / "pyproject.toml"),
            "--extra",
            "dev",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr  # this suite's own environment is the lock


def test_make_test_checks_the_lock_first() -> None:
    makefile = (ROOT / "Makefile").read_text()
    test_line = re.search(r"^test:(.*)$", makefile, re.M)
    assert test_line and test_line.group(1).split()[0] == "lock-check"
    assert "scripts/check_lock.py $(LOCK)" in makefile
