"""Check that an environment holds exactly a lock file's versions (`make test` runs it first).

Usage: ``python scripts/check_lock.py LOCK... [--pyproject pyproject.toml] [--fix "make sync"]``,
run with the environment's own interpreter. Fails (exit 1, one line per difference) when a
locked package is missing or at another version, or when a package the lock does not name is
installed (pip, uv and the project itself excepted); with ``--pyproject``, also when the lock
no longer satisfies pyproject.toml's ranges (someone changed a dependency without
``make lock``). Standard library only, so it runs in any environment, .venv-vllm included.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

# Installers seeded into a venv and kept by `uv pip sync`; the bootstrap lock pins uv.
UNLOCKED_OK = {"pip", "uv"}
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)")


def canonical(name: str) -> str:
    """PEP 503 name normalisation (the form pip and uv compare)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> dict[str, str]:
    """``{name: version}`` of every ``name==version`` line of a compiled lock file."""
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        match = PIN.match(line)
        if match:
            pins[canonical(match.group(1))] = match.group(2)
    if not pins:
        raise SystemExit(f"error: {path}: no name==version lines (is it a compiled lock?)")
    return pins


def installed() -> dict[str, str]:
    """``{name: version}`` of every distribution importable from this interpreter."""
    found: dict[str, str] = {}
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name:
            found[canonical(name)] = dist.version
    return found


def same_version(locked: str, have: str) -> bool:
    """A lock without a local label (``2.13.0``) accepts a local build of it (``2.13.0+cpu``)."""
    return have == locked or ("+" not in locked and have.split("+", 1)[0] == locked)


def env_differences(pins: dict[str, str], have: dict[str, str], own: set[str]) -> list[str]:
    """One line per package whose installed state differs from the lock."""
    problems = []
    for name, version in sorted(pins.items()):
        if name not in have:
            problems.append(f"{name}: locked {version}, not installed")
        elif not same_version(version, have[name]):
            problems.append(f"{name}: locked {version}, installed {have[name]}")
    for name in sorted(set(have) - set(pins) - UNLOCKED_OK - own):
        problems.append(f"{name}: installed {have[name]}, not in the lock")
    return problems


def pyproject_differences(pyproject: Path, pins: dict[str, str], extras: list[str]) -> list[str]:
    """One line per pyproject.toml requirement that the lock's pin does not satisfy."""
    from packaging.requirements import Requirement  # in every lock pdx has: pip's own

    project = tomllib.loads(pyproject.read_text())["project"]
    wanted = list(project.get("dependencies", []))
    for extra in extras:
        wanted += project.get("optional-dependencies", {}).get(extra, [])
    problems = []
    for text in wanted:
        req = Requirement(text)
        pin = pins.get(canonical(req.name))
        if pin is None:
            problems.append(f"{req.name}: in {pyproject.name} ({text}), not in the lock")
        elif not req.specifier.contains(pin, prereleases=True):
            problems.append(f"{req.name}: the lock's {pin} is outside {pyproject.name}'s {text}")
    return problems


def main() -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("locks", type=Path, nargs="+", metavar="LOCK")
    parser.add_argument("--pyproject", type=Path, help="also check the lock against its ranges")
    parser.add_argument("--extra", action="append", default=[], help="pyproject extras locked")
    parser.add_argument("--fix", default="make sync", help="the command that repairs the env")
    args = parser.parse_args()
    pins: dict[str, str] = {}
    for lock in args.locks:
        pins.update(read_lock(lock))
    named = " + ".join(str(lock) for lock in args.locks)
    own: set[str] = set()
    stale: list[str] = []
    if args.pyproject:
        own.add(canonical(tomllib.loads(args.pyproject.read_text())["project"]["name"]))
        stale = pyproject_differences(args.pyproject, pins, args.extra)
    drift = env_differences(pins, installed(), own)
    for line in stale:
        print(f"lock: {line}", file=sys.stderr)
    if stale:
        print(f"error: {named} is stale for {args.pyproject}: run `make lock`", file=sys.stderr)
    for line in drift:
        print(f"env: {line}", file=sys.stderr)
    if drift:
        where = Path(sys.prefix).name
        print(
            f"error: {where} differs from {named} in {len(drift)} package(s): "
            f"run `{args.fix}` to install exactly the lock",
            file=sys.stderr,
        )
    return 1 if stale or drift else 0


if __name__ == "__main__":
    sys.exit(main())
