"""The public API: every name ``kvsnap`` documents imports, and nothing else is exported."""

from __future__ import annotations

import importlib

import kvsnap


def test_every_documented_name_imports_from_its_module():
    for name in kvsnap.__all__:
        value = getattr(kvsnap, name)
        assert value is not None, name
        if name != "__version__":
            module = importlib.import_module(kvsnap._MODULE_OF[name])
            assert getattr(module, name) is value, name


def test_the_api_fits_one_screen_and_unknown_names_fail_clearly():
    assert len(kvsnap.__all__) <= 40
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
