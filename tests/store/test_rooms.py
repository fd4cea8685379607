"""The store as rooms: the modules' old flat names still import (with a DeprecationWarning)
and give the very objects of their new homes; a capture opens no reader, and a parted one
opens readers only through ``read.parts.parts_index_bytes``, to compare its index with the
parts on disk."""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

import kvsnap.store
from kvsnap.snapshot import Snapshot, capture
from kvsnap.store.read import parts as read_parts
from kvsnap.store.read.reader import SnapshotReader
from tests.support.parts_helpers import SOURCE, filled, sequences
from tests.support.public_names import own_names


def _fresh_import(name: str) -> object:
    sys.modules.pop(name, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(name)
    assert any(
        issubclass(warning.category, DeprecationWarning) and name in str(warning.message)
        for warning in caught
    ), [str(warning.message) for warning in caught]
    return module


@pytest.mark.parametrize("old", sorted(kvsnap.store.MOVED))
def test_every_old_module_name_imports_its_new_modules_names_with_a_warning(old: str) -> None:
    module = _fresh_import(f"kvsnap.store.{old}")
    targets = [importlib.import_module(f"kvsnap.store.{new}") for new in kvsnap.store.MOVED[old]]
    own = {name for target in targets for name in own_names(target.__name__)}
    assert own, old
    for name in own:
        expected = next(getattr(t, name) for t in targets if hasattr(t, name))
        assert getattr(module, name) is expected, f"{old}.{name}"


def test_old_names_import_as_attributes_and_in_from_imports() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from kvsnap.store import tuning
        from kvsnap.store.parts import discard_parts, opened_parts, publish_parts_index

    from kvsnap.store.base import tuning as new_tuning
    from kvsnap.store.files.part_files import discard_parts as new_discard
    from kvsnap.store.write.parts_index import publish_parts_index as new_publish

    assert tuning.DEFAULT_MAX_INFLIGHT_BYTES == new_tuning.DEFAULT_MAX_INFLIGHT_BYTES
    assert (discard_parts, publish_parts_index) == (new_discard, new_publish)
    assert opened_parts is read_parts.opened_parts
    with pytest.raises(AttributeError, match="no_such_name"):
        kvsnap.store.no_such_name  # noqa: B018


def _import_statement() -> None:
    import kvsnap.store.tuning  # noqa: F401


def _from_import() -> None:
    from kvsnap.store import tuning  # noqa: F401


def _attribute() -> None:
    kvsnap.store.tuning  # noqa: B018


def _import_module() -> None:
    importlib.import_module("kvsnap.store.tuning")


def _from_old_module_import() -> None:
    from kvsnap.store.tuning import DEFAULT_MAX_INFLIGHT_BYTES  # noqa: F401


@pytest.mark.parametrize(
    "form", [_import_statement, _from_import, _attribute, _import_module, _from_old_module_import]
)
def test_the_warning_names_the_line_that_imports_the_old_name(form: Callable[[], None]) -> None:
    # ``from kvsnap.store import OLD`` and ``kvsnap.store.OLD`` reach the import hook through the
    # package's ``__getattr__`` and ``importlib``: their frames are not the user's.
    sys.modules.pop("kvsnap.store.tuning", None)
    vars(kvsnap.store).pop("tuning", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        form()
    [warning] = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert "kvsnap.store.tuning moved to" in str(warning.message)
    assert (warning.filename, warning.lineno) == (__file__, form.__code__.co_firstlineno + 1)


def _count_readers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The URL of every reader opened from now on."""
    opened: list[str] = []
    real = SnapshotReader._start

    def counted(self: SnapshotReader, url: str, *args: object, **kwargs: object) -> None:
        opened.append(url)
        real(self, url, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(SnapshotReader, "_start", counted)
    return opened


def test_a_capture_opens_no_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ranks, _ = filled("vllm-nhd", 2, 4)
    path = tmp_path / "plain.safetensors"
    opened = _count_readers(monkeypatch)
    capture([rank.layout for rank in ranks], sequences(1), path, source=SOURCE)
    capture([rank.layout for rank in ranks], sequences(1), path, source=SOURCE)  # a replacement
    assert opened == []
    with Snapshot.open(path) as snapshot:  # the counting sees a reader where one opens
        assert snapshot.num_blocks == 12
    assert opened == [str(path)]


def test_a_parted_capture_opens_readers_only_to_check_its_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ranks, _ = filled("vllm-nhd", 2, 4)
    opened = _count_readers(monkeypatch)
    inside: list[int] = []
    real = read_parts.parts_index_bytes

    def checking(*args: object, **kwargs: object) -> bytes:
        before = len(opened)
        raw = real(*args, **kwargs)  # type: ignore[arg-type]
        inside.append(len(opened) - before)
        return raw

    monkeypatch.setattr(read_parts, "parts_index_bytes", checking)
    from kvsnap.store.write import parts_index

    monkeypatch.setattr(parts_index, "parts_index_bytes", checking)
    path = tmp_path / "parted.safetensors"
    capture([rank.layout for rank in ranks], sequences(1), path, source=SOURCE, per_rank_parts=True)
    assert len(inside) == 1 and inside[0] > 0
    assert len(opened) == inside[0]  # every reader the capture opened, opened by the check
