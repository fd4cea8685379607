"""The library's layers, read from its source: every ``kvsnap`` import (at module level, inside
a function, or for type checking only) goes to its own layer or a lower one, and the pipeline
and the facade form no import cycle. Issue 22: the facade and the pipeline imported each other,
partly inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvsnap"
#: Lowest first: a module may import its own layer and those before it.
LAYERS = (
    ("kvsnap._version", "kvsnap.errors", "kvsnap.dtypes"),
    ("kvsnap.format", "kvsnap.layout"),
    ("kvsnap.transfer", "kvsnap.store"),
    ("kvsnap.pipeline",),
    ("kvsnap.snapshot", "kvsnap.parted", "kvsnap.analysis"),
    ("kvsnap.distributed", "kvsnap.engines", "kvsnap.foreign", "kvsnap.bench", "kvsnap.testing"),
)


def layer_of(module: str) -> int | None:
    """The layer of ``module`` (its longest listed prefix), ``None`` for one not listed."""
    matches = [
        (len(prefix), number)
        for number, prefixes in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    return max(matches)[1] if matches else None


def library_modules() -> dict[str, Path]:
    """Every module of the library by dotted name (the CLI, a separate tree, left out)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[0] == "cli":
            continue
        modules[".".join(("kvsnap", *parts)).removesuffix(".__init__")] = path
    return modules


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The library modules ``path`` imports anywhere in its source (``from a import b`` counts
    as module ``a.b`` where that is one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [
                f"{node.module}.{alias.name}"
                if f"{node.module}.{alias.name}" in modules
                else node.module
                for alias in node.names
            ]
        else:
            continue
        found.update(name for name in names if name in modules and name != "kvsnap")
    return found


def test_every_import_goes_to_the_same_layer_or_a_lower_one() -> None:
    modules = library_modules()
    upward = []
    for name, path in sorted(modules.items()):
        own = layer_of(name)
        for imported in sorted(imports_of(path, modules)):
            theirs = layer_of(imported)
            if own is not None and theirs is not None and theirs > own:
                upward.append(f"{name} imports {imported}")
    assert upward == []


def test_the_pipeline_and_the_facade_form_no_import_cycle() -> None:
    modules = library_modules()
    upper = {name for name in modules if (layer_of(name) or 0) >= layer_of("kvsnap.pipeline")}
    graph = {name: imports_of(modules[name], modules) & upper for name in upper}
    # Depth-first search; a module met again while still on the path closes a cycle.
    cycles: list[list[str]] = []
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for imported in sorted(graph[name]):
            if state.get(imported) == "open":
                cycles.append([*path[path.index(imported) :], imported])
            elif imported not in state:
                visit(imported, [*path, imported])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []
    assert "kvsnap.snapshot" not in graph["kvsnap.analysis"]
    assert {"kvsnap.snapshot", "kvsnap.analysis"}.isdisjoint(graph["kvsnap.parted"])
