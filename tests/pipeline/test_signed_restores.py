"""With keys, every page a restore delivers is checked against its signed BLAKE3 digest where
it lands, whatever path carries it: the staging slots' reads (on the read threads, or inline
for a small slot), a file held whole going straight into a host cache, and the copy kernel run
by Triton's interpreter on host memory. A signed capture binds every page.

The bad page is a real forgery (tests/support/xxh3_forgery.py): other bytes carrying the
signed page's xxh3-64, so the file's every checksum still matches and, without the key, a
restore loads it. It is written into the file after the reader opened it and checked its
signature (before, for a file held whole: read as it opens): nothing remembered from the open
vouches for a page, only its digest, checked where the page lands.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from kvsnap import format as fmt
from kvsnap.errors import RestoreIncompleteError
from kvsnap.format.signing import KeyRing
from kvsnap.pipeline import fused
from kvsnap.snapshot import Snapshot, capture
from kvsnap.store import SnapshotReader, tuning
from kvsnap.store.head_parts import open_snapshot
from tests.support.pipeline_caches import (
    SOURCE,
    assert_restored,
    caches,
    flip_byte,
    sequences,
)
from tests.support.xxh3_forgery import forge_page

KEYS = KeyRing([bytes(range(32))])
#: Device blocks of the one sequence captured (snapshot blocks 0..3), and where they go.
USED, TARGETS = [3, 7, 1, 9], [0, 2, 4, 5]
#: The page forged: block 2 of this tensor (target block 4).
FORGED = ("layers.1.value", 2)


def _page_span(path: Path, name: str, block: int) -> tuple[int, int]:
    with SnapshotReader(path) as reader:
        _, entry = reader.locate(name)
        page = reader.page_bytes
    return entry.begin + block * page, entry.begin + (block + 1) * page


@pytest.fixture(scope="module")
def forged_page(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """Other bytes with the xxh3-64 of the signed capture's page ``FORGED`` (the captures
    below are all of the same content)."""
    path, _, _ = _signed_capture(tmp_path_factory.mktemp("forge"))
    begin, end = _page_span(path, *FORGED)
    page = path.read_bytes()[begin:end]
    other = np.random.default_rng(1).integers(0, 256, end - begin, dtype=np.uint8).tobytes()
    forged = forge_page(other, xxhash.xxh3_64_intdigest(page))
    assert forged != page and xxhash.xxh3_64_intdigest(forged) == xxhash.xxh3_64_intdigest(page)
    return forged


def _plant(path: Path, forged: bytes) -> None:
    """Write the forged page in place of ``FORGED`` (the same inode: in place)."""
    begin, _ = _page_span(path, *FORGED)
    with open(path, "r+b") as handle:
        handle.seek(begin)
        handle.write(forged)


def _signed_capture(tmp_path: Path, kind: str = "vllm-nhd") -> tuple[Path, object, list]:
    sources, content = caches(kind, heads=4, blocks=12)
    path = tmp_path / "signed.safetensors"
    capture([c.layout for c in sources], sequences([USED]), path, source=SOURCE, keys=KEYS)
    return path, content, sources


@pytest.mark.parametrize("interpreted", [False, True], ids=["numpy", "triton-interpreter"])
def test_a_signed_capture_binds_every_page_by_its_blake3_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, interpreted: bool
) -> None:
    if interpreted:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(fused, "run_on_cpu", None)  # the kernel copies, not numpy
    path, _, _ = _signed_capture(tmp_path)
    with Snapshot.open(path, keys=KEYS) as snap:
        reader = snap.reader
        table = reader.page_digest_table
        assert table is not None and snap.verify() == []
        for tensor, name in enumerate(reader.layer_names):
            pages = snap.read_tensor(name).contiguous().view(torch.uint8).numpy().reshape(-1)
            assert np.array_equal(table[tensor], fmt.page_digests(pages, reader.page_bytes))


def _restore(
    path: Path, forged: bytes, *, held: bool
) -> tuple[RestoreIncompleteError | None, list]:
    """Restore the sequence into a fresh cache with the keys, the forged page planted after
    the open checked the file's signature (before it, for a file held whole: its bytes are
    read as it opens): the error, and the targets."""
    targets, _ = caches("vllm-nhd", heads=4, blocks=12, seed=9, fill=False)
    if held:
        _plant(path, forged)
    opened = open_snapshot(path, keys=KEYS, read_whole_max_bytes=(1 << 30) if held else 0)
    with Snapshot(opened, str(path)) as snap:
        assert (snap.reader.held_file() is not None) is held
        if not held:
            _plant(path, forged)
        try:
            snap.restore([c.layout for c in targets], {"s0": TARGETS})
        except RestoreIncompleteError as error:
            return error, targets
    return None, targets


@pytest.mark.parametrize(
    "path_kind",
    ["slot-reads", "slot-reads-inline", "held-whole", "triton-interpreter"],
)
def test_every_restore_path_refuses_a_forged_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forged_page: bytes, path_kind: str
) -> None:
    path, content, _ = _signed_capture(tmp_path)
    # A slot of at most INLINE_READ_MAX_BYTES is read on the calling thread into a host cache.
    monkeypatch.setattr(tuning, "INLINE_READ_MAX_BYTES", 1 << 30 if "inline" in path_kind else 0)
    if path_kind == "triton-interpreter":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(fused, "run_on_cpu", None)
    error, targets = _restore(path, forged_page, held=path_kind == "held-whole")
    assert error is not None, "a forged page was restored"
    assert error.failed_block_ids.tolist() == [4]  # snapshot block 2's target
    assert "BLAKE3" in str(error.__cause__)
    assert_restored(targets, content, [3, 7, 9], [0, 2, 5])  # every other block, exactly


def test_without_keys_the_forged_page_loads_and_only_accidents_are_caught(
    tmp_path: Path, forged_page: bytes
) -> None:
    # What the key is for: without it the forged page passes its xxh3-64 and is restored.
    path, content, _ = _signed_capture(tmp_path)
    _plant(path, forged_page)
    targets, _ = caches("vllm-nhd", heads=4, blocks=12, seed=9, fill=False)
    with Snapshot.open(path) as snap:
        assert snap.verify() == []  # every checksum matches
        snap.restore([c.layout for c in targets], {"s0": TARGETS})
    (cache,) = targets
    landed = cache.logical(FORGED[0])[4].contiguous().view(torch.uint8).numpy().tobytes()
    assert landed == forged_page
    # An accident (a flipped bit) is caught by the xxh3-64 alone.
    other = tmp_path / "other"
    other.mkdir()
    path, content, _ = _signed_capture(other)
    targets, _ = caches("vllm-nhd", heads=4, blocks=12, seed=9, fill=False)
    flip_byte(path, *FORGED)
    with Snapshot.open(path) as snap, pytest.raises(RestoreIncompleteError) as caught:
        snap.restore([c.layout for c in targets], {"s0": TARGETS})
    assert "xxh3-64" in str(caught.value.__cause__)
    assert_restored(targets, content, [3, 7, 9], [0, 2, 5])
