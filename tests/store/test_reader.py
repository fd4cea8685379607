"""The reader: subset reads, misuse refused, damaged files refused and every single-byte flip
named, and peak memory bounded for a snapshot far larger than the staging memory."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from kvsnap import format as fmt
from kvsnap.caches import clear_caches
from kvsnap.errors import KVSnapError, NotASnapshotError, SnapshotCorruptError, SnapshotIOError
from kvsnap.store import SnapshotReader
from kvsnap.store.read.source import Source
from tests.support.reads import record_preadv
from tests.support.store_helpers import build, page_of, write_snapshot

SUPPORT = Path(__file__).resolve().parents[1] / "support"


# --------------------------------------------------------------------------------------------
# Reading


def test_subset_reads_touch_only_those_ranges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    metadata, pages = build("f16-32k", seed=27)
    page = metadata.geometry.canonical_page_size_bytes
    path = tmp_path / "snap.safetensors"
    write_snapshot(path, metadata, pages)
    (layout,) = fmt.file_layouts(metadata)
    entry = layout.by_name["layers.1.value"]
    reads: list[tuple[int, int]] = []
    real = os.preadv

    def recording(fd: int, buffers: list[memoryview], offset: int) -> int:
        reads.append((offset, sum(len(b) for b in buffers)))
        return real(fd, buffers, offset)

    with SnapshotReader(path) as reader:
        monkeypatch.setattr(os, "preadv", recording)
        ids = np.array([5, 6, 7, 2, 9])
        out = np.empty(len(ids) * page, dtype=np.uint8)
        reader.read_pages("layers.1.value", ids, out)
    data_reads = sorted(r for r in reads if entry.begin <= r[0] < entry.end)
    assert data_reads == [(entry.begin + b * page, n * page) for b, n in ((2, 1), (5, 3), (9, 1))]
    other = [r for r in reads if not entry.begin <= r[0] < entry.end]
    checksums = layout.by_name[fmt.BLOCK_CHECKSUMS_TENSOR]
    assert other == [(checksums.begin + 3 * metadata.num_blocks * 8, metadata.num_blocks * 8)]
    assert out.tobytes() == b"".join(
        page_of(pages["layers.1.value"], page, b) for b in ids.tolist()
    )


def test_reader_rejects_misuse(old_snapshot: tuple[Path, bytes]) -> None:
    path, _ = old_snapshot
    with SnapshotReader(path) as reader:
        page = reader.page_size_bytes("layers.0.key")
        with pytest.raises(KeyError):
            reader.page_size_bytes("sequences.0.token_ids")
        with pytest.raises(ValueError, match="need"):
            reader.read_pages("layers.0.key", [0, 1], np.empty(page, dtype=np.uint8))
        with pytest.raises(IndexError):
            reader.read_pages(
                "layers.0.key", [reader.metadata.num_blocks], np.empty(page, dtype=np.uint8)
            )
        with pytest.raises(TypeError):
            reader.read_pages("layers.0.key", [0], np.empty(page, dtype=np.float32))
        reader.read_pages("layers.0.key", [], np.empty(0, dtype=np.uint8))


def test_unreadable_targets_raise_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(SnapshotIOError, match="no such file"):
        SnapshotReader(tmp_path / "missing.safetensors")
    with pytest.raises(NotASnapshotError, match="regular file"):
        SnapshotReader(tmp_path)
    (tmp_path / "empty.safetensors").write_bytes(b"")
    with pytest.raises(NotASnapshotError, match="too short"):
        SnapshotReader(tmp_path / "empty.safetensors")
    save_file({"weight": torch.zeros(3)}, tmp_path / "model.safetensors")
    with pytest.raises(NotASnapshotError, match="without kvsnap metadata"):
        SnapshotReader(tmp_path / "model.safetensors")
    rng = np.random.default_rng(28)
    for size in [1, 7, 8, 9, 100, 4096, 100_000, *rng.integers(10, 50_000, 30).tolist()]:
        junk = tmp_path / "junk.bin"
        junk.write_bytes(rng.bytes(size))
        with pytest.raises(KVSnapError):
            SnapshotReader(junk)


def test_truncated_and_extended_files_are_refused(old_snapshot: tuple[Path, bytes]) -> None:
    path, data = old_snapshot
    rng = np.random.default_rng(29)
    cut = path.parent / "cut.safetensors"
    (layout,) = fmt.file_layouts(SnapshotReader(path).metadata)
    edges = [0, 7, 8, 9, layout.data_start - 1, layout.data_start, len(data) - 1]
    for length in [*edges, *rng.integers(0, len(data), 150).tolist()]:
        cut.write_bytes(data[:length])
        with pytest.raises(KVSnapError) as caught:
            SnapshotReader(cut)
        assert isinstance(caught.value, NotASnapshotError if length < 8 else SnapshotCorruptError)
        assert str(cut) in str(caught.value)
    cut.write_bytes(data + b"\0" * 16)
    with pytest.raises(SnapshotCorruptError, match="trailing data"):
        SnapshotReader(cut)


def test_a_header_claiming_terabytes_allocates_nothing(old_snapshot: tuple[Path, bytes]) -> None:
    path, data = old_snapshot
    for claim, error in ((1 << 40, NotASnapshotError), (90_000_000, SnapshotCorruptError)):
        path.write_bytes(struct.pack("<Q", claim) + data[8:])
        tracemalloc.start()
        try:
            with pytest.raises(error):
                SnapshotReader(path)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20


def test_verify_finds_tokens_that_do_not_match_their_prefix_hashes(
    old_snapshot: tuple[Path, bytes],
) -> None:
    """Checksums guard the bytes; verify also re-derives the hash chains from the token ids."""
    path, data = old_snapshot
    metadata = SnapshotReader(path).metadata
    (layout,) = fmt.file_layouts(metadata)
    raw = bytearray(data)
    entry = layout.by_name["sequences.0.token_ids"]
    raw[entry.begin] ^= 0x01  # change a token id, then fix every checksum that covers it
    trailer_entry = layout.by_name[fmt.CHECKSUMS_TENSOR]
    digests = fmt.decode_trailer(bytes(raw[trailer_entry.begin : trailer_entry.end]))
    row = 1 + [e.name for e in layout.checksummed()].index(entry.name)
    digests[row] = fmt.digest128(bytes(raw[entry.begin : entry.end]))
    raw[trailer_entry.begin : trailer_entry.end] = fmt.encode_trailer(digests)
    path.write_bytes(bytes(raw))
    with SnapshotReader(path) as reader:
        problems = reader.verify()
    assert [p.tensor for p in problems] == ["sequences.0.token_ids"]
    assert "hash" in problems[0].message


# --------------------------------------------------------------------------------------------
# Single-byte flips: every one is detected and named


def _region(layout: fmt.FileLayout, position: int) -> tuple[str | None, int | None]:
    """(tensor, block) a file offset belongs to; (None, None) for the header."""
    if position < layout.data_start:
        return None, None
    for entry in layout.entries:
        if entry.begin <= position < entry.end:
            if fmt.is_layer_tensor(entry.name):
                page = entry.nbytes // entry.shape[0]
                return entry.name, (position - entry.begin) // page
            return entry.name, None
    raise AssertionError(position)


def _region_kind(tensor: str | None) -> str:
    if tensor is None:
        return "header"
    if fmt.is_layer_tensor(tensor):
        return "layers"
    if tensor.startswith(fmt.PADDING_PREFIX):
        return "padding"
    if tensor.startswith("sequences."):
        return "sequences." + tensor.rsplit(".", 1)[1]
    return tensor


@pytest.mark.parametrize(
    ("name", "seed", "whole"),
    [("bf16", 30, False), ("mla-f8", 31, False), ("f32-odd", 32, False), ("bf16", 35, True)],
)
def test_every_single_byte_flip_is_detected_and_named(
    tmp_path: Path, name: str, seed: int, whole: bool
) -> None:
    """340 flips per geometry, 1360 in all: header (JSON and its space padding), KV pages,
    sequences, block hashes, padding, block checksums, trailer. None goes unnoticed; KV flips
    are named by tensor and block, everything else by tensor (or the file, for the header).
    ``whole``: the file read whole as it opens and every read served from those bytes
    (``read_whole_max_bytes``), checked the same way."""
    metadata, pages = build(name, seed=seed, extra_blocks=1)
    page = metadata.geometry.canonical_page_size_bytes
    path = tmp_path / "snap.safetensors"
    write_snapshot(path, metadata, pages)
    original = path.read_bytes()
    (layout,) = fmt.file_layouts(metadata)
    assert layout.file_size == len(original)
    rng = np.random.default_rng(seed)
    layers = [e for e in layout.entries if fmt.is_layer_tensor(e.name)]
    others = [e for e in layout.entries if not fmt.is_layer_tensor(e.name)]
    positions = [int(p) for p in rng.integers(0, layout.data_start, 110)]
    # KV pages weighted by size; every other tensor equally often, however small.
    weights = np.array([e.nbytes for e in layers], dtype=float)
    for index in rng.choice(len(layers), size=115, p=weights / weights.sum()).tolist():
        positions.append(int(rng.integers(layers[index].begin, layers[index].end)))
    for index in rng.integers(0, len(others), size=115).tolist():
        positions.append(int(rng.integers(others[index].begin, others[index].end)))
    flipped_path = tmp_path / "flipped.safetensors"
    seen_regions: set[str] = set()
    for position in positions:
        flipped = bytearray(original)
        flipped[position] ^= 1 << int(rng.integers(0, 8))
        flipped_path.write_bytes(bytes(flipped))
        tensor, block = _region(layout, position)
        seen_regions.add(_region_kind(tensor))
        try:
            reader = SnapshotReader(flipped_path, read_whole_max_bytes=len(original) * whole)
        except KVSnapError as error:
            # Refused at open: the header, the trailer or a metadata tensor, named precisely.
            assert str(flipped_path) in str(error)
            if tensor is not None:
                assert error.tensor == tensor
                assert tensor.startswith(
                    ("sequences.", fmt.BLOCK_HASHES_TENSOR, fmt.CHECKSUMS_TENSOR)
                )
            continue
        with reader:
            assert reader.open_files[0].source.holds_whole is whole
            problems = reader.verify()
            assert problems, f"flip at {position} ({tensor}, block {block}) went unnoticed"
            named = {(p.tensor, p.block) for p in problems}
            if tensor is not None and fmt.is_layer_tensor(tensor):
                assert (tensor, block) in named
                with pytest.raises(SnapshotCorruptError) as caught:
                    reader.read_pages(tensor, [block], np.empty(page, dtype=np.uint8))
                assert (caught.value.tensor, caught.value.block) == (tensor, block)
                other = (block + 1) % metadata.num_blocks
                reader.read_pages(tensor, [other], np.empty(page, dtype=np.uint8))
            else:
                assert tensor in {t for t, _ in named}, (tensor, problems)
    assert len(positions) == 340
    assert seen_regions == {
        "header",
        "layers",
        "sequences.token_ids",
        "sequences.block_ids",
        fmt.BLOCK_HASHES_TENSOR,
        fmt.BLOCK_CHECKSUMS_TENSOR,
        fmt.CHECKSUMS_TENSOR,
        "padding",
    }


# --------------------------------------------------------------------------------------------
# Memory: a snapshot far larger than the staging and in-flight bounds


def _probe(tmp_path: Path, total_mib: int) -> dict[str, float]:
    result = subprocess.run(
        [
            sys.executable,
            str(SUPPORT / "store_memory_probe.py"),
            str(tmp_path / "big.safetensors"),
            str(total_mib),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


#: Peak RSS the probe may add over its baseline: 4 x 8 MiB staging slots are in the baseline;
#: the bound covers the reader's verify pieces, xxhash/numpy temporaries and allocator slack.
PEAK_RSS_BOUND_MIB = 96


def test_peak_memory_is_bounded_for_a_512_mib_snapshot(tmp_path: Path) -> None:
    result = _probe(tmp_path, 512)
    added_mib = (result["peak_kib"] - result["baseline_kib"]) / 1024
    assert result["snapshot_bytes"] > 512 << 20
    assert added_mib < PEAK_RSS_BOUND_MIB, result


@pytest.mark.slow
def test_peak_memory_is_bounded_for_a_4_gib_snapshot(tmp_path: Path) -> None:
    result = _probe(tmp_path, 4096)
    added_mib = (result["peak_kib"] - result["baseline_kib"]) / 1024
    assert result["snapshot_bytes"] > 4 << 30
    assert added_mib < PEAK_RSS_BOUND_MIB, result


@pytest.mark.parametrize("name", ["bf16", "f16-32k"])
def test_verify_reads_layer_tensors_that_follow_each_other_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """A prefix chunk is dozens of small layer tensors: verify reads the tensors that follow
    each other in the file (alignment padding apart) with one read, and their checksum rows
    with one more, not one each per tensor, and still names a flipped page by tensor and
    block."""
    metadata, pages = build(name, seed=33)
    path = tmp_path / "snap.safetensors"
    write_snapshot(path, metadata, pages)
    (layout,) = fmt.file_layouts(metadata)
    layers = [entry for entry in layout.entries if fmt.is_layer_tensor(entry.name)]
    runs = 1  # tensors of these small files lie at most the alignment padding apart
    assert len(layers) > 2
    reads: list[int] = []
    real = os.preadv

    def recording(fd: int, buffers: list[memoryview], offset: int) -> int:
        reads.append(offset)
        return real(fd, buffers, offset)

    with SnapshotReader(path) as reader:
        monkeypatch.setattr(os, "preadv", recording)
        assert reader.verify() == []
        monkeypatch.setattr(os, "preadv", real)
    low, high = layers[0].begin, layers[-1].end
    padding = {e.begin for e in layout.entries if e.name.startswith(fmt.PADDING_PREFIX)}
    data_reads = [offset for offset in reads if low <= offset < high and offset not in padding]
    assert data_reads == [low] * runs
    checksums = layout.by_name[fmt.BLOCK_CHECKSUMS_TENSOR]
    # The rows for the run, and the whole table the open reads for itself: not one per tensor.
    assert len([o for o in reads if checksums.begin <= o < checksums.end]) <= runs + 1
    page = metadata.geometry.canonical_page_size_bytes
    target = layers[len(layers) // 2]
    data = bytearray(path.read_bytes())
    data[target.begin + 2 * page + 1] ^= 0x10
    data[layers[0].end - 1] ^= 0x01  # the last page of the first tensor, too
    path.write_bytes(bytes(data))
    last = metadata.num_blocks - 1
    with SnapshotReader(path) as reader:
        problems = reader.verify()
    found = [(problem.tensor, problem.block) for problem in problems]
    assert found == [(layers[0].name, last), (target.name, 2)]


@pytest.mark.parametrize("tamper", [False, True])
def test_a_full_verify_leaves_the_checked_checksum_table_for_the_next_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tamper: bool
) -> None:
    """A chunk verified by one reader (the scheduler's check) is restored by another (the
    worker's): the block-checksum rows the verify checked against the trailer are kept, and the
    next reader's table is not read and checked again. Rows that fail their check are not kept:
    the next reader reads them and refuses them itself."""
    clear_caches()
    metadata, pages = build("f16-32k", seed=34)
    path = tmp_path / "snap.safetensors"
    write_snapshot(path, metadata, pages)
    (layout,) = fmt.file_layouts(metadata)
    rows = layout.by_name[fmt.BLOCK_CHECKSUMS_TENSOR]
    if tamper:  # a stored checksum of the last tensor, whose trailer digest then disagrees
        data = bytearray(path.read_bytes())
        data[rows.end - 1] ^= 0x01
        path.write_bytes(bytes(data))
    with SnapshotReader(path) as reader:
        problems = reader.verify()
    assert bool(problems) is tamper
    reads: list[int] = []
    real = os.preadv

    def recording(fd: int, buffers: list[memoryview], offset: int) -> int:
        reads.append(offset)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", recording)
    with SnapshotReader(path) as reader:
        if tamper:
            with pytest.raises(SnapshotCorruptError, match="block checksums"):
                reader.checksums.table()
        else:
            table = reader.checksums.table()
            expected = np.frombuffer(path.read_bytes()[rows.begin : rows.end], dtype="<u8")
            assert np.array_equal(table.reshape(-1), expected)
    assert any(rows.begin <= offset < rows.end for offset in reads) is tamper


def test_a_small_file_read_whole_is_read_once_and_served_as_it_was_then(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``read_whole_max_bytes``: a file no larger is read with one ``preadv`` as it opens, and
    its header, trailer, metadata, verify and page reads are served from those bytes, one
    version of the file, every page still checked; a larger file is read piece by piece."""
    metadata, pages = build("bf16", seed=36)
    page = metadata.geometry.canonical_page_size_bytes
    path = tmp_path / "snap.safetensors"
    write_snapshot(path, metadata, pages)
    size = path.stat().st_size
    reads = record_preadv(monkeypatch)
    blocks = np.arange(metadata.num_blocks)
    out = np.empty(len(blocks) * page, dtype=np.uint8)
    expected = b"".join(page_of(pages["layers.1.value"], page, b) for b in blocks.tolist())
    with SnapshotReader(path, read_whole_max_bytes=size) as reader:
        assert reader.open_files[0].source.holds_whole
        # Another version of the file written in place after the open is never seen.
        flipped = bytearray(path.read_bytes())
        (layout,) = fmt.file_layouts(metadata)
        entry = layout.by_name["layers.1.value"]
        flipped[entry.begin + 2 * page + 7] ^= 0x20
        with path.open("r+b") as handle:
            handle.write(bytes(flipped))
        assert reader.verify() == []
        reader.read_pages("layers.1.value", blocks, out)
    assert reads == [(0, size)]
    assert out.tobytes() == expected
    # The flipped version, read whole: its page is refused and named, the others served.
    reads.clear()
    with SnapshotReader(path, read_whole_max_bytes=size) as reader:
        problems = reader.verify()
        assert [(p.tensor, p.block) for p in problems] == [("layers.1.value", 2)]
        with pytest.raises(SnapshotCorruptError) as caught:
            reader.read_pages("layers.1.value", [2], np.empty(page, dtype=np.uint8))
        assert (caught.value.tensor, caught.value.block) == ("layers.1.value", 2)
        reader.read_pages("layers.1.value", [3], out[:page])
    assert reads == [(0, size)]
    assert out[:page].tobytes() == page_of(pages["layers.1.value"], page, 3)
    # One byte over the bound: read as before, one read per header, tensor and run.
    reads.clear()
    with SnapshotReader(path, read_whole_max_bytes=size - 1) as reader:
        assert not reader.open_files[0].source.holds_whole
        reader.verify()
    assert len(reads) > 2 and (0, size) not in reads


def test_verify_of_a_file_read_whole_reads_nothing_the_open_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file read whole as it opens: its trailer and metadata tensors, read and checked by the
    open, are not read or hashed again by ``verify`` (the same bytes, the same digests), and a
    flip in any of them is still refused as the file opens, named."""
    metadata, pages = build("bf16", seed=37)
    path = tmp_path / "snap.safetensors"
    write_snapshot(path, metadata, pages)
    original = path.read_bytes()
    reads: list[tuple[int, int]] = []
    real = Source.read

    def recording(self: Source, offset: int, size: int, *, tensor: str | None = None) -> bytes:
        reads.append((offset, size))
        return real(self, offset, size, tensor=tensor)

    monkeypatch.setattr(Source, "read", recording)
    hashed: list[bytes] = []
    real_digest = fmt.digest128

    def recording_digest(data: bytes | memoryview | np.ndarray) -> bytes:
        hashed.append(bytes(memoryview(data).cast("B")))
        return real_digest(data)

    monkeypatch.setattr(fmt, "digest128", recording_digest)
    with SnapshotReader(path, read_whole_max_bytes=len(original)) as reader:
        assert reader.verify() == []
    assert len(reads) == len(set(reads)), sorted(reads)
    (layout,) = fmt.file_layouts(metadata)
    checked_at_open = [
        name for name in layout.by_name if name.startswith(("sequences.", fmt.BLOCK_HASHES_TENSOR))
    ]
    for name in [*checked_at_open, fmt.BLOCK_CHECKSUMS_TENSOR]:
        entry = layout.by_name[name]
        assert hashed.count(original[entry.begin : entry.end]) == 1, name
    monkeypatch.undo()
    for name in [*checked_at_open, fmt.CHECKSUMS_TENSOR]:
        entry = layout.by_name[name]
        flipped = bytearray(original)
        flipped[entry.begin] ^= 0x04
        path.write_bytes(bytes(flipped))
        with pytest.raises(SnapshotCorruptError) as caught:
            SnapshotReader(path, read_whole_max_bytes=len(original))
        assert caught.value.tensor == name
