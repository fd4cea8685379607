"""Opening a path in one step: which of the three forms a path holds (single file, sharded,
parted) is told by one resolver, and opening each form is counted on real files: at most two
``stat`` calls to resolve, one read of the index, and one open (and its ``fstat``) per data file.
"""

from __future__ import annotations

import builtins
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from kvsnap import format as fmt
from kvsnap.errors import NotASnapshotError, SnapshotIOError
from kvsnap.snapshot import Snapshot
from kvsnap.store import SnapshotReader
from kvsnap.store.head_parts import OpenedSnapshot, open_snapshot
from kvsnap.store.location import locate
from kvsnap.store.resolve import Form, committed_file, resolve
from tests.support.parts_helpers import parted_snapshot
from tests.support.store_helpers import (
    GEOMETRIES,
    make_metadata,
    random_pages,
    shared_prefix_tokens,
)
from tests.support.store_helpers import write_snapshot as write


@dataclass
class Calls:
    """File system calls on paths under one directory, by path."""

    root: str
    opens: Counter[str] = field(default_factory=Counter)
    stats: Counter[str] = field(default_factory=Counter)  # stat, lstat, exists, is_file, ...
    fstats: Counter[str] = field(default_factory=Counter)
    parses: int = 0
    descriptors: dict[int, str] = field(default_factory=dict)

    def name(self, path: object) -> str | None:
        text = os.fsdecode(path) if isinstance(path, str | bytes | os.PathLike) else None
        if text is None or not os.path.abspath(text).startswith(self.root):
            return None
        return os.path.basename(text)

    def reset(self) -> None:
        self.opens.clear()
        self.stats.clear()
        self.fstats.clear()
        self.parses = 0

    @property
    def total_stats(self) -> int:
        return sum(self.stats.values()) + sum(self.fstats.values())


@pytest.fixture
def calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Calls]:
    """Count from here on every open, stat and fstat of a file under ``tmp_path``, and every
    parse of an index."""
    counted = Calls(str(tmp_path))
    real_open, real_stat, real_lstat, real_fstat = os.open, os.stat, os.lstat, os.fstat
    real_builtin_open = builtins.open
    real_decode, real_decode_parts = fmt.decode_index, fmt.decode_parts_index

    def counting_open(path, *args, **kwargs):
        fd = real_open(path, *args, **kwargs)
        name = counted.name(path)
        if name is not None:
            counted.opens[name] += 1
            counted.descriptors[fd] = name
        return fd

    def counting_builtin_open(file, *args, **kwargs):
        name = counted.name(file)
        if name is not None:
            counted.opens[name] += 1
        return real_builtin_open(file, *args, **kwargs)

    def counting(real):
        def stat(path, *args, **kwargs):
            name = counted.name(path)
            if name is not None:
                counted.stats[name] += 1
            return real(path, *args, **kwargs)

        return stat

    def counting_fstat(fd):
        if fd in counted.descriptors:
            counted.fstats[counted.descriptors[fd]] += 1
        return real_fstat(fd)

    def counting_decode(real):
        def decode(*args, **kwargs):
            counted.parses += 1
            return real(*args, **kwargs)

        return decode

    monkeypatch.setattr(os, "open", counting_open)
    monkeypatch.setattr(builtins, "open", counting_builtin_open)
    monkeypatch.setattr(os, "stat", counting(real_stat))
    monkeypatch.setattr(os, "lstat", counting(real_lstat))
    monkeypatch.setattr(os, "fstat", counting_fstat)
    monkeypatch.setattr(fmt, "decode_index", counting_decode(real_decode))
    monkeypatch.setattr(fmt, "decode_parts_index", counting_decode(real_decode_parts))
    yield counted


def _single(path: Path) -> None:
    metadata, pages = _build(7)
    write(path, metadata, pages)


def _sharded(path: Path) -> tuple[str, ...]:
    metadata, pages = _build(8)
    limit = max(data.nbytes for data in pages.values()) + 100
    info = write(path, metadata, pages, max_shard_bytes=limit)
    assert len(info.files) >= 3
    return tuple(Path(file).name for file in info.files)


