"""Imports of the inference server and the weight exchange point down (every import counts:
module level, inside functions, under TYPE_CHECKING): nothing in ``inference/`` or
``weights/`` (nor the leaves they use) imports the supervisor or the command line, and no
module of theirs takes part in an import cycle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "atroposd"
AREA = ("atroposd.inference", "atroposd.weights", "atroposd.devices", "atroposd.shmscan", "atroposd.pids")
FORBIDDEN = ("atroposd.cli", "atroposd.commands", "atroposd.daemon", "atroposd.process", "atroposd.plot",
             "atroposd.__main__")


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package.split(".")[:len(package.split(".")) - node.level + 1], base]).strip(".")
                deps.add(base)
                deps.update(f"{base}.{a.name}" for a in node.names)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def _in_area(name: str) -> bool:
    return any(name == a or name.startswith(a + ".") for a in AREA)


def test_no_upward_imports() -> None:
    bad = sorted((src, dst) for src, deps in _graph().items() if _in_area(src)
                 for dst in deps if any(dst == f or dst.startswith(f + ".") for f in FORBIDDEN))
    assert not bad, bad


def test_no_cycles_through_the_area() -> None:
    graph = _graph()
    cycles: list[list[str]] = []
    for start in sorted(n for n in graph if _in_area(n)):
        stack: list[tuple[str, list[str]]] = [(start, [start])]
        seen: set[str] = set()
        while stack:
            node, path = stack.pop()
            for dep in graph.get(node, ()):
                if dep == start:
                    cycles.append(path)
                elif dep not in seen:
                    seen.add(dep)
                    stack.append((dep, [*path, dep]))
    assert not cycles, cycles
