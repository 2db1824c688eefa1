"""The code's rooms stay rooms: imports go one way, no cycles, no file over 400 lines.

Reads the source (every ``import``, including ones under ``TYPE_CHECKING`` and
inside functions) with :mod:`ast`; imports nothing of tiercache. The rules are
the ones each package's ``__init__`` docstring states (docs/architecture.md,
Rooms).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# source folder -> the package name it is installed as
SOURCES = {"tiercache": "tiercache", "backends": "tiercache.backends", "connector": "tiercache.connector"}
MAX_LINES = 400

# room -> rooms it must never import (prefix match on module names)
FORBIDDEN = {
    "tiercache": ("tiercache.backends", "tiercache.connector"),  # the core: no backend, no vLLM side
    "tiercache.manager": ("tiercache.transfer", "tiercache.tiers", "tiercache.pd", "tiercache.server"),
    "tiercache.transfer": ("tiercache.manager", "tiercache.pd", "tiercache.server"),
    "tiercache.tiers": ("tiercache.manager", "tiercache.transfer", "tiercache.pd", "tiercache.server"),
    "tiercache.pd": ("tiercache.manager", "tiercache.server", "tiercache.tiers"),
    "tiercache.config": ("tiercache.manager", "tiercache.transfer", "tiercache.tiers", "tiercache.pd",
                         "tiercache.server", "tiercache.cli"),
    "tiercache.backends": ("tiercache.connector", "tiercache.manager", "tiercache.transfer", "tiercache.pd"),
}


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder, package in SOURCES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The first-party modules ``name`` imports."""
    out: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


MODULES = _modules()
GRAPH = {name: _imports(name, path, set(MODULES)) for name, path in MODULES.items()}


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_the_walk_sees_the_code() -> None:
    """A guard for the guard: the graph holds the modules and edges we know are there."""
    assert "tiercache.manager.offloading" in GRAPH and "tiercache.backends.lmdb.backend" in GRAPH
    assert "tiercache.manager.cascade" in GRAPH["tiercache.manager.offloading"]
    assert "tiercache.backend" in GRAPH["tiercache.backends.disk.backend"]


def test_no_import_cycles() -> None:
    assert _cycles() == []


def test_a_cycle_would_be_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: the manager<->cascade cycle this restructuring removed, put back."""
    cascade = "tiercache.manager.cascade"
    monkeypatch.setitem(GRAPH, cascade, GRAPH[cascade] | {"tiercache.manager.offloading"})
    assert ["tiercache.manager.cascade", "tiercache.manager.offloading"] in _cycles()


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_imports_go_one_way(room: str) -> None:
    def in_room(module: str, prefix: str) -> bool:
        return module == prefix or module.startswith(prefix + ".")

    wrong = []
    for name, imported in GRAPH.items():
        if not in_room(name, room):
            continue
        if room == "tiercache" and any(in_room(name, r) for r in ("tiercache.backends", "tiercache.connector")):
            continue  # the installed sub-packages are rooms of their own
        for target in imported:
            if any(in_room(target, banned) for banned in FORBIDDEN[room]):
                wrong.append(f"{name} -> {target}")
    assert wrong == []


def test_no_file_is_over_the_line_limit() -> None:
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
