"""How the writer and reader keep the disk busy: hashing beside writing, several writes in
flight, blocks reserved up front, queued reads; and that buffers are only let go when no
thread touches them any more. Real files, random bytes; the disk calls are wrapped to hold
them at chosen moments."""

from __future__ import annotations

import ctypes
import errno
import gc
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvsnap import format as fmt
from kvsnap.errors import SnapshotCorruptError, SnapshotIOError
from kvsnap.store import SnapshotReader, SnapshotWriter
from kvsnap.store.base import tuning
from kvsnap.store.write import local_file
from kvsnap.store.write import local_target as write_local
from tests.support.store_helpers import build, page_of, temp_files

WAIT_S = 10


def layer_ranges(metadata: fmt.SnapshotMetadata) -> dict[str, tuple[int, int]]:
    (layout,) = fmt.file_layouts(metadata)
    return {e.name: (e.begin, e.end) for e in layout.entries if fmt.is_layer_tensor(e.name)}


def in_layer_data(metadata: fmt.SnapshotMetadata) -> Callable[[int], bool]:
    ranges = list(layer_ranges(metadata).values())
    return lambda offset: any(begin <= offset < end for begin, end in ranges)


def eventually(condition: Callable[[], bool], seconds: float = WAIT_S) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def finish(writer: SnapshotWriter, pages: dict[str, np.ndarray], done: set[str]) -> None:
    """Write the tensors not in ``done`` whole, commit, and check the snapshot."""
    for name in writer.tensor_order():
        if name not in done:
            writer.write_pages(name, pages[name])
    info = writer.commit()
    with SnapshotReader(info.path) as reader:
        assert reader.verify() == []
        for name, data in pages.items():
            out = np.empty_like(data)
            reader.read_pages(name, np.arange(writer.metadata.num_blocks), out)
            assert out.tobytes() == data.tobytes()


# --------------------------------------------------------------------------------------------
# Writer


def test_the_disk_write_starts_while_the_buffer_is_still_being_hashed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    metadata, pages = build("f16-32k", seed=40)
    hashing, release_hash = threading.Event(), threading.Event()
    real_digests = fmt.block_digests

    def held_digests(view: np.ndarray, page_bytes: int) -> np.ndarray:
        hashing.set()
        assert release_hash.wait(WAIT_S)
        return real_digests(view, page_bytes)

    written: list[int] = []
    real_pwrite = local_file._pwrite_all

    def recording_pwrite(fd: int, view: memoryview, offset: int) -> None:
        real_pwrite(fd, view, offset)
        written.append(offset)

    monkeypatch.setattr(fmt, "block_digests", held_digests)
    monkeypatch.setattr(local_file, "_pwrite_all", recording_pwrite)
    writer = SnapshotWriter(tmp_path / "snap.safetensors", metadata)
    first = writer.tensor_order()[0]
    begin, end = layer_ranges(metadata)[first]
    future = writer.write_pages(first, pages[first])
    assert hashing.wait(WAIT_S)
    assert eventually(lambda: any(begin <= offset < end for offset in written))
    assert not future.done()  # the hash still reads the buffer
    release_hash.set()
    future.result(WAIT_S)
    monkeypatch.setattr(fmt, "block_digests", real_digests)
    finish(writer, pages, {first})


