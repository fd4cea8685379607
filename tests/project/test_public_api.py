"""The public API: every name ``kvsnap`` documents imports, nothing else is exported, and type
checkers see the same names (the ``TYPE_CHECKING`` mirrors of the lazy exports, ``py.typed``)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from types import ModuleType

import kvsnap


def test_every_documented_name_imports_from_its_module():
    for name in kvsnap.__all__:
        value = getattr(kvsnap, name)
        assert value is not None, name
        if name != "__version__":
            module = importlib.import_module(kvsnap._MODULE_OF[name])
            assert getattr(module, name) is value, name


def test_the_api_fits_one_screen_and_unknown_names_fail_clearly():
    # 17 of them are the error classes, every one importable from kvsnap (the error rule).
    assert len(kvsnap.__all__) <= 45
    assert {"capture", "Snapshot", "Pipeline", "TransferOptions", "KVSnapError"} <= set(
        kvsnap.__all__
    )
    try:
        kvsnap.no_such_name  # noqa: B018
    except AttributeError as error:
        assert "no_such_name" in str(error)
    else:
        raise AssertionError("an unknown name imported")


def test_every_kvsnap_error_shares_one_root():
    from kvsnap import errors

    classes = [value for value in vars(errors).values() if isinstance(value, type)]
    raised = [cls for cls in classes if issubclass(cls, Exception)]
    assert raised and all(issubclass(cls, errors.KVSnapError) for cls in raised)


def _type_checking_imports(module: ModuleType) -> set[tuple[str, str]]:
    """``(module, name)`` of every ``from module import name`` under ``if TYPE_CHECKING:``."""
    tree = ast.parse(Path(module.__file__).read_text())
    found = set()
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for statement in node.body:
                if isinstance(statement, ast.ImportFrom):
                    found |= {(statement.module, alias.name) for alias in statement.names}
    return found


def test_type_checkers_see_every_lazy_export_where_it_is_imported_from() -> None:
    # Type checkers cannot follow a module __getattr__: each lazy table needs its mirror.
    import kvsnap.layout
    import kvsnap.snapshot
    import kvsnap.testing

    assert _type_checking_imports(kvsnap) == set(
        (module, name) for name, module in kvsnap._MODULE_OF.items()
    )
    assert _type_checking_imports(kvsnap.layout) == set(
        (module, name) for name, module in kvsnap.layout._MODULE_OF.items()
    )
    testing = {("kvsnap.testing.plugin", name) for name in kvsnap.testing._PLUGIN}
    testing |= {("kvsnap.testing.synthetic", name) for name in kvsnap.testing._SYNTHETIC}
    assert _type_checking_imports(kvsnap.testing) == testing
    reexported = {(module, name) for name, module in kvsnap.snapshot._REEXPORTS.items()}
    assert reexported <= _type_checking_imports(kvsnap.snapshot)
    import kvsnap.engines.vllm

    assert _type_checking_imports(kvsnap.engines.vllm) == set(
        (module, name) for name, module in kvsnap.engines.vllm._MODULE_OF.items()
    )


def test_all_lists_each_export_once_and_every_export_resolves() -> None:
    import kvsnap.testing

    assert sorted(kvsnap.__all__) == sorted(["__version__", *kvsnap._MODULE_OF])
    lazy = [*kvsnap.testing._PLUGIN, *kvsnap.testing._SYNTHETIC]
    assert sorted(kvsnap.testing.__all__) == sorted(lazy)
    for name in lazy:
        assert getattr(kvsnap.testing, name) is not None, name


def test_the_package_says_it_is_typed() -> None:
    assert (Path(kvsnap.__file__).parent / "py.typed").is_file()
