"""The package's shape: no import cycles among pdx modules, and each layer imports only below it.

Imports are read with ``ast`` from the source (every ``import`` and ``from ... import``,
function-level ones included). The layer rules look at what runs (imports under
``if TYPE_CHECKING:`` left out); the cycle check counts those too, since a type-only import
back up is still a back-pointer. docs/architecture.md states the same rules for people.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "pdx"

# What each package may import from pdx (besides itself and the bottom layer).
BOTTOM = {"pdx", "pdx._proto", "pdx.config", "pdx.errors", "pdx.netaddr", "pdx.procs", "pdx.tcp",
          "pdx.tls", "pdx.units"}  # fmt: skip
ALLOWED: dict[str, set[str]] = {
    "pdx.kv": set(),
    "pdx.traces": set(),
    "pdx.sim": {"pdx.kv", "pdx.traces"},
    "pdx.faults": set(),
    "pdx.transfer": {"pdx.kv"},
    "pdx.link": {"pdx.transfer"},
    "pdx.serving": {"pdx.kv", "pdx.transfer", "pdx.faults"},
    "pdx.accept": {
        "pdx.kv",
        "pdx.traces",
        "pdx.sim",
        "pdx.link",
        "pdx.faults",
        "pdx.serving",
        "pdx.transfer",
    },
    "pdx.cli": {
        "pdx.kv",
        "pdx.traces",
        "pdx.sim",
        "pdx.faults",
        "pdx.transfer",
        "pdx.link",
        "pdx.serving",
        "pdx.accept",
    },
}
# pdx.accept drives a deployment through the `pdx deploy` command; of pdx.serving it needs
# only the deploy config's schema (offload policies included) and the embedded model configs.
ACCEPT_MAY_USE = {"pdx.serving.deploy_config", "pdx.serving.offload_config",
                  "pdx.serving.backends.presets"}  # fmt: skip


def _modules() -> dict[str, tuple[Path, bool]]:
    mods = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts.pop()
        mods[".".join(parts)] = (path, is_pkg)
    return mods


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", "")
            if name == "TYPE_CHECKING":
                for stmt in node.body:
                    skip.update(id(n) for n in ast.walk(stmt))
    return skip


def _targets(
    mod: str, is_pkg: bool, node: ast.Import | ast.ImportFrom, mods: set[str]
) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        prefix = ".".join([*base, *([node.module] if node.module else [])])
    else:
        prefix = node.module or ""
    # `from a.b import c` imports module a.b.c when there is one, else names of a.b
    return [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in mods else prefix for a in node.names]


@functools.cache  # read once per mode: every test below only looks at it
def import_graph(*, type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the pdx modules it imports (at run time; also for type checking if asked)."""
    mods = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for mod, (path, is_pkg) in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skip = set() if type_checking else _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom) or id(node) in skip:
                continue
            for target in _targets(mod, is_pkg, node, set(mods)):
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != mod and target.startswith("pdx"):
                    graph[mod].add(target)
        graph.setdefault(mod, set())
    return dict(graph)  # a plain dict: looking up a module it lacks must not add one


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def _package(mod: str) -> str:
    return ".".join(mod.split(".")[:2])


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_reader_sees_function_level_imports_and_skips_type_checking() -> None:
    graph = import_graph()
    # pdx.transfer.objects imports the codec registry inside a method
    assert "pdx.kv.codecs" in graph["pdx.transfer.objects"]
    # pdx.transfer.dataplane.server names KVService only for type checking
    assert "pdx.transfer.service" not in graph["pdx.transfer.dataplane.server"]


def test_no_import_cycles_among_pdx_modules() -> None:
    found = cycles(import_graph())
    assert found == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_cycles_even_through_type_only_imports() -> None:
    found = cycles(import_graph(type_checking=True))
    assert found == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_type_checking_reader_sees_type_only_imports() -> None:
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pdx.errors import X\n"
    tree = ast.parse(src)
    skipped = _type_checking_nodes(tree)
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert [n.module for n in imports if id(n) in skipped] == ["pdx.errors"]


def test_the_bottom_layer_imports_only_the_bottom_layer() -> None:
    graph = import_graph(type_checking=True)
    bad = sorted(
        f"{mod} -> {target}"
        for mod, targets in graph.items()
        if _package(mod) in BOTTOM and mod != "pdx"
        for target in targets
        if _package(target) not in BOTTOM
    )
    assert bad == [], f"the bottom layer imports above itself: {bad}"


def test_every_package_declares_its_public_surface() -> None:
    missing = []
    for path in sorted(PKG.rglob("__init__.py")):
        if "_proto" in path.parts:
            continue
        tree = ast.parse(path.read_text())
        names = {t.id for n in tree.body if isinstance(n, ast.Assign | ast.AnnAssign)
                 for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                 if isinstance(t, ast.Name)}  # fmt: skip
        if "__all__" not in names:
            missing.append(str(path.relative_to(PKG.parent)))
    assert missing == [], f"packages without __all__: {missing}"


def test_no_module_over_700_lines() -> None:
    long = sorted(
        f"{p.relative_to(PKG.parent)} ({n})"
        for p in PKG.rglob("*.py")
        if "_proto" not in p.parts and (n := len(p.read_text().splitlines())) > 700
    )
    assert long == [], f"split these by role: {long}"


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_layer_imports_only_what_it_may(package: str) -> None:
    graph = import_graph()
    allowed = ALLOWED[package] | BOTTOM | {package}
    bad = sorted(
        f"{mod} -> {target}"
        for mod, targets in graph.items()
        if _package(mod) == package
        for target in targets
        if _package(target) not in allowed
    )
    assert bad == [], f"{package} imports above its layer: {bad}"


def test_accept_uses_only_the_deploy_schema_of_serving() -> None:
    graph = import_graph()
    used = {
        target
        for mod, targets in graph.items()
        if _package(mod) == "pdx.accept"
        for target in targets
        if _package(target) == "pdx.serving"
    }
    assert used <= ACCEPT_MAY_USE, sorted(used - ACCEPT_MAY_USE)


def test_every_package_is_in_the_layer_table() -> None:
    packages = {_package(m) for m in import_graph() if m.count(".") >= 1}
    packages -= BOTTOM | {"pdx.__main__"}
    assert packages <= set(ALLOWED), sorted(packages - set(ALLOWED))