def test_layer_data_reaches_the_file_as_one_ordered_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One write at a time, front to back: the measured disk runs fastest that way (parallel
    writes to one file reached 0.77-0.83 of the raw write, one stream 0.89-0.92)."""
    metadata, pages = build("f16-32k", seed=41)
    page = metadata.geometry.canonical_page_size_bytes
    monkeypatch.setattr(tuning, "WRITE_CHUNK_BYTES", 2 * page)
    is_data = in_layer_data(metadata)
    lock = threading.Lock()
    active, peak, offsets = [0], [0], []
    real_pwrite = local_file._pwrite_all

    def recording_pwrite(fd: int, view: memoryview, offset: int) -> None:
        if not is_data(offset):
            return real_pwrite(fd, view, offset)
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
            offsets.append(offset)
        time.sleep(0.002)  # room for a second write to start, were one allowed
        real_pwrite(fd, view, offset)
        with lock:
            active[0] -= 1

    monkeypatch.setattr(local_file, "_pwrite_all", recording_pwrite)
    writer = SnapshotWriter(tmp_path / "snap.safetensors", metadata)
    finish(writer, pages, set())
    assert len(offsets) > 4
    assert peak[0] == 1
    assert offsets == sorted(offsets)


@pytest.mark.parametrize(
    ("name", "extra_blocks"), [("f16-32k", 0), ("bf16", 100), ("f32-odd", 2100)]
)
def test_buffers_are_written_in_pieces_of_at_most_the_write_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, extra_blocks: int
) -> None:
    metadata, pages = build(name, seed=42, extra_blocks=extra_blocks)
    page = metadata.geometry.canonical_page_size_bytes
    chunk = 3 * 4096
    monkeypatch.setattr(tuning, "WRITE_CHUNK_BYTES", chunk)
    is_data = in_layer_data(metadata)
    sizes: list[int] = []
    real_pwrite = local_file._pwrite_all

    def recording_pwrite(fd: int, view: memoryview, offset: int) -> None:
        if is_data(offset):
            sizes.append(len(view))
        real_pwrite(fd, view, offset)

    monkeypatch.setattr(local_file, "_pwrite_all", recording_pwrite)
    writer = SnapshotWriter(tmp_path / "snap.safetensors", metadata)
    finish(writer, pages, set())
    # Pieces stay whole pages and 4096-multiples (O_DIRECT): at least lcm(page, 4096) bytes.
    assert max(sizes) <= max(chunk, math.lcm(page, 4096))
    assert sum(sizes) == sum(data.nbytes for data in pages.values())
    assert len(sizes) >= 2 * len(pages)  # every tensor took more than one piece


def test_a_buffer_is_let_go_only_after_every_piece_finished_even_after_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write fails while the hash still reads the buffer: the future waits for the hash."""
    metadata, pages = build("f16-32k", seed=43)
    first = metadata.geometry.tensor_names()[0]
    is_data = in_layer_data(metadata)
    hashing, release_hash, failed = threading.Event(), threading.Event(), threading.Event()
    real_digests, real_pwrite = fmt.block_digests, local_file._pwrite_all

    def held_digests(view: np.ndarray, page_bytes: int) -> np.ndarray:
        hashing.set()
        assert release_hash.wait(WAIT_S)
        return real_digests(view, page_bytes)

    def failing_pwrite(fd: int, view: memoryview, offset: int) -> None:
        if is_data(offset):
            # Fail only once the hash runs: a failure first cancels a hash not yet started,
            # which would leave nothing reading the buffer to wait for.
            assert hashing.wait(WAIT_S)
            failed.set()
            raise OSError(errno.EIO, "Input/output error")
        real_pwrite(fd, view, offset)

    monkeypatch.setattr(fmt, "block_digests", held_digests)
    monkeypatch.setattr(local_file, "_pwrite_all", failing_pwrite)
    writer = SnapshotWriter(tmp_path / "snap.safetensors", metadata, direct_io=False)
    future = writer.write_pages(first, pages[first])
    assert failed.wait(WAIT_S) and hashing.wait(WAIT_S)
    time.sleep(0.05)
    assert not future.done()  # the hash still reads the buffer
    release_hash.set()
    with pytest.raises(OSError, match="Input/output error"):
        future.result(WAIT_S)
    monkeypatch.setattr(fmt, "block_digests", real_digests)
    writer.abort()
    assert temp_files(tmp_path) == []


def test_a_written_buffer_is_not_kept_alive_by_the_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    metadata, pages = build("f16-32k", seed=44)
    first = metadata.geometry.tensor_names()[0]
    is_data = in_layer_data(metadata)
    accepted = threading.Event()  # the writes finish only after write_pages has returned
    real_pwrite = local_file._pwrite_all

    def held_pwrite(fd: int, view: memoryview, offset: int) -> None:
        if is_data(offset):
            assert accepted.wait(WAIT_S)
        real_pwrite(fd, view, offset)

    monkeypatch.setattr(local_file, "_pwrite_all", held_pwrite)
    writer = SnapshotWriter(tmp_path / "snap.safetensors", metadata)
    gc.disable()  # only reference counting may free it: a cycle would hold it until a collection
    try:
        buffer = pages[first].copy()
        alive = weakref.ref(buffer)
        future = writer.write_pages(first, buffer)
        accepted.set()
        future.result(WAIT_S)
        del buffer, future
        assert eventually(lambda: alive() is None, 2.0)
    finally:
        gc.enable()
    finish(writer, pages, {first})


def test_local_files_are_reserved_at_their_final_size(tmp_path: Path) -> None:
    metadata, pages = build("f16-32k", seed=45)
    (layout,) = fmt.file_layouts(metadata)
    if local_file._FALLOCATE is None:
        pytest.skip("no fallocate in this C library")
    writer = SnapshotWriter(tmp_path / "snap.safetensors", metadata)
    assert writer.preallocated
    (temp,) = temp_files(tmp_path)
    assert os.stat(tmp_path / temp).st_blocks * 512 >= layout.file_size
    assert os.stat(tmp_path / temp).st_size == layout.file_size
    finish(writer, pages, set())


def test_a_memory_backed_file_is_not_reserved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On tmpfs a reservation only zeroes every page before the data overwrites it.
    metadata, pages = build("f16-32k", seed=49)
    calls: list[int] = []
    monkeypatch.setattr(write_local, "memory_backed", lambda directory: True)
    monkeypatch.setattr(local_file, "_FALLOCATE", lambda *args: calls.append(1) or 0)
    writer = SnapshotWriter(tmp_path / "snap.safetensors", metadata)
    assert not writer.preallocated and calls == []
    finish(writer, pages, set())


def test_memory_backed_tells_tmpfs_from_a_disk(tmp_path: Path) -> None:
    assert local_file.memory_backed("/dev/shm") == os.path.ismount("/dev/shm")
    assert local_file.memory_backed("/definitely/not/here") is False


