"""Imports point down, and no module cycles (docs/ARCHITECTURE.md, "Layers").

Every module of the package is parsed with ``ast`` and every import counts: module level,
inside functions, under ``TYPE_CHECKING``. The layers, top to bottom:

0. ``cli``, ``__main__``
1. ``commands``, ``plot``, ``client`` (the library for trainers that run elsewhere)
2. ``daemon`` (module or package)
3. ``process/``, ``control``, ``systemd``, ``cluster/`` (the endpoint between the nodes of a job)
4. the child programs and the trainer: ``api/``, ``inference/``, ``envs/``, ``trainer/``
5. ``weights/``, ``models/``
6. ``config``, ``paths``, ``pids``, ``logs`` and the other shared leaves at the top level

A module may import its own group (its package, or itself at the top level) and any lower
layer; never a higher layer, and never another group of its own layer (sideways), except the
shared wire formats (``api.schema``, ``inference.schema``), which any module of their layer or
above may import. On top of that, the explicit rules: nothing in ``api/``, ``inference/``,
``envs/``, ``trainer/``, ``weights/`` or ``models/`` imports ``cli``, ``commands`` or ``daemon``;
nothing in ``api/``, ``inference/``, ``trainer/`` or ``weights/`` imports ``process/``. And no two
modules import each other through any chain.
"""

from __future__ import annotations

import ast
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "atroposd"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

LAYERS: tuple[tuple[str, ...], ...] = (
    ("cli", "__main__"),
    ("commands", "plot", "client"),
    ("daemon",),
    ("process", "control", "systemd", "cluster"),
    ("api", "inference", "envs", "trainer"),
    ("weights", "models"),
)
BOTTOM = len(LAYERS)  # every other top-level module: config, paths, pids, logs, exitcodes, ...

# Wire formats shared across a layer: importable sideways and from above.
SHARED = frozenset({"atroposd.api.schema", "atroposd.inference.schema"})

