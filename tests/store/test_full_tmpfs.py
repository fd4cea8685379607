"""Mapped files on a full filesystem (skipped where a small tmpfs cannot be mounted: it takes
root): faulting the pages in (``populate``) or registering them with CUDA (the ``gpu`` cases)
on a tmpfs with no room for the file fails with an error code, the writer falls back to
writing, and the write fails with the store's ENOSPC error. Never SIGBUS: each case runs in a
child process, so that a signal would fail the test instead of ending pytest.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsnap.errors import SnapshotIOError
from kvsnap.store import SnapshotWriter
from kvsnap.store.base import tuning
from kvsnap.store.hot.mapped_file import MappedFile
from tests.support.store_helpers import build, mounted_tmpfs, temp_files

#: Size of the small tmpfs: room for a snapshot of geometry "f16-32k", not for two.
SMALL_TMPFS = "2m"


@pytest.fixture
def small_tmpfs() -> Iterator[Path]:
    with mounted_tmpfs(SMALL_TMPFS, "kvsnap-small-tmpfs-") as directory:
        yield directory


def _map_beyond_the_filesystem(directory: str, step: str) -> str:
    """Child: map a file larger than the tmpfs and fault its pages in (``populate``) or
    register it without faulting them first (``register``); what happened."""
    fd = os.open(os.path.join(directory, "big"), os.O_CREAT | os.O_RDWR, 0o600)
    mapped = MappedFile(fd, 64 << 20)
    try:
        if step == "populate":
            mapped.populate(None, 1)
        else:
            mapped.register()
        return "done"
    except OSError as error:
        return f"refused ({error.errno})"
    finally:
        mapped.close()
        os.close(fd)


def _capture_into_a_full_filesystem(directory: str, register: bool) -> str:
    """Child: a writer whose free-space check passed, the filesystem filled before it maps."""
    tuning.MAPPED_WRITE_MIN_BYTES = 0
    metadata, pages = build("f16-32k", seed=41)
    reason = None
    try:
        with SnapshotWriter(os.path.join(directory, "snap.safetensors"), metadata) as writer:
            _fill(os.path.join(directory, "filler"))
            reason = writer.map_for_device(register=register)
            for name in writer.tensor_order():
                writer.write_pages(name, pages[name])
    except SnapshotIOError as error:
        cause = error.__cause__
        enospc = isinstance(cause, OSError) and cause.errno == errno.ENOSPC
        return f"mapping refused: {reason is not None}; failed with ENOSPC: {enospc}"
    return f"committed (mapping refused: {reason})"


def _fill(path: str) -> None:
    """Write ``path`` until the filesystem is full."""
    with open(path, "wb") as out:
        try:
            while True:
                out.write(bytes(1 << 16))
                out.flush()
        except OSError as error:
            assert error.errno == errno.ENOSPC


def _in_child(function, directory: Path, argument: object) -> str:
    """``function(directory, argument)`` in a fresh process; a child killed by a signal never
    answers, which fails the test after the timeout."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply_async(function, (str(directory), argument)).get(timeout=120)


def test_populating_more_than_the_filesystem_holds_fails_without_sigbus(
    small_tmpfs: Path,
) -> None:
    outcome = _in_child(_map_beyond_the_filesystem, small_tmpfs, "populate")
    assert outcome == f"refused ({errno.ENOSPC})"


@pytest.mark.gpu
def test_registering_more_than_the_filesystem_holds_fails_without_sigbus(
    small_tmpfs: Path,
) -> None:
    outcome = _in_child(_map_beyond_the_filesystem, small_tmpfs, "register")
    assert outcome.startswith("refused"), outcome


@pytest.mark.parametrize("register", [False, pytest.param(True, marks=pytest.mark.gpu)])
def test_a_full_filesystem_falls_back_and_fails_with_enospc(
    small_tmpfs: Path, register: bool
) -> None:
    outcome = _in_child(_capture_into_a_full_filesystem, small_tmpfs, register)
    assert outcome == "mapping refused: True; failed with ENOSPC: True", outcome
    assert temp_files(small_tmpfs) == []
