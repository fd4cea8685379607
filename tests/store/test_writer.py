"""The streaming writer: round trips that the reader and safetensors read back byte for byte,
O_DIRECT, the atomic publish, and failures that keep the old snapshot."""

from __future__ import annotations

import concurrent.futures
import errno
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from kvsnap import format as fmt
from kvsnap.errors import NotASnapshotError, SnapshotCorruptError, SnapshotIOError
from kvsnap.store import SnapshotReader, SnapshotWriter
from kvsnap.store.write import local_file
from kvsnap.transfer.pinned import PinnedPool
from tests.support.store_helpers import (
    GEOMETRIES,
    build,
    make_metadata,
    page_of,
    temp_files,
    write_snapshot,
)


def direct_io_works(directory: Path) -> bool:
    """Whether this filesystem accepts an aligned O_DIRECT write (tmpfs may not)."""
    probe = directory / "probe"
    probe.touch()
    file = local_file.LocalFile.__new__(local_file.LocalFile)
    file.temp, file.fd, file.direct_fd = str(probe), None, None
    try:
        return file.enable_direct(bytes(4096)) is None
    finally:
        if file.direct_fd is not None:
            os.close(file.direct_fd)
        probe.unlink()


# --------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_round_trip_every_byte_and_safetensors_agrees(tmp_path: Path, name: str) -> None:
    metadata, pages = build(name, seed=10, created=fmt.utc_now(), extra_blocks=1)
    page = metadata.geometry.canonical_page_size_bytes
    path = tmp_path / "snap.safetensors"
    progress: list[int] = []
    info = write_snapshot(
        path, metadata, pages, rng=np.random.default_rng(11), progress=progress.append
    )
    assert info.path == str(path) and info.files == (str(path),)
    assert info.num_bytes == path.stat().st_size
    assert progress == sorted(progress) and progress[-1] == info.kv_bytes == sum(
        p.nbytes for p in pages.values()
    )
    assert temp_files(tmp_path) == []

    with SnapshotReader(path) as reader:
        assert reader.metadata == metadata
        for tensor_name, data in pages.items():
            tensor = reader.read_tensor(tensor_name)
            assert tensor.shape == (metadata.num_blocks, *metadata.geometry.canonical_page_shape)
            assert tensor.view(torch.uint8).numpy().tobytes() == data.tobytes()
            ids = np.random.default_rng(12).integers(0, metadata.num_blocks, size=9)
            ids[3:6] = [1, 2, 3] if metadata.num_blocks > 3 else ids[3:6]  # a coalesced run
            out = np.empty(len(ids) * page, dtype=np.uint8)
            reader.read_pages(tensor_name, ids, out)
            assert out.tobytes() == b"".join(page_of(data, page, block) for block in ids.tolist())
        verified: list[int] = []
        assert reader.verify(progress=verified.append) == []
        assert verified[-1] == info.kv_bytes
        ours = {
            entry: reader.read_tensor(entry)
            for entry in [*pages, fmt.BLOCK_HASHES_TENSOR, fmt.BLOCK_CHECKSUMS_TENSOR]
            + [
                f"sequences.{i}.{p}"
                for i in range(len(metadata.sequences))
                for p in ("token_ids", "block_ids")
            ]
        }
    np.testing.assert_array_equal(
        ours["sequences.1.token_ids"].numpy(), metadata.sequences[1].token_ids
    )

    # Any safetensors reader gets the same typed tensors.
    (layout,) = fmt.file_layouts(metadata)
    with safe_open(path, "pt") as opened:
        assert set(opened.keys()) == {entry.name for entry in layout.entries}
        assert json.loads(opened.metadata()["kvsnap"])["num_blocks"] == metadata.num_blocks
        for tensor_name, tensor in ours.items():
            theirs = opened.get_tensor(tensor_name)
            assert theirs.dtype == tensor.dtype and theirs.shape == tensor.shape
            assert (
                theirs.view(torch.uint8).numpy().tobytes()
                == tensor.view(torch.uint8).numpy().tobytes()
            )
    loaded = load_file(path)
    assert torch.equal(
        loaded["sequences.0.block_ids"], torch.from_numpy(metadata.sequences[0].block_ids)
    )