def _build(seed: int) -> tuple[fmt.SnapshotMetadata, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    geometry = GEOMETRIES["bf16"]
    metadata = make_metadata(geometry, shared_prefix_tokens(rng, geometry.block_size))
    return metadata, random_pages(rng, metadata)


def _part_names(path: Path) -> tuple[str, ...]:
    raw = Path(f"{path}.index.json").read_bytes()
    return tuple(part.file for part in fmt.decode_parts_index(raw).parts)


def _read_everything(opened: OpenedSnapshot) -> int:
    total = 0
    for reader in (part.reader for part in opened.parts):
        for name in reader.tensor_names():
            total += reader.read_tensor(name).numel()
        reader.close()
    return total


def _assert_each_file_opened_once(calls: Calls, files: tuple[str, ...]) -> None:
    """Every file the snapshot consists of opened exactly once and its descriptor asked one
    ``fstat``; nothing else opened."""
    assert calls.opens == Counter(dict.fromkeys(files, 1)), calls.opens
    assert calls.fstats == Counter(dict.fromkeys(files, 1)), calls.fstats


def test_opening_a_single_file_takes_two_stats_and_one_open(tmp_path: Path, calls: Calls) -> None:
    path = tmp_path / "snap.safetensors"
    _single(path)
    _read_everything(open_snapshot(path))  # headers decoded, modules imported: a warm open
    calls.reset()
    opened = open_snapshot(path)
    assert [type(part.reader) for part in opened.parts] == [SnapshotReader]
    _assert_each_file_opened_once(calls, (path.name,))
    assert calls.stats == Counter({path.name: 1}) and calls.total_stats == 2
    assert calls.parses == 0 and _read_everything(opened) > 0


@pytest.mark.parametrize("by", ["name", "index"])
def test_opening_a_sharded_snapshot_reads_its_index_once_and_opens_each_shard_once(
    tmp_path: Path, calls: Calls, by: str
) -> None:
    path = tmp_path / "snap.safetensors"
    shards = _sharded(path)
    index = f"{path.name}.index.json"
    target = path if by == "name" else tmp_path / index
    _read_everything(open_snapshot(target))
    calls.reset()
    opened = open_snapshot(target)
    _assert_each_file_opened_once(calls, (index, *shards))
    # Resolving: one stat finding no single file (none when named by the index), the index's
    # fstat; then one fstat per shard.
    assert calls.stats == (Counter({path.name: 1}) if by == "name" else Counter())
    assert calls.total_stats - len(shards) <= 2 and calls.parses == 1
    assert len(opened.parts) == 1 and opened.index is None and _read_everything(opened) > 0


@pytest.mark.parametrize("by", ["name", "index"])
def test_opening_a_parted_snapshot_reads_its_index_once_and_opens_each_part_once(
    tmp_path: Path, calls: Calls, by: str
) -> None:
    path = tmp_path / "snap.safetensors"
    parted_snapshot(path, tp=2)
    parts = _part_names(path)
    index = f"{path.name}.index.json"
    target = path if by == "name" else tmp_path / index
    _read_everything(open_snapshot(target))
    calls.reset()
    opened = open_snapshot(target)
    assert opened.index is not None and len(opened.parts) == len(parts) == 2
    _assert_each_file_opened_once(calls, (index, *parts))
    assert calls.stats == (Counter({path.name: 1}) if by == "name" else Counter())
    assert calls.total_stats - len(parts) <= 2 and calls.parses == 1
    assert _read_everything(opened) > 0


def test_the_facade_open_costs_no_more_than_before(tmp_path: Path, calls: Calls) -> None:
    """``Snapshot.open`` of a single file (a warm restore opens each chunk so): one open, and
    at most the three stats it took before the resolver (one to rule out a parted snapshot,
    one to find the file, the descriptor's ``fstat``)."""
    path = tmp_path / "snap.safetensors"
    _single(path)
    Snapshot.open(path).close()
    calls.reset()
    Snapshot.open(path).close()
    assert calls.opens == Counter({path.name: 1}) and calls.total_stats <= 3


def test_resolve_tells_the_forms_apart_and_keeps_what_it_found(tmp_path: Path) -> None:
    single, sharded, parted = (tmp_path / f"{form.value}.safetensors" for form in Form)
    _single(single)
    shards = _sharded(sharded)
    parted_snapshot(parted)
    found = resolve(locate(single, None))
    assert found.form is Form.SINGLE and found.members == (found.location,)
    assert found.index is None and found.status is not None
    assert (found.status.st_ino, found.status.st_size) == (
        single.stat().st_ino,
        single.stat().st_size,
    )
    for name in (sharded, Path(f"{sharded}.index.json")):
        found = resolve(locate(name, None))
        assert found.form is Form.SHARDED and isinstance(found.index, fmt.ShardIndex)
        assert tuple(member.name for member in found.members) == shards
        assert found.index_location is not None
        assert found.index_location.path == f"{sharded}.index.json"
        assert found.status is not None
        assert found.status.st_ino == Path(f"{sharded}.index.json").stat().st_ino
        assert found.directory == os.path.realpath(tmp_path)
    found = resolve(locate(parted, None))
    assert found.form is Form.PARTED and isinstance(found.index, fmt.PartsIndex)
    assert tuple(member.name for member in found.members) == _part_names(parted)
    with pytest.raises(SnapshotIOError, match="no such file") as caught:
        resolve(locate(tmp_path / "missing.safetensors", None))
    assert caught.value.file == str(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors.index.json").write_text("{not json")
    with pytest.raises(NotASnapshotError, match="not valid JSON"):
        resolve(locate(tmp_path / "junk.safetensors", None))


def test_committed_file_takes_two_stats_and_prefers_the_single_file(
    tmp_path: Path, calls: Calls
) -> None:
    single, sharded = tmp_path / "single.safetensors", tmp_path / "sharded.safetensors"
    _single(single)
    _sharded(sharded)
    calls.reset()
    found = committed_file(locate(single, None))
    assert found is not None and not found.indexed and found.location.path == str(single)
    assert calls.total_stats == 1
    index = committed_file(locate(sharded, None))
    assert index is not None and index.indexed and index.location.name.endswith(".index.json")
    assert index.status is not None and index.status.st_size == index.size
    assert committed_file(locate(tmp_path / "none.safetensors", None)) is None
    assert calls.total_stats == 1 + 2 + 2
    # While a single file replaces the sharded form, both exist: the single file is the one.
    os.link(single, sharded)
    found = committed_file(locate(sharded, None))
    assert found is not None and found.location.path == str(sharded)
    # Named by its index, the index is what a reader opens.
    found = committed_file(locate(Path(f"{sharded}.index.json"), None))
    assert found is not None and found.indexed
    with SnapshotReader(sharded) as reader:
        assert reader.files == [str(sharded)]


def test_the_prefix_store_finds_a_chunk_with_one_stat_or_two(tmp_path: Path, calls: Calls) -> None:
    """The vLLM prefix store asks the same resolver: a single-file chunk is found with one
    ``stat``, a parted one with two (no index read), a missing one with two."""
    from kvsnap.engines.vllm.chunk_check import file_key
    from kvsnap.engines.vllm.prefix_store import PrefixStore

    store = PrefixStore(tmp_path / "store", "space")
    single, parted = store.chunk_path("a" * 64), store.chunk_path("b" * 64)
    store.chunk_directory(single)
    store.chunk_directory(parted)
    _single(single)
    parted_snapshot(parted)
    calls.reset()
    assert store.has_chunk(single) and calls.total_stats == 1
    assert store.has_chunk(parted) and calls.total_stats == 1 + 2
    assert not store.has_chunk(store.chunk_path("c" * 64)) and calls.total_stats == 1 + 2 + 2
    assert calls.opens == Counter() and calls.parses == 0
    index = Path(f"{parted}.index.json").stat()
    assert file_key(str(parted)) == (
        index.st_dev,
        index.st_ino,
        index.st_size,
        index.st_mtime_ns,
        index.st_ctime_ns,
        True,
    )


@pytest.mark.parametrize("form", ["single", "sharded"])
def test_opening_through_fsspec_asks_the_filesystem_as_little(
    monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    """On an fsspec filesystem (one request each on an object store): one lookup finds the
    form, the index is sized and read once, and each data file is opened once, its size taken
    from the open file."""
    import threading

    import fsspec

    fs = fsspec.filesystem("memory")
    url = f"memory://resolve-{form}/snap.safetensors"
    metadata, pages = _build(9)
    limit = max(data.nbytes for data in pages.values()) + 100 if form == "sharded" else None
    info = write(url, metadata, pages, max_shard_bytes=limit)
    assert locate(url, None).fs is fs  # the filesystem counted below is the one the store uses
    calls: Counter[str] = Counter()
    depth = threading.local()

    def counted(kind: str, method):
        def call(*args, **kwargs):
            outer = not getattr(depth, "value", 0)
            depth.value = getattr(depth, "value", 0) + 1
            try:
                if outer:  # what the store asks, not what fsspec asks itself meanwhile
                    calls[kind] += 1
                return method(*args, **kwargs)
            finally:
                depth.value -= 1

        return call

    for name, kind in [("info", "stat"), ("size", "stat"), ("exists", "stat"), ("isfile", "stat")]:
        monkeypatch.setattr(fs, name, counted(kind, getattr(fs, name)))
    monkeypatch.setattr(fs, "open", counted("open", fs.open))
    monkeypatch.setattr(fs, "cat_file", counted("index read", fs.cat_file))
    opened = open_snapshot(url)
    assert [file for part in opened.parts for file in part.reader.files] == list(info.files)
    if form == "single":
        assert calls == Counter({"stat": 1, "open": 1})
    else:  # the lookup missing NAME, and the index's size; then its read and a shard's opens
        assert calls == Counter({"stat": 2, "index read": 1, "open": len(info.files)})
    assert _read_everything(opened) > 0
    fs.rm(f"/resolve-{form}", recursive=True)
