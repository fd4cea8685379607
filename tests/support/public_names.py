"""The public names of ``kvsnap``, ``kvsnap.store``, every module under ``kvsnap/store/`` and
every module the docs name, as ``module:name`` lines.

``python -m tests.support.public_names > tests/project/public_names.txt`` records them; the
test ``tests/project/test_public_names.py`` then checks that each recorded name still imports
from its recorded module (through a deprecation alias where the module moved). A module's
public names are its ``__all__`` where it has one, else the names its own top level binds
(functions, classes, assignments) that do not start with ``_``; names it merely imports are
not its own.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
DOTTED = re.compile(r"\bkvsnap(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def _is_module(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def documented_modules() -> set[str]:
    """``kvsnap``, ``kvsnap.store``, the modules of ``kvsnap/store/`` and every module a doc
    names (the longest importable prefix of each dotted ``kvsnap.`` name in README and docs)."""
    found = {"kvsnap", "kvsnap.store"}
    for path in sorted((REPO / "kvsnap" / "store").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        found.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    for doc in DOCS:
        for dotted in DOTTED.findall(doc.read_text()):
            parts = dotted.split(".")
            for end in range(len(parts), 0, -1):
                candidate = ".".join(parts[:end])
                if _is_module(candidate):
                    found.add(candidate)
                    break
    return found


def own_names(module: str) -> set[str]:
    """The public names of ``module`` (see the module docstring)."""
    loaded = importlib.import_module(module)
    exported = getattr(loaded, "__all__", None)
    if exported is not None:
        return set(exported)
    tree = ast.parse(Path(loaded.__file__ or "").read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return {name for name in names if not name.startswith("_")}


def public_names() -> list[str]:
    """Every ``module:name`` line, sorted."""
    return sorted(f"{m}:{n}" for m in documented_modules() for n in own_names(m))


if __name__ == "__main__":
    sys.stdout.write("".join(line + "\n" for line in public_names()))
