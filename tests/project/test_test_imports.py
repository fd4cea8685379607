"""No module of the test suite imports a test module: shared helpers live in ``tests/support/``.

A test module that other modules import is a test and a library at once: its private names
cross module boundaries and importing it runs its module-level code (fixtures, parametrize
lists) in the importer. Every ``import`` and ``from ... import`` of every ``.py`` file under
``tests/`` counts, at module level or inside a function, relative imports resolved; a test
module is a ``test_*.py`` file outside ``tests/support/``. Imports of ``tests.support.*`` and of
the ``conftest`` modules are what the layout expects and are never flagged.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(TESTS.rglob("*.py"))}


def _is_test_module(name: str) -> bool:
    path = MODULES.get(name)
    return (
        path is not None
        and path.name.startswith("test_")
        and (TESTS / "support") not in path.parents
    )


def _imported_names(importer: str, package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """Every module ``node`` may load: the module named, and each imported name as a submodule."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = importer.split(".") if package else importer.split(".")[:-1]
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join([*parts, *([node.module] if node.module else [])])
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def imports_of_test_modules(
    source: str, importer: str, package: bool = False
) -> dict[str, list[int]]:
    """``{test module: lines}`` for every import of a test module in ``source``, the text of
    module ``importer`` (a package's ``__init__`` when ``package``)."""
    found: dict[str, list[int]] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for name in _imported_names(importer, package, node):
                if _is_test_module(name) and name != importer:
                    found.setdefault(name, []).append(node.lineno)
    return found


def _imports_in(path: Path) -> dict[str, list[int]]:
    return imports_of_test_modules(path.read_text(), _module_name(path), path.name == "__init__.py")


def test_no_module_under_tests_imports_a_test_module() -> None:
    offences = [
        f"{path.relative_to(REPO)}:{','.join(map(str, sorted(lines)))} imports {imported}"
        for path in MODULES.values()
        for imported, lines in sorted(_imports_in(path).items())
    ]
    assert not offences, (
        "test modules imported as libraries (move the helpers to tests/support/):\n"
        + "\n".join(offences)
    )


#: Each form of import of ``tests/pipeline/test_pipeline.py``, as a module of tests/pipeline would
#: write it.
IMPORT_FORMS = [
    "from tests.pipeline.test_pipeline import LAYOUTS",
    "import tests.pipeline.test_pipeline",
    "import tests.pipeline.test_pipeline as other",
    "from tests.pipeline import test_pipeline",
    "from . import test_pipeline",
    "from .test_pipeline import LAYOUTS",
    "from ..pipeline.test_pipeline import LAYOUTS",
    "def helper():\n    from tests.pipeline.test_pipeline import LAYOUTS",
]


def test_the_check_finds_every_form_of_import_of_a_test_module() -> None:
    for source in IMPORT_FORMS:
        found = imports_of_test_modules(source, "tests.pipeline.test_new")
        assert found == {"tests.pipeline.test_pipeline": [source.count("\n") + 1]}, source


def test_the_check_allows_support_modules_conftest_and_the_package() -> None:
    allowed = (
        "from tests.support.pipeline_caches import caches\n"
        "from tests.support import pipeline_caches\n"
        "from .conftest import VLLM_VENV\n"
        "from tests.conftest import ROOT\n"
        "import tests.pipeline\n"
        "from . import conftest\n"
    )
    assert imports_of_test_modules(allowed, "tests.engines.vllm.test_new") == {}
