"""A warm open keeps what a file version determines, and every trust check (issue 26).

``SnapshotReader`` keeps a decoded trailer by its exact bytes, and the tensor placements of
files by their entries (shared by every file of one shape), so opening the same snapshot
again, or another chunk of the same model, builds nothing per tensor. The claims under test:
bytes changed since the last open are still refused, a new version of a file at the same
path is read as itself, and files of one shape share those tables yet read as themselves.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from kvsnap import format as fmt
from kvsnap.errors import SnapshotCorruptError
from kvsnap.store import SnapshotReader
from tests.support.store_helpers import build, page_of, write_snapshot


def _written(path: Path, name: str, seed: int) -> tuple[fmt.SnapshotMetadata, dict]:
    metadata, pages = build(name, seed=seed)
    write_snapshot(path, metadata, pages)
    return metadata, pages


def test_a_warm_open_refuses_a_trailer_damaged_since_the_last(tmp_path: Path) -> None:
    path = tmp_path / "snap.safetensors"
    metadata, _ = _written(path, "bf16", seed=3)
    for _ in range(2):
        SnapshotReader(path).close()  # warm: the trailer decoded and kept
    intact = path.read_bytes()
    (layout,) = fmt.file_layouts(metadata)
    trailer = layout.by_name[fmt.CHECKSUMS_TENSOR]
    # One byte of a tensor's row, then one of the trailer's own digest: neither is served.
    for offset in (trailer.begin + fmt.DIGEST_BYTES + 3, trailer.end - 1):
        damaged = bytearray(intact)
        damaged[offset] ^= 0x10
        path.write_bytes(bytes(damaged))
        with pytest.raises(SnapshotCorruptError, match="trailer"):
            SnapshotReader(path)
    path.write_bytes(intact)
    SnapshotReader(path).close()


def test_a_new_version_at_the_same_path_is_read_as_itself(tmp_path: Path) -> None:
    path = tmp_path / "snap.safetensors"
    first, _ = _written(path, "bf16", seed=4)
    with SnapshotReader(path) as reader:
        assert reader.layer_names == tuple(first.geometry.tensor_names())
    second, pages = _written(path, "f16-32k", seed=5)
    page = second.geometry.canonical_page_size_bytes
    with SnapshotReader(path) as reader:
        assert reader.layer_names == tuple(second.geometry.tensor_names())
        name = reader.layer_names[-1]
        out = np.empty(page, dtype=np.uint8)
        reader.read_pages(name, np.array([1]), out)
        assert out.tobytes() == page_of(pages[name], page, 1)
    assert first.geometry.tensor_names() != second.geometry.tensor_names()


def test_files_of_one_shape_share_what_their_entries_determine(tmp_path: Path) -> None:
    """Two chunks of one shape (their metadata differs in the time written): each file's
    layout is its own, while the tables its entries determine (entries by name, the layer
    entries, their trailer rows, the readers' placements) are worked out once, and each reader
    still reads and checks its own file."""
    metadata, pages = build("bf16", seed=6)
    other = dataclasses.replace(metadata, created="2026-01-02T03:04:05Z")
    paths = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    write_snapshot(paths[0], metadata, pages)
    write_snapshot(paths[1], other, pages)
    page = metadata.geometry.canonical_page_size_bytes
    with SnapshotReader(paths[0]) as first, SnapshotReader(paths[1]) as second:
        one, two = first.open_files[0].layout, second.open_files[0].layout
        assert one.header != two.header
        assert one.by_name is two.by_name
        assert one.layer_entries is two.layer_entries
        assert one.checksum_rows is two.checksum_rows
        name = first.layer_names[0]
        assert first.placement(name) is second.placement(name)
        for reader in (first, second):
            assert reader.verify() == []
            out = np.empty(page, dtype=np.uint8)
            reader.read_pages(name, np.array([2]), out)
            assert out.tobytes() == page_of(pages[name], page, 2)