# A module of one of these groups never imports a module of the named groups.
FORBIDDEN: tuple[tuple[frozenset[str], frozenset[str]], ...] = (
    (frozenset({"api", "inference", "envs", "trainer", "weights", "models"}), frozenset({"cli", "commands", "daemon"})),
    (frozenset({"api", "inference", "trainer", "weights"}), frozenset({"process"})),
)


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int

    def __str__(self) -> str:
        return f"{self.src} -> {self.dst} ({_file(self.src)}:{self.line})"


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _file(module: str) -> str:
    return str(MODULES[module].relative_to(ROOT.parent))


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _resolve(src: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``from X import ...`` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = src.split(".") if _is_package(src) else src.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(name: str) -> list[str]:
    """The package modules that importing ``name`` runs: itself (or its nearest module) and
    every package ``__init__`` on the way down."""
    parts = name.split(".")
    out = []
    for i in range(2, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if prefix in MODULES and _is_package(prefix) and prefix != name:
            out.append(prefix)
    while parts and ".".join(parts) not in MODULES:
        parts.pop()
    if parts:
        out.append(".".join(parts))
    return out


def _edges() -> list[Edge]:
    edges: list[Edge] = []
    for src, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mod = _resolve(src, node)
                names = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
            for name in names:
                if name != PACKAGE and not name.startswith(PACKAGE + "."):
                    continue
                for dst in _targets(name):
                    # A package's own __init__ runs before its modules: not an edge back up.
                    if dst != src and not (_is_package(dst) and src.startswith(dst + ".")):
                        edges.append(Edge(src, dst, node.lineno))
    return edges


EDGES = _edges()


def group(module: str) -> str:
    """``atroposd.api.server`` → ``api``; ``atroposd.config`` → ``config``; the package → ``""``."""
    parts = module.split(".")
    g = parts[1] if len(parts) > 1 else ""
    return "cli" if g == "__main__" else g  # the entry point and the parser are one group


def layer(module: str) -> int:
    g = group(module)
    for i, names in enumerate(LAYERS):
        if g in names:
            return i
    return BOTTOM


def layer_violations() -> list[str]:
    # One finding per import statement and reason, naming the deepest module it reaches
    # (``from atroposd.process import reaper`` also runs ``process/__init__``).
    found: dict[tuple[str, int, str], Edge] = {}
    for e in EDGES:
        gs, gd = group(e.src), group(e.dst)
        reasons = [f"{gs}/ must not import {gd}" for srcs, dsts in FORBIDDEN if gs in srcs and gd in dsts]
        if gs != gd:
            ls, ld = layer(e.src), layer(e.dst)
            if ld < ls:
                reasons.append(f"imports up (layer {ls} -> layer {ld})")
            elif ld == ls and ls != BOTTOM and e.dst not in SHARED:
                reasons.append(f"imports sideways ({gs} -> {gd}, both layer {ls})")
        for reason in reasons:
            key = (e.src, e.line, reason)
            if key not in found or len(e.dst) > len(found[key].dst):
                found[key] = e
    return sorted(f"{e}: {reason}" for (_, _, reason), e in found.items())


def cycles() -> list[list[str]]:
    """The cycles of every strongly connected component of more than one module: the shortest
    cycle through each of its modules (so two cycles sharing a module are both shown)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for e in EDGES:
        graph[e.src].add(e.dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[list[str]] = []
    counter = 0

    def strongconnect(v: str) -> None:  # Tarjan, iterative enough for this package's depth
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    found: dict[tuple[str, ...], list[str]] = {}
    for comp in sccs:
        for start in comp:
            cycle = _shortest_cycle(graph, set(comp), start)
            i = cycle.index(min(cycle[:-1]))
            rotated = cycle[i:-1] + cycle[:i] + [cycle[i]]
            found.setdefault(tuple(rotated), rotated)
    return sorted(found.values())


def _shortest_cycle(graph: dict[str, set[str]], members: set[str], start: str) -> list[str]:
    """A shortest cycle through ``start`` inside its component (breadth-first)."""
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is on no cycle")  # pragma: no cover - a component always has one


def _describe(cycle: list[str]) -> str:
    lines = {(e.src, e.dst): e.line for e in EDGES}
    return (
        " -> ".join(cycle)
        + "\n      "
        + "\n      ".join(f"{a} -> {b} at {_file(a)}:{lines[(a, b)]}" for a, b in itertools.pairwise(cycle))
    )


# ----------------------------------------------------------------------------- the checks


def test_imports_point_down() -> None:
    found = layer_violations()
    assert not found, "imports that break a layer rule:\n  " + "\n  ".join(found)


def test_no_import_cycles() -> None:
    found = cycles()
    assert not found, "import cycles:\n  " + "\n  ".join(_describe(c) for c in found)


# The packages whose __init__ is a facade for code outside them (the library for trainers that
# run elsewhere; the cluster endpoint the daemon uses; the config); nothing inside them imports
# through it.
FACADES = frozenset({"atroposd.client", "atroposd.cluster", "atroposd.config"})


def test_a_package_init_imports_nothing_of_its_package() -> None:
    # A module of the package importing a sibling runs the package's __init__ first: an __init__
    # that imported the package's modules back would put every one of them in a circle with it.
    found = [
        str(e)
        for e in EDGES
        if _is_package(e.src) and e.src != PACKAGE and e.src not in FACADES and e.dst.startswith(e.src + ".")
    ]
    assert not found, "package __init__ files that import their own modules:\n  " + "\n  ".join(found)
    inside = [str(e) for e in EDGES if e.dst in FACADES and e.src.startswith(e.dst + ".")]
    inside += _imports_through_own_facade()
    assert not inside, "modules that import their own package's facade:\n  " + "\n  ".join(inside)


def _imports_through_own_facade() -> list[str]:
    """Imports by a module of a facade package that name the facade itself (``from
    atroposd.config import Config`` inside atroposd/config/), which EDGES leaves out (an edge to
    one's own package __init__ is not one back up)."""
    found = []
    for src, path in MODULES.items():
        facade = next((f for f in FACADES if src.startswith(f + ".")), None)
        if facade is None:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.ImportFrom) and _resolve(src, node) == facade:
                names = [a.name for a in node.names if f"{facade}.{a.name}" not in MODULES]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name == facade]
            else:
                continue
            found += [f"{_file(src)}:{node.lineno} imports {name} through {facade}" for name in names]
    return found


# ----------------------------------------------------------------------------- the checker itself


def test_every_kind_of_import_is_seen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Imports inside functions, under TYPE_CHECKING and relative ones are edges; a cycle and
    an upward import are reported (the checks above can fail)."""
    pkg = tmp_path / PACKAGE
    (pkg / "api").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "api" / "__init__.py").write_text("")
    (pkg / "cli.py").write_text("from atroposd.api import app\n")
    (pkg / "config.py").write_text("def f():\n    import atroposd.paths\n")
    (pkg / "paths.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from atroposd import config\n"
    )
    (pkg / "api" / "app.py").write_text("def main():\n    from ..cli import build\n")
    (pkg / "api" / "schema.py").write_text("from . import app\n")
    modules = {}
    for path in sorted(pkg.rglob("*.py")):
        parts = list(path.relative_to(tmp_path).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    this = sys.modules[__name__]
    monkeypatch.setattr(this, "MODULES", modules)
    monkeypatch.setattr(this, "ROOT", pkg)
    edges = _edges()
    monkeypatch.setattr(this, "EDGES", edges)
    pairs = {(e.src, e.dst) for e in edges}
    assert ("atroposd.config", "atroposd.paths") in pairs  # inside a function
    assert ("atroposd.paths", "atroposd.config") in pairs  # under TYPE_CHECKING
    assert ("atroposd.api.app", "atroposd.cli") in pairs  # relative, two levels
    assert ("atroposd.api.schema", "atroposd.api.app") in pairs  # from . import module
    assert ("atroposd.cli", "atroposd.api") in pairs  # the package __init__ runs too
    found = layer_violations()
    assert any("atroposd.api.app -> atroposd.cli" in v and "api/ must not import cli" in v for v in found)
    assert any("atroposd.api.app -> atroposd.cli" in v and "imports up" in v for v in found)
    cyc = cycles()
    assert sorted(map(tuple, cyc)) == [
        ("atroposd.api.app", "atroposd.cli", "atroposd.api.app"),
        ("atroposd.config", "atroposd.paths", "atroposd.config"),
    ]


def test_the_architecture_document_names_every_module() -> None:
    # docs/ARCHITECTURE.md's package layout is where a reader looks a module up
    text = (ROOT.parent / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    missing = [
        str(path.relative_to(ROOT.parent))
        for path in MODULES.values()
        if path.name != "__init__.py" and path.name not in text
    ]
    assert not missing, "modules docs/ARCHITECTURE.md does not name:\n  " + "\n  ".join(missing)