def test_sharded_round_trip_and_index(tmp_path: Path) -> None:
    metadata, pages = build("bf16", seed=13)
    limit = max(p.nbytes for p in pages.values()) + 100
    path = tmp_path / "snap.safetensors"
    info = write_snapshot(path, metadata, pages, max_shard_bytes=limit)
    count = len(info.files)
    assert count > 3
    assert info.path == str(path) + ".index.json"
    generation = Path(info.files[0]).name.split("-")[1]
    assert fmt.GENERATION_PATTERN.fullmatch(generation)
    assert [Path(f).name for f in info.files] == [
        f"snap-{generation}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)
    ]
    index = json.loads(Path(info.path).read_text())
    assert set(index["weight_map"].values()) == {Path(f).name for f in info.files}
    assert index["metadata"]["kvsnap"] == json.loads(metadata.to_json())
    for file in info.files:
        with safe_open(file, "pt") as opened:
            for key in opened.keys():
                if fmt.is_layer_tensor(key):
                    data = opened.get_tensor(key).view(torch.uint8).numpy().tobytes()
                    assert data == pages[key].tobytes()
    for url in (path, info.path):  # the name it was written to, or the index
        with SnapshotReader(url) as reader:
            assert reader.files == list(info.files)
            assert reader.metadata == metadata
            assert reader.verify() == []
            for name, data in pages.items():
                assert (
                    reader.read_tensor(name).view(torch.uint8).numpy().tobytes() == data.tobytes()
                )
    with pytest.raises(NotASnapshotError, match="shard 1 of"):
        SnapshotReader(info.files[0])

    # Publishing the single-file form removes the sharded one, and back.
    single = write_snapshot(path, metadata, pages)
    assert sorted(os.listdir(tmp_path)) == ["snap.safetensors"] and single.files == (str(path),)
    write_snapshot(path, metadata, pages, max_shard_bytes=limit)
    assert "snap.safetensors" not in os.listdir(tmp_path)


def test_a_missing_shard_makes_the_snapshot_corrupt_naming_it(tmp_path: Path) -> None:
    metadata, pages = build("bf16", seed=14)
    limit = max(p.nbytes for p in pages.values()) + 100
    path = tmp_path / "snap.safetensors"
    info = write_snapshot(path, metadata, pages, max_shard_bytes=limit)
    Path(info.files[2]).unlink()
    for url in (path, info.path):
        with pytest.raises(SnapshotCorruptError, match="the index names this file") as caught:
            SnapshotReader(url)
        assert caught.value.file == info.files[2]
    Path(info.path).unlink()
    with pytest.raises(SnapshotIOError, match="no such file"):  # no snapshot there at all
        SnapshotReader(path)


def test_shards_of_another_snapshot_are_detected(tmp_path: Path) -> None:
    metadata, pages = build("bf16", seed=14)
    limit = max(p.nbytes for p in pages.values()) + 100
    first = write_snapshot(tmp_path / "a.safetensors", metadata, pages, max_shard_bytes=limit)
    other_pages = {name: data ^ np.uint8(1) for name, data in pages.items()}
    second = write_snapshot(
        tmp_path / "b.safetensors", metadata, other_pages, max_shard_bytes=limit
    )
    os.replace(second.files[2], first.files[2])  # same name pattern, other snapshot's content
    with pytest.raises(SnapshotCorruptError, match="does not match the index"):
        SnapshotReader(first.path)


def test_reproducible_snapshots_are_byte_identical(tmp_path: Path) -> None:
    metadata, pages = build("f32-odd", seed=15)
    write_snapshot(tmp_path / "a.safetensors", metadata, pages, hash_threads=1)
    write_snapshot(
        tmp_path / "b.safetensors",
        metadata,
        pages,
        rng=np.random.default_rng(1),
        hash_threads=4,
        direct_io=False,
    )
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


def test_empty_snapshot(tmp_path: Path) -> None:
    geometry = GEOMETRIES["bf16"]
    metadata = fmt.SnapshotMetadata(geometry, make_metadata(geometry, []).source, [], 0, "none", 1)
    path = tmp_path / "empty.safetensors"
    with SnapshotWriter(path, metadata):
        pass
    with SnapshotReader(path) as reader:
        assert reader.metadata == metadata and reader.verify() == []
        assert reader.read_tensor("layers.0.key").shape == (0, *geometry.canonical_page_shape)
    assert load_file(path)["layers.2.value"].shape[0] == 0


def test_fsspec_memory_filesystem_round_trip_and_abort() -> None:
    fsspec = pytest.importorskip("fsspec")
    memory = fsspec.filesystem("memory")
    metadata, pages = build("mla-f8", seed=16)
    url = "memory://kvsnap-test/snap.safetensors"
    info = write_snapshot(url, metadata, pages, rng=np.random.default_rng(2))
    assert info.fallback_reason is not None and "not a local file" in info.fallback_reason
    old = memory.cat_file("/kvsnap-test/snap.safetensors")
    with SnapshotReader(url) as reader:
        assert reader.metadata == metadata and reader.verify() == []
    # An aborted overwrite leaves the old file and no temporary file behind.
    writer = SnapshotWriter(url, metadata)
    writer.write_pages("layers.0.latent", pages["layers.0.latent"]).result()
    writer.abort()
    assert memory.cat_file("/kvsnap-test/snap.safetensors") == old
    assert [p for p in memory.ls("/kvsnap-test", detail=False) if "kvsnap-tmp" in p] == []
    sharded = write_snapshot(url, metadata, pages, max_shard_bytes=4000)
    with SnapshotReader(sharded.path) as reader:
        assert reader.verify() == [] and len(reader.files) > 2
    memory.rm("/kvsnap-test", recursive=True)


