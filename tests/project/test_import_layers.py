"""The import-layer contract: kvsnap's packages import only downwards, and never in a cycle.

The layers, lowest first (docs/architecture.md draws them)::

    errors, dtypes, caches,            nothing of kvsnap's but each other
    host_registration
    format, layout, encoding           format may read layout, never the other way round;
                                       encoding reads neither (bytes and tensors in memory)
    transfer, store                    store may use transfer's pinned memory; transfer never store
    pipeline                           the one staging loop
    snapshot, parted, analysis         the facade; analysis reads a Protocol, not the facade
    distributed, engines, foreign,     clients of the public API
    testing, bench, cli

Inside ``kvsnap.store`` the rooms (sub-packages) have an order of their own
(:data:`STORE_ROOMS`, each with its reason). Loops are refused everywhere, counting the imports
under ``if TYPE_CHECKING:`` too (see the loop test's docstring).

Every ``kvsnap`` import counts, at module level or inside a function. A function-level
``kvsnap`` import is refused outside the CLI (whose commands import the library inside the
command so that ``--help`` starts without torch) and the few places named below, each with its
reason: lazy exports, and the facade's torch-free start for ``inspect`` and ``verify``.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: Layer of each top-level part of the package (``kvsnap.X`` for a module or package X).
LAYER = {
    "_version": 0,
    "errors": 0,
    "dtypes": 0,
    "caches": 0,
    "host_registration": 0,
    "format": 1,
    "layout": 1,
    "encoding": 1,
    "transfer": 2,
    "store": 2,
    "pipeline": 3,
    "snapshot": 4,
    "snapshot_capture": 4,
    "snapshot_tensors": 4,
    "snapshot_signatures": 4,
    "parted": 4,
    "encoded": 4,
    "analysis": 4,
    "distributed": 5,
    "engines": 5,
    "foreign": 5,
    "testing": 5,
    "bench": 5,
    "cli": 6,
}

#: Imports between parts of one layer that the drawing forbids: (importer, imported).
SIDEWAYS_FORBIDDEN = {
    ("layout", "format"),
    ("encoding", "format"),
    ("encoding", "layout"),
    ("transfer", "store"),
    ("parted", "snapshot"),
    ("analysis", "snapshot"),
    ("analysis", "parted"),
}

#: Modules allowed a function-level ``kvsnap`` import, and why.
LATE_IMPORTS_ALLOWED = {
    # The lazy exports: ``import kvsnap`` and ``kvsnap.foreign`` stay cheap for the CLI.
    "kvsnap",
    "kvsnap.foreign",
    # pytest loads the plugin in every session; the golden check imports torch only when used.
    "kvsnap.testing.plugin",
}

#: Function-level imports that keep torch out of a light start-up: ``kvsnap inspect`` and
#: ``kvsnap verify`` open and check snapshots through ``Snapshot`` and the store's reader
#: without torch (tests/cli/test_startup.py); the parts that move or compare KV need it and
#: are imported by the calls that do. Each is downwards, so no cycle hides behind one.
TORCH_FREE_START = {
    "kvsnap.snapshot": {
        "kvsnap.analysis",
        "kvsnap.encoded.device_restore",
        "kvsnap.encoded.opening",
        "kvsnap.encoded.write",
        "kvsnap.layout",
        "kvsnap.parted",
        "kvsnap.pipeline",
        "kvsnap.pipeline.options",
    },
    # The facade's capture and its tensor reads, imported by kvsnap.snapshot at its start.
    "kvsnap.snapshot_capture": {
        "kvsnap.encoded.capture",
        "kvsnap.layout",
        "kvsnap.parted",
        "kvsnap.pipeline",
        "kvsnap.pipeline.options",
    },
    "kvsnap.snapshot_tensors": {"kvsnap.analysis"},
    "kvsnap.store.write.slot_writes": {"kvsnap.transfer.pinned"},
    # An encoded snapshot's lossless pages decode without torch; only fp8 pages need it.
    "kvsnap.encoded.read": {"kvsnap.encoded.fp8_pages"},
    "kvsnap.encoded.summary": {"kvsnap.encoding.measure"},
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((REPO / "kvsnap").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    for path in sorted((REPO / "cli").rglob("*.py")):
        parts = ("kvsnap", *path.relative_to(REPO).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _resolve(importer: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = importer.split(".")
        if not MODULES[importer].name == "__init__.py":
            package = package[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, *([node.module] if node.module else [])])
    return [
        f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
        for alias in node.names
    ]


def _owner(name: str) -> str | None:
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in MODULES else None


def _type_checking_only(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imports(module: str, type_checking: bool = False) -> list[tuple[str, int, bool]]:
    """``(imported module, line, inside a function)`` for every kvsnap import of ``module``;
    with ``type_checking``, those under ``if TYPE_CHECKING:`` too."""
    tree = ast.parse(MODULES[module].read_text())
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking_only(child) and not type_checking:
                continue
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for name in _resolve(module, child):
                    owner = _owner(name) if name.startswith("kvsnap") else None
                    if owner is not None and owner != module:
                        found.append((owner, child.lineno, in_function))
            visit(child, nested)

    visit(tree, False)
    return found


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_package_import_goes_down_the_layers() -> None:
    upward = []
    for module in MODULES:
        importer = _part(module)
        if not importer:
            continue
        for imported, line, _ in _imports(module):
            target = _part(imported)
            if not target or target == importer:
                continue
            if LAYER[target] > LAYER[importer] or (importer, target) in SIDEWAYS_FORBIDDEN:
                upward.append(f"{MODULES[module].relative_to(REPO)}:{line} imports {imported}")
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_every_top_level_part_has_a_layer() -> None:
    assert {_part(module) for module in MODULES} - {""} <= set(LAYER)


def test_no_module_imports_kvsnap_inside_a_function_outside_the_cli_and_the_shims() -> None:
    late = [
        f"{MODULES[module].relative_to(REPO)}:{line} imports {imported}"
        for module in MODULES
        if _part(module) != "cli" and module not in LATE_IMPORTS_ALLOWED
        for imported, line, in_function in _imports(module)
        if in_function and imported not in TORCH_FREE_START.get(module, ())
    ]
    assert not late, "function-level kvsnap imports:\n" + "\n".join(late)


def test_there_is_no_import_cycle_among_kvsnap_modules() -> None:
    graph: dict[str, set[str]] = defaultdict(set)
    for module in MODULES:
        for imported, _, _ in _imports(module):
            # A module reading a name its own package's __init__ re-exports is not counted as a
            # cycle with that __init__ (the names resolve once the package is initialised).
            if not module.startswith(imported + "."):
                graph[module].add(imported)
    cycles = _strongly_connected(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                connect(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(MODULES):
        if node not in index:
            connect(node)
    return components


#: The rooms of ``kvsnap.store``, lowest first: a module of one room imports only modules of
#: its own room and of the rooms before it. ``kvsnap/store/__init__.py`` is the store's front
#: door, which re-exports from every room and which no room imports.
STORE_ROOMS = {
    # What every room uses (thread pools, sizes, the trace hook, split futures): nothing of
    # the store's, so any room can use it without reaching into another.
    "base": 0,
    # Where files live and how they are published or replaced: names and bytes on storage,
    # never a snapshot's tensors, so readers, writers and the hot tier all stand on it.
    "files": 1,
    # The page cache as a tier: it maps and registers files it finds through `files`, and
    # makes the capture's memory-backed file; it parses no header and checks no checksum.
    "hot": 2,
    # Reading: asks `hot` whether a range is resident; never writes, publishes or deletes.
    "read": 3,
    # Writing: uses `hot` for memory-backed files and `read` only through
    # read.parts.parts_index_bytes, to compare a parted index with the parts on disk.
    "write": 4,
}


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["kvsnap", "store"] or len(parts) < 3:
        return None
    return parts[2]


def test_every_store_module_lives_in_a_room() -> None:
    loose = [
        str(MODULES[module].relative_to(REPO))
        for module in MODULES
        if module.startswith("kvsnap.store.") and _room(module) not in STORE_ROOMS
    ]
    assert not loose, "store modules outside the rooms of STORE_ROOMS:\n" + "\n".join(loose)


def test_store_rooms_import_only_rooms_before_them_and_never_the_front_door() -> None:
    wrong = []
    for module in MODULES:
        room = _room(module)
        if room not in STORE_ROOMS:
            continue  # outside the store, or loose (the test above names it)
        for imported, line, _ in _imports(module, type_checking=True):
            target = _room(imported)
            where = f"{MODULES[module].relative_to(REPO)}:{line} imports {imported}"
            if imported == "kvsnap.store":
                wrong.append(where + " (the front door)")
            elif target in STORE_ROOMS and STORE_ROOMS[target] > STORE_ROOMS[room]:
                wrong.append(where)
    assert not wrong, "store imports against the rooms' order:\n" + "\n".join(wrong)


def test_there_is_no_import_loop_even_through_type_checking_imports() -> None:
    """A module reading another only for its types still depends on it: to understand one
    file of a loop a reader must read the other, and the loop comes back as soon as a name
    is used at run time. So loops are counted with ``if TYPE_CHECKING:`` imports too, inside
    any folder and across folders; only a module's import of its own package's ``__init__``
    (a re-export) is not an edge, as in the test above."""
    graph: dict[str, set[str]] = defaultdict(set)
    for module in MODULES:
        for imported, _, _ in _imports(module, type_checking=True):
            if not module.startswith(imported + "."):
                graph[module].add(imported)
    cycles = _strongly_connected(graph)
    assert not cycles, "import loops:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_nothing_imports_a_store_module_by_its_old_flat_name() -> None:
    """The old names serve callers outside the project (with a DeprecationWarning); the
    project's own code, tests and benchmarks use the rooms' names (tests/store/test_rooms.py,
    which checks the old names, excepted)."""
    from kvsnap.store import MOVED

    old = {f"kvsnap.store.{name}" for name in MOVED}
    found = []
    roots = [REPO / "kvsnap", REPO / "cli", REPO / "tests", REPO / "benchmarks"]
    for path in sorted(p for root in roots for p in root.rglob("*.py")):
        if (REPO / "kvsnap" / "cli") in path.parents or path.name == "test_rooms.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.Import):
                names = {alias.name for alias in node.names}
            else:
                continue
            if names & old:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, "imports of a store module by its old name:\n" + "\n".join(found)
