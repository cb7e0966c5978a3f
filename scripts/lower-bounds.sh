#!/usr/bin/env bash
# Check pyproject.toml's lower bounds (`make lower-bounds`): install pdx into a throwaway venv
# with every direct dependency at the lowest version its range allows (uv's
# --resolution lowest-direct; torch is the CPU build, the only one the range admits), then import
# every pdx module, run `pdx --help`, and, given pytest arguments, those tests too.
#
#   scripts/lower-bounds.sh [PYTEST ARGS...]     UV (default .venv/bin/uv), PYTHON, KEEP=DIR
# Exit 0: the lowest set installs, imports and passes; else the failing step says why.
set -euo pipefail
cd "$(dirname "$0")/.."
UV=${UV:-.venv/bin/uv}
PYTHON=${PYTHON:-python3}
[ -x "$UV" ] || { echo "error: no uv at $UV (make install bootstraps it)" >&2; exit 2; }
work=${KEEP:-$(mktemp -d)}
mkdir -p "$work"
[ -n "${KEEP:-}" ] || trap 'rm -rf "$work"' EXIT
links=()
for dir in $(PYTHON=$PYTHON scripts/pip-find-links); do links+=(--find-links "$dir"); done

t0=$(date +%s)
torch=$(sed -n 's/^\(torch==[^ ]*\).*/\1/p' requirements/dev.txt)
echo "$torch" > "$work/torch.txt"
"$UV" pip compile --quiet pyproject.toml --extra dev --resolution lowest-direct \
  --python-version 3.11 --override "$work/torch.txt" "${links[@]}" -o "$work/lowest.txt"
rm -rf "$work/venv"
"$UV" venv --quiet --python "$PYTHON" "$work/venv"
"$UV" pip sync --quiet --python "$work/venv/bin/python" "${links[@]}" "$work/lowest.txt"
"$UV" pip install --quiet --no-deps --python "$work/venv/bin/python" -e .
echo "lower bounds: $(grep -cE '^[a-z0-9]' "$work/lowest.txt") packages installed in $(($(date +%s) - t0)) s" >&2
# the direct dependencies as installed (each at its lower bound)
"$work/venv/bin/python" - <<'EOF'
import importlib.metadata as md, re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = project["dependencies"] + project["optional-dependencies"]["dev"]
names = [re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0] for r in reqs]
print("lowest:", ", ".join(f"{n} {md.version(n)}" for n in names))
EOF
"$work/venv/bin/python" - <<'EOF'
import importlib, pkgutil, pdx
mods = [m.name for m in pkgutil.walk_packages(pdx.__path__, "pdx.") if m.name != "pdx.__main__"]
for name in mods:
    importlib.import_module(name)
print(f"imported {len(mods)} pdx modules")
EOF
"$work/venv/bin/pdx" --help >/dev/null 2>&1 || { echo "error: pdx --help failed with the lowest set" >&2; "$work/venv/bin/pdx" --help | tail -5; exit 1; }
echo "pdx --help: ok" >&2
if [ $# -gt 0 ]; then
  "$work/venv/bin/python" -m pytest "$@"
fi