# --------------------------------------------------------------------------------------------
# O_DIRECT


def test_direct_io_with_aligned_staging_buffers(tmp_path: Path) -> None:
    if not direct_io_works(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    metadata, pages = build("f16-32k", seed=17)
    page = metadata.geometry.canonical_page_size_bytes
    path = tmp_path / "direct.safetensors"
    with (
        PinnedPool(3 * page, 2, pin=False) as pool,
        SnapshotWriter(path, metadata, direct_io=True) as writer,
    ):
        for name in writer.tensor_order():
            for first in range(0, metadata.num_blocks, 3):
                count = min(3, metadata.num_blocks - first)
                slot = pool.acquire()
                view = slot.as_numpy(count * page)
                view[:] = pages[name][first * page : (first + count) * page]
                writer.write_pages(name, view).add_done_callback(
                    lambda _f, slot=slot: pool.release(slot)
                )
    assert writer.info is not None and writer.info.direct_io and writer.fallback_reason is None
    buffered = tmp_path / "buffered.safetensors"
    info = write_snapshot(buffered, metadata, pages, direct_io=False)
    assert info.fallback_reason == "direct_io=False" and not info.direct_io
    assert path.read_bytes() == buffered.read_bytes()


def test_direct_io_refused_by_the_filesystem_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(path: str) -> int:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(local_file, "_open_direct", refuse)
    metadata, pages = build("f16-32k", seed=18)
    info = write_snapshot(tmp_path / "snap.safetensors", metadata, pages)
    assert not info.direct_io and "refused O_DIRECT" in (info.fallback_reason or "")
    with SnapshotReader(tmp_path / "snap.safetensors") as reader:
        assert reader.verify() == []
    with pytest.raises(SnapshotIOError, match="O_DIRECT was required"):
        SnapshotWriter(tmp_path / "other.safetensors", metadata, direct_io=True)
    assert temp_files(tmp_path) == []


def test_unaligned_pages_report_a_partial_fallback(tmp_path: Path) -> None:
    if not direct_io_works(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    metadata, pages = build("f32-odd", seed=19)
    info = write_snapshot(tmp_path / "snap.safetensors", metadata, pages)
    assert "not multiples of 4096" in (info.fallback_reason or "")


# --------------------------------------------------------------------------------------------
# Atomic publish and failures


def test_an_exception_while_writing_keeps_the_old_snapshot(
    old_snapshot: tuple[Path, bytes],
) -> None:
    path, old = old_snapshot
    metadata, pages = build("bf16", seed=21)
    with pytest.raises(RuntimeError, match="engine died"), SnapshotWriter(path, metadata) as writer:
        writer.write_pages("layers.0.key", pages["layers.0.key"])
        raise RuntimeError("engine died")
    assert path.read_bytes() == old and temp_files(path.parent) == []


def test_commit_of_an_incomplete_snapshot_is_refused(old_snapshot: tuple[Path, bytes]) -> None:
    path, old = old_snapshot
    metadata, pages = build("bf16", seed=22)
    page = metadata.geometry.canonical_page_size_bytes
    writer = SnapshotWriter(path, metadata)
    for name in writer.tensor_order():
        writer.write_pages(name, pages[name][:-page] if name == "layers.2.value" else pages[name])
    with pytest.raises(ValueError, match=r"layers\.2\.value"):
        writer.commit()
    writer.abort()  # harmless after the failed commit
    assert path.read_bytes() == old and temp_files(path.parent) == []


def _disk_full_within(monkeypatch: pytest.MonkeyPatch, entry: fmt.TensorEntry) -> None:
    """Every write into ``entry``'s bytes fails as a full disk does (ENOSPC); others land."""
    real = local_file._pwrite_all

    def disk_full(fd: int, view: memoryview, offset: int) -> None:
        if entry.begin <= offset < entry.end:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, view, offset)

    monkeypatch.setattr(local_file, "_pwrite_all", disk_full)


def test_a_failing_disk_write_aborts_cleanly(
    old_snapshot: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, old = old_snapshot
    metadata, pages = build("bf16", seed=23)
    (layout,) = fmt.file_layouts(metadata)
    target = layout.by_name["layers.1.key"]
    _disk_full_within(monkeypatch, target)
    writer = SnapshotWriter(path, metadata, direct_io=False)
    writer.write_pages("layers.0.key", pages["layers.0.key"]).result()
    writer.write_pages("layers.0.value", pages["layers.0.value"]).result()
    failed = writer.write_pages("layers.1.key", pages["layers.1.key"])
    with pytest.raises(OSError, match="No space"):
        failed.result()
    with pytest.raises(SnapshotIOError, match="No space") as caught:
        writer.write_pages("layers.1.value", pages["layers.1.value"])
    assert isinstance(caught.value.__cause__, OSError) and str(path) in str(caught.value)
    writer.abort()
    assert path.read_bytes() == old and temp_files(path.parent) == []


def test_a_write_failing_after_the_last_page_aborts_at_commit(
    old_snapshot: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last write fails on the writer's thread after every page was handed over: the
    commit (here the context manager's) raises it and removes the temporary file at once."""
    path, old = old_snapshot
    metadata, pages = build("bf16", seed=25)
    (layout,) = fmt.file_layouts(metadata)
    names = metadata.geometry.tensor_names()
    target = layout.by_name[names[-1]]
    _disk_full_within(monkeypatch, target)
    with pytest.raises(SnapshotIOError, match="No space"):
        with SnapshotWriter(path, metadata, direct_io=False) as writer:
            futures = [writer.write_pages(name, pages[name]) for name in names]
            concurrent.futures.wait(futures)
    assert temp_files(path.parent) == []
    assert path.read_bytes() == old


def test_not_enough_free_space_is_refused_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    metadata, _ = build("bf16", seed=24)
    real = os.statvfs

    class Full:
        def __init__(self, result: os.statvfs_result) -> None:
            self.f_frsize, self.f_bavail = result.f_frsize, 1

    monkeypatch.setattr(os, "statvfs", lambda path: Full(real(path)))
    with pytest.raises(SnapshotIOError, match="needs"):
        SnapshotWriter(tmp_path / "snap.safetensors", metadata)
    assert os.listdir(tmp_path) == []


def test_writer_rejects_misuse(tmp_path: Path) -> None:
    metadata, pages = build("bf16", seed=25)
    page = metadata.geometry.canonical_page_size_bytes
    writer = SnapshotWriter(tmp_path / "snap.safetensors", metadata)
    with pytest.raises(ValueError, match=r"expected layers\.0\.key"):
        writer.write_pages("layers.0.value", pages["layers.0.value"])
    with pytest.raises(ValueError, match="not a layer tensor"):
        writer.write_pages("layers.9.key", pages["layers.0.key"])
    with pytest.raises(TypeError):
        writer.write_pages("layers.0.key", pages["layers.0.key"].view(np.int8))
    with pytest.raises(TypeError):
        writer.write_pages("layers.0.key", pages["layers.0.key"][::2])
    with pytest.raises(ValueError, match="whole pages"):
        writer.write_pages("layers.0.key", pages["layers.0.key"][: page + 1])
    writer.write_pages("layers.0.key", pages["layers.0.key"][:page])
    with pytest.raises(ValueError, match="exceed"):
        writer.write_pages("layers.0.key", pages["layers.0.key"])
    writer.abort()
    with pytest.raises(RuntimeError, match="aborted"):
        writer.write_pages("layers.0.key", pages["layers.0.key"][:page])
    bad = make_metadata(metadata.geometry, [np.arange(5)])
    bad.sequences[0].block_ids[0] = 99
    with pytest.raises(ValueError, match="block ids"):
        SnapshotWriter(tmp_path / "bad.safetensors", bad)
    assert os.listdir(tmp_path) == []


def test_inflight_bytes_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """write_pages blocks once max_inflight_bytes are held; progress resumes as writes finish."""
    metadata, pages = build("f16-32k", seed=26)
    page = metadata.geometry.canonical_page_size_bytes
    (layout,) = fmt.file_layouts(metadata)
    data = [(e.begin, e.end) for e in layout.entries if fmt.is_layer_tensor(e.name)]
    gate = threading.Event()
    real = local_file._pwrite_all

    def slow_disk(fd: int, view: memoryview, offset: int) -> None:
        if any(begin <= offset < end for begin, end in data):
            gate.wait(10)
        real(fd, view, offset)

    monkeypatch.setattr(local_file, "_pwrite_all", slow_disk)
    writer = SnapshotWriter(
        tmp_path / "snap.safetensors", metadata, max_inflight_bytes=2 * page, direct_io=False
    )
    returned: list[int] = []

    def feed() -> None:
        for name in writer.tensor_order():
            for block in range(metadata.num_blocks):
                writer.write_pages(name, pages[name][block * page : (block + 1) * page])
                returned.append(block)

    feeder = threading.Thread(target=feed)
    feeder.start()
    time.sleep(0.3)
    assert len(returned) == 2  # the third page waits for room
    gate.set()
    feeder.join(10)
    assert len(returned) == metadata.num_blocks * len(pages)
    writer.commit()
    with SnapshotReader(tmp_path / "snap.safetensors") as reader:
        assert reader.verify() == []
