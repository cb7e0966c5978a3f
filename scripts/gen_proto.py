"""Generate pdx/_proto/ from contracts/*.proto with grpcio-tools. The ONE generator.

Usage: ``python scripts/gen_proto.py [--out DIR]`` (default: pdx/_proto). Output is
deterministic for a given grpcio-tools version, so CI regenerates into a temporary
directory and diffs (``make proto-check``). Generated files are never edited by hand.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONTRACTS = ROOT / "contracts"
PACKAGE = "pdx._proto"
INIT_TEXT = '"""Generated from contracts/*.proto by scripts/gen_proto.py. Do not edit."""\n'


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on every contract into ``out_dir``; return the files written."""
    from grpc_tools import protoc  # dev dependency, only needed here

    protos = sorted(p.name for p in CONTRACTS.glob("*.proto"))
    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{CONTRACTS}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {protos}")
    (out_dir / "__init__.py").write_text(INIT_TEXT)
    modules = [Path(p).stem + "_pb2" for p in protos]
    for path in sorted(out_dir.glob("*_pb2*.py")):
        _absolute_imports(path, modules)
    return sorted(out_dir.iterdir())


def _absolute_imports(path: Path, modules: list[str]) -> None:
    """protoc writes ``import x_pb2 as ...``; make it ``from pdx._proto import x_pb2 as ...``."""
    text = path.read_text()
    for mod in modules:
        text = re.sub(rf"^import {mod} as ", f"from {PACKAGE} import {mod} as ", text, flags=re.M)
    path.write_text(text)


def main() -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "pdx" / "_proto")
    args = parser.parse_args()
    for path in generate(args.out):
        print(path.relative_to(args.out.parent) if path.is_relative_to(ROOT) else path)


if __name__ == "__main__":
    sys.exit(main())
