"""Snapshots whose layer data is placed in the mapped files (``map_for_device``) rather than
written: the same bytes as a written snapshot, the checksums and signature right, the choice
of path, and aborts and crashes that leave nothing under the final name.

CPU machines have no CUDA: the host copies into the mapping here (``register=False``), which
is everything but the DMA; tests/pipeline/test_capture_dma.py runs the device's copies.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvsnap import format as fmt
from kvsnap.errors import SignatureError
from kvsnap.format.signing import KeyRing
from kvsnap.host_registration import cuda_unavailable_reason
from kvsnap.store import SnapshotReader, SnapshotWriter
from kvsnap.store.base import tuning
from kvsnap.store.base.pools import shared_executor
from kvsnap.store.hot.mapped_file import POPULATE_CHUNK_BYTES, MappedFile
from tests.support.store_helpers import (
    build,
    stored_and_actual_digests,
    temp_files,
    write_mapped,
    write_snapshot,
)

pytestmark = pytest.mark.usefixtures("mapped_from_any_size")


@pytest.mark.parametrize("geometry", ["bf16", "f16-32k", "f32-odd"])
def test_a_mapped_write_is_the_written_snapshot_byte_for_byte(shm_dir: Path, geometry: str) -> None:
    metadata, pages = build(geometry, seed=31)
    written, mapped = shm_dir / "written.safetensors", shm_dir / "mapped.safetensors"
    write_snapshot(written, metadata, pages)
    info = write_mapped(mapped, metadata, pages)
    assert info.mapped and info.path == str(mapped)
    assert mapped.read_bytes() == written.read_bytes()
    assert temp_files(shm_dir) == []
    with SnapshotReader(mapped) as reader:
        assert reader.verify() == []
    stored, actual = stored_and_actual_digests(mapped)
    assert stored == actual


def test_a_signed_mapped_write_verifies_with_its_key(shm_dir: Path) -> None:
    metadata, pages = build("f16-32k", seed=32)
    keys = KeyRing([b"a secret of thirty-two bytes...."])
    path = shm_dir / "signed.safetensors"
    info = write_mapped(path, metadata, pages, keys=keys)
    assert info.mapped
    with SnapshotReader(path, keys=keys) as reader:
        assert reader.metadata.signature == fmt.SIGNATURE_ALGORITHM
        assert reader.verify() == []
    with pytest.raises(SignatureError):
        SnapshotReader(path, keys=KeyRing([b"another secret of thirty-two byte"]))
    written = shm_dir / "written.safetensors"
    write_snapshot(written, metadata, pages, keys=keys)
    assert path.read_bytes() == written.read_bytes()


def test_wrong_digests_are_caught_by_verify(shm_dir: Path) -> None:
    """The writer records the digests it is given: one that does not match the placed page
    makes the file fail verification (the device's digests are what protects the file)."""
    metadata, pages = build("f16-32k", seed=33)
    page = metadata.geometry.canonical_page_size_bytes
    path = shm_dir / "snap.safetensors"
    with SnapshotWriter(path, metadata) as writer:
        assert writer.map_for_device(register=False) is None
        files = writer.mapped_files()
        for index, name in enumerate(writer.tensor_order()):
            shard, offset = writer.page_placement(name, 0)
            data = pages[name]
            files[shard][offset : offset + data.nbytes] = data
            digests = fmt.block_digests(data, page)
            if index == 1:
                digests[0] ^= np.uint64(1)
            writer.placed_slot([(name, data.nbytes // page)], digests)
        del files
    with SnapshotReader(path) as reader:
        problems = reader.verify()
    assert [(problem.tensor, problem.block) for problem in problems] == [
        (metadata.geometry.tensor_names()[1], 0)
    ]


def test_mapping_is_refused_where_it_does_not_pay(
    shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    metadata, pages = build("f16-32k", seed=34)
    layer_bytes = sum(data.nbytes for data in pages.values())
    monkeypatch.setattr(tuning, "MAPPED_WRITE_MIN_BYTES", layer_bytes + 1)
    with SnapshotWriter(shm_dir / "small.safetensors", metadata) as writer:
        reason = writer.map_for_device(register=False)
        assert reason is not None and "under the" in reason
        _write_all(writer, pages)
    assert writer.info is not None and not writer.info.mapped
    monkeypatch.setattr(tuning, "MAPPED_WRITE_MIN_BYTES", 0)
    if cuda_unavailable_reason() is not None:
        # Registration is impossible: the writer says why and writes as before.
        with SnapshotWriter(shm_dir / "no-cuda.safetensors", metadata) as writer:
            assert writer.map_for_device() == cuda_unavailable_reason()
            _write_all(writer, pages)
        assert writer.info is not None and not writer.info.mapped
        with SnapshotReader(shm_dir / "no-cuda.safetensors") as reader:
            assert reader.verify() == []
    from kvsnap.store.write.local_file import memory_backed

    if not memory_backed(str(tmp_path)):
        with SnapshotWriter(tmp_path / "disk.safetensors", metadata) as writer:
            assert writer.map_for_device(register=False) == "not a memory-backed file"
            _write_all(writer, pages)


def _write_all(writer: SnapshotWriter, pages: dict[str, np.ndarray]) -> None:
    for name in writer.tensor_order():
        writer.write_pages(name, pages[name])


def test_populate_brings_every_page_of_the_file_into_being(shm_dir: Path) -> None:
    """After ``populate`` the tmpfs holds every page (registering only pins them then), on
    one thread and on several."""
    for threads in (1, 3):
        path = shm_dir / f"populated-{threads}"
        size = 3 * POPULATE_CHUNK_BYTES + 12345
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            mapped = MappedFile(fd, size)
            assert os.fstat(fd).st_blocks == 0  # sized, not allocated
            executor = shared_executor("populate", threads) if threads > 1 else None
            assert mapped.populate(executor, threads)
            assert os.fstat(fd).st_blocks * 512 >= size
            mapped.close()
        finally:
            os.close(fd)
        assert path.stat().st_size == size and path.read_bytes() == bytes(size)


def test_placed_pages_follow_the_tensor_order(shm_dir: Path) -> None:
    metadata, pages = build("f16-32k", seed=35)
    page = metadata.geometry.canonical_page_size_bytes
    names = metadata.geometry.tensor_names()
    with SnapshotWriter(shm_dir / "snap.safetensors", metadata) as writer:
        with pytest.raises(RuntimeError, match="map_for_device"):
            writer.placed_slot([(names[0], 1)], np.zeros(1, dtype=np.uint64))
        assert writer.map_for_device(register=False) is None
        with pytest.raises(ValueError, match="expected"):
            writer.placed_slot([(names[1], 1)], np.zeros(1, dtype=np.uint64))
        with pytest.raises(ValueError, match="digests for"):
            writer.placed_slot([(names[0], 2)], np.zeros(1, dtype=np.uint64))
        with pytest.raises(ValueError, match="exceed"):
            writer.placed_slot(
                [(names[0], metadata.num_blocks + 1)],
                np.zeros(metadata.num_blocks + 1, dtype=np.uint64),
            )
        writer.abort()
    del pages, page


def test_an_aborted_mapped_write_leaves_the_old_snapshot(shm_dir: Path) -> None:
    old_metadata, old_pages = build("f16-32k", seed=36)
    path = shm_dir / "snap.safetensors"
    write_snapshot(path, old_metadata, old_pages)
    before = path.read_bytes()
    metadata, pages = build("f16-32k", seed=37)

    def fail_after_first(index: int) -> None:
        if index == 0:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_mapped(path, metadata, pages, after_tensor=fail_after_first)
    assert path.read_bytes() == before
    assert temp_files(shm_dir) == []


def _write_mapped_and_die(path: str, stage: str) -> None:
    """Child: a mapped write of snapshot 39 that SIGKILLs itself at ``stage``."""
    from kvsnap.store.files import publish

    tuning.MAPPED_WRITE_MIN_BYTES = 0
    metadata, pages = build("f16-32k", seed=39)

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if stage == "before-rename":
        real = os.replace

        def replace(*args: Any) -> None:
            die()
            real(*args)

        os.replace = replace  # type: ignore[assignment]
    elif stage == "after-rename":
        real_fsync = publish.fsync_directory

        def fsync_directory(directory: str) -> None:
            die()
            real_fsync(directory)

        publish.fsync_directory = fsync_directory  # type: ignore[assignment]

    def after_tensor(index: int) -> None:
        if stage == "mid-data" and index == 1:
            die()

    write_mapped(path, metadata, pages, after_tensor=after_tensor)


@pytest.mark.parametrize("stage", ["mid-data", "before-rename", "after-rename"])
def test_a_killed_mapped_write_leaves_the_old_or_the_new_snapshot(
    shm_dir: Path, stage: str
) -> None:
    old_metadata, old_pages = build("f16-32k", seed=38)
    path = shm_dir / "snap.safetensors"
    write_snapshot(path, old_metadata, old_pages)
    before = path.read_bytes()
    child = multiprocessing.get_context("fork").Process(
        target=_write_mapped_and_die, args=(str(path), stage)
    )
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    if stage == "after-rename":
        new_metadata, new_pages = build("f16-32k", seed=39)
        expected = shm_dir / "expected.safetensors"
        write_snapshot(expected, new_metadata, new_pages)
        assert path.read_bytes() == expected.read_bytes()
        expected.unlink()
    else:
        assert path.read_bytes() == before
        assert len(temp_files(shm_dir)) == 1  # the dead writer's, removed by the next one
    write_mapped(path, *build("f16-32k", seed=40))
    assert temp_files(shm_dir) == []
    with SnapshotReader(path) as reader:
        assert reader.verify() == []
