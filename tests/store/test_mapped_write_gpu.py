"""Mapped files registered with CUDA on a full filesystem (skipped without CUDA, and where a
small tmpfs cannot be mounted): registering faults every page in, so a tmpfs with no room
for the file makes the registration fail with an error code, the writer falls back to
writing, and the write fails with the store's ENOSPC error. Never SIGBUS: each case runs in
a child process, so that a signal would fail the test instead of ending pytest.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsnap.errors import SnapshotIOError
from kvsnap.store import SnapshotWriter, tuning
from kvsnap.store.mapped_file import MappedFile
from tests.support.store_helpers import build, temp_files

pytestmark = pytest.mark.gpu

#: Size of the small tmpfs: room for a snapshot of geometry "f16-32k", not for two.
SMALL_TMPFS = "2m"


@pytest.fixture
def small_tmpfs() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="kvsnap-small-tmpfs-"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SMALL_TMPFS}", "tmpfs", str(directory)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        directory.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], check=False)
        directory.rmdir()


def _register_beyond_the_filesystem(directory: str) -> str:
    """Child: map a file larger than the tmpfs and register it; what happened."""
    fd = os.open(os.path.join(directory, "big"), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        MappedFile(fd, 64 << 20, register=True)
    except OSError as error:
        return f"refused: {error}"
    finally:
        os.close(fd)
    return "registered"


def _capture_into_a_full_filesystem(directory: str) -> str:
    """Child: a writer whose free-space check passed, the filesystem filled before it maps."""
    tuning.MAPPED_WRITE_MIN_BYTES = 0
    metadata, pages = build("f16-32k", seed=41)
    writer = SnapshotWriter(os.path.join(directory, "snap.safetensors"), metadata)
    filler = os.path.join(directory, "filler")
    with open(filler, "wb") as out:
        try:
            while True:
                out.write(bytes(1 << 16))
                out.flush()
        except OSError as error:
            assert error.errno == errno.ENOSPC
    reason = writer.map_for_device()
    try:
        for name in writer.tensor_order():
            writer.write_pages(name, pages[name])
        writer.commit()
    except SnapshotIOError as error:
        cause = error.__cause__
        enospc = isinstance(cause, OSError) and cause.errno == errno.ENOSPC
        return f"mapping refused: {reason is not None}; failed with ENOSPC: {enospc}"
    return f"committed (mapping refused: {reason})"


def _in_child(function, directory: Path) -> str:
    """``function(directory)`` in a fresh process; a child killed by a signal never answers,
    which fails the test after the timeout."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply_async(function, (str(directory),)).get(timeout=120)


def test_registering_more_than_the_filesystem_holds_fails_without_sigbus(
    small_tmpfs: Path,
) -> None:
    outcome = _in_child(_register_beyond_the_filesystem, small_tmpfs)
    assert outcome.startswith("refused: cudaHostRegister"), outcome


def test_a_full_filesystem_falls_back_and_fails_with_enospc(small_tmpfs: Path) -> None:
    outcome = _in_child(_capture_into_a_full_filesystem, small_tmpfs)
    assert outcome == "mapping refused: True; failed with ENOSPC: True", outcome
    assert temp_files(small_tmpfs) == []