def fake_fallocate(code: int) -> Callable[[int, int, int, int], int]:
    def fallocate(fd: int, mode: int, offset: int, length: int) -> int:
        ctypes.set_errno(code)
        return -1

    return fallocate


def test_a_disk_too_full_to_reserve_the_file_fails_before_any_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    metadata, _ = build("bf16", seed=46)
    monkeypatch.setattr(local_file, "_FALLOCATE", fake_fallocate(errno.ENOSPC))
    with pytest.raises(SnapshotIOError, match="No space left"):
        SnapshotWriter(tmp_path / "snap.safetensors", metadata)
    assert os.listdir(tmp_path) == []


def test_a_filesystem_without_fallocate_is_written_without_reserving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    metadata, pages = build("bf16", seed=47)
    monkeypatch.setattr(local_file, "_FALLOCATE", fake_fallocate(errno.EOPNOTSUPP))
    writer = SnapshotWriter(tmp_path / "snap.safetensors", metadata)
    assert not writer.preallocated
    finish(writer, pages, set())


def test_the_trace_hook_sees_every_hash_write_and_commit_phase(tmp_path: Path) -> None:
    metadata, pages = build("f16-32k", seed=48)
    spans: list[tuple[str, float, float, int]] = []
    writer = SnapshotWriter(
        tmp_path / "snap.safetensors", metadata, trace=lambda *span: spans.append(span)
    )
    finish(writer, pages, set())
    layer_bytes = sum(data.nbytes for data in pages.values())
    kinds = {kind for kind, *_ in spans}
    assert {"commit.drain", "commit.checksums", "commit.fsync", "commit.publish"} <= kinds
    for kind in ("hash", "write"):
        assert sum(n for k, _, _, n in spans if k == kind) == layer_bytes
    assert all(start <= end for _, start, end, _ in spans)


# --------------------------------------------------------------------------------------------
# Reader


@pytest.fixture
def written(tmp_path: Path) -> tuple[Path, fmt.SnapshotMetadata, dict[str, np.ndarray]]:
    metadata, pages = build("f16-32k", seed=50)
    path = tmp_path / "snap.safetensors"
    writer = SnapshotWriter(path, metadata)
    finish(writer, pages, set())
    return path, metadata, pages


def test_an_async_read_returns_at_once_and_fills_the_buffer_later(
    written: tuple[Path, fmt.SnapshotMetadata, dict[str, np.ndarray]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path, metadata, pages = written
    page = metadata.geometry.canonical_page_size_bytes
    name = metadata.geometry.tensor_names()[1]
    begin, end = layer_ranges(metadata)[name]
    gate = threading.Event()
    real_preadv = os.preadv

    def gated_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        if begin <= offset < end:
            assert gate.wait(WAIT_S)
        return real_preadv(fd, buffers, offset)

    ids = np.array([7, 8, 9, 2, 0])
    out = np.zeros(len(ids) * page, dtype=np.uint8)
    with SnapshotReader(path) as reader:
        monkeypatch.setattr(os, "preadv", gated_preadv)
        future = reader.read_pages_async(name, ids, out)
        time.sleep(0.05)
        assert not future.done() and not out.any()
        gate.set()
        future.result(WAIT_S)
        with pytest.raises(IndexError):
            reader.read_pages_async(name, [metadata.num_blocks], out)  # checked before queuing
    assert out.tobytes() == b"".join(page_of(pages[name], page, b) for b in ids.tolist())


def test_an_async_read_of_a_corrupt_block_fails_once_no_piece_is_running(
    written: tuple[Path, fmt.SnapshotMetadata, dict[str, np.ndarray]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path, metadata, _ = written
    page = metadata.geometry.canonical_page_size_bytes
    name = metadata.geometry.tensor_names()[2]
    begin, _ = layer_ranges(metadata)[name]
    with open(path, "r+b") as handle:  # flip one byte of block 1
        handle.seek(begin + page + 100)
        byte = handle.read(1)
        handle.seek(begin + page + 100)
        handle.write(bytes([byte[0] ^ 0xFF]))
    monkeypatch.setattr(tuning, "SUBCHUNK_BYTES", page)  # one piece per block
    slow_started, release_slow = threading.Event(), threading.Event()
    real_preadv = os.preadv

    def preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        if offset == begin + page:
            # Block 1 fails only once block 5 has begun: a failure skips the pieces not yet
            # started, and on a loaded machine block 5's might not have been.
            assert slow_started.wait(WAIT_S)
        if offset == begin + 5 * page:  # block 5: still reading when block 1 fails
            slow_started.set()
            assert release_slow.wait(WAIT_S)
        return real_preadv(fd, buffers, offset)

    out = np.empty(metadata.num_blocks * page, dtype=np.uint8)
    with SnapshotReader(path, io_threads=4) as reader:
        monkeypatch.setattr(os, "preadv", preadv)
        future = reader.read_pages_async(name, np.arange(metadata.num_blocks), out)
        assert slow_started.wait(WAIT_S)
        time.sleep(0.05)
        assert not future.done()
        release_slow.set()
        with pytest.raises(SnapshotCorruptError) as caught:
            future.result(WAIT_S)
    assert caught.value.block == 1 and caught.value.tensor == name
