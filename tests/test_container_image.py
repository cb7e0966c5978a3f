"""The container image recipe (Containerfile, scripts/build-image.sh), checked without building.

The builder and mmdebstrap are replaced by stubs on PATH, so the plan is tested on any machine;
one slow test really builds the image when PDX_IMAGE_TEST=1.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "build-image.sh"
CONTAINERFILE = ROOT / "Containerfile"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _stages() -> list[str]:
    return re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", CONTAINERFILE.read_text(), re.M | re.I)


def _stub(bin_dir: Path, name: str, info_rc: int, message: str = "") -> None:
    """A fake builder whose `info` answers with info_rc (and message on stderr)."""
    path = bin_dir / name
    path.write_text(f'#!/bin/sh\n[ "$1" = info ] && {{ echo "{message}" >&2; exit {info_rc}; }}\n')
    path.chmod(0o755)


def _dry_run(
    tmp_path: Path, builders: dict[str, int], *args: str, **env: str
) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, rc in builders.items():
        _stub(bin_dir, name, rc, f"{name} cannot answer here")
    _stub(bin_dir, "mmdebstrap", 0)
    full_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": sys.executable}
    full_env.pop("BASE_IMAGE", None)
    full_env.pop("BUILDER", None)
    full_env.update(env)
    return subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_image_installs_exactly_the_runtime_lock() -> None:
    text = CONTAINERFILE.read_text()
    assert "--require-hashes" in text and "-r /wheels/requirements.txt" in text
    assert "ARG TORCH" not in text  # torch comes from the lock like everything else
    torch = re.findall(r"^torch==(\S+)", (ROOT / "requirements" / "runtime.txt").read_text(), re.M)
    assert torch and torch[0].endswith("+cpu"), "the image's torch is the CPU build"


def test_stages_and_entrypoint() -> None:
    stages = _stages()
    assert {"base", "build", "pdx", "vllm-build", "vllm", "runtime"} <= set(stages)
    assert stages[-1] == "runtime", "the default target (the last stage) is the plain pdx image"
    text = CONTAINERFILE.read_text()
    assert 'ENTRYPOINT ["pdx"]' in text
    assert 'CMD ["--help"]' in text
    # pip never reaches an index inside the build: the wheelhouse only
    assert text.count("PIP_NO_INDEX=1") == 2


def test_copied_paths_are_in_the_build_context() -> None:
    allowed = [
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    sources = re.findall(r"^COPY\s+(?!--from)(\S+)\s", CONTAINERFILE.read_text(), re.M)
    assert sources
    for source in sources:
        assert source.rstrip("/") in allowed, f"{source} is excluded by .dockerignore"
        if not source.startswith("build/"):
            assert (ROOT / source).exists(), source


def test_plan_skips_a_docker_without_daemon(tmp_path: Path) -> None:
    proc = _dry_run(tmp_path, {"docker": 1, "podman": 0, "buildah": 0})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "skipping docker:" in out and "docker cannot answer here" in out
    assert "builder: podman" in out
    assert (
        "pip download --quiet --no-deps --require-hashes --dest build/image/wheels"
        " -r requirements/runtime.txt" in out
    )
    assert "pip wheel --quiet --no-deps --wheel-dir build/image/wheels ./build/image/src" in out
    assert "mmdebstrap --quiet --variant=apt" in out and " bookworm build/image/rootfs.tar " in out
    assert "podman import build/image/rootfs.tar localhost/pdx-base:bookworm" in out
    build = next(line for line in out.splitlines() if "podman build" in line)
    assert "--network=none" in build and "--target runtime" in build
    assert "BASE_IMAGE=localhost/pdx-base:bookworm" in build


def test_plan_without_any_builder_says_why(tmp_path: Path) -> None:
    proc = _dry_run(tmp_path, {"docker": 1, "podman": 125, "buildah": 1})
    assert proc.returncode == 2
    for name in ("docker", "podman", "buildah"):
        assert f"skipping {name}:" in proc.stdout
    assert "no builder could run" in proc.stdout
    assert "build-image: building" not in proc.stdout


def test_plan_with_a_pulled_base(tmp_path: Path) -> None:
    proc = _dry_run(tmp_path, {"docker": 0}, BUILDER="docker", BASE_IMAGE="debian:bookworm-slim")
    assert proc.returncode == 0, proc.stderr
    assert "builder: docker" in proc.stdout
    assert "mmdebstrap" not in proc.stdout
    build = next(line for line in proc.stdout.splitlines() if "docker build" in line)
    assert "BASE_IMAGE=debian:bookworm-slim" in build
    assert "--network=none" not in build  # its base stage may need apt for missing tools


def test_vllm_plan_uses_the_vllm_env_locks(tmp_path: Path) -> None:
    proc = _dry_run(tmp_path, {"docker": 1, "podman": 0}, "--target", "vllm")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert (
        "pip download --quiet --no-deps --require-hashes --dest build/image/wheels-vllm"
        " -r requirements/vllm.txt -r requirements/nixl.txt" in out
    )
    build = next(line for line in out.splitlines() if "podman build" in line)
    assert "--target vllm" in build and "-t pdx:vllm" in build
    script = (ROOT / "scripts" / "vllm-env.sh").read_text()
    assert "requirements/vllm.txt" in script and "requirements/nixl.txt" in script


def test_plan_on_this_machine() -> None:
    """No stubs: whatever this machine has, the plan names a builder or says why there is none."""
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode in (0, 2), proc.stderr
    assert "builder:" in proc.stdout or "no builder could run" in proc.stdout or proc.stderr


def test_bad_target_is_refused() -> None:
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "--target", "gpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "--target must be runtime or vllm" in proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("PDX_IMAGE_TEST") != "1", reason="set PDX_IMAGE_TEST=1")
def test_build_and_run_the_image() -> None:
    """The real build (minutes, about 2 GB), then `pdx --help` inside the image."""
    proc = subprocess.run(
        ["bash", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=3600
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    run_line = next(line for line in proc.stdout.splitlines() if "run it:" in line)
    command = run_line.split("run it: ", 1)[1].split()
    help_proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert help_proc.returncode == 0, help_proc.stderr
    assert "accept" in help_proc.stdout and "deploy" in help_proc.stdout
