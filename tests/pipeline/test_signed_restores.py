"""With keys, every page a restore delivers is checked against its signed BLAKE3 digest where
it lands, whatever path carries it: the staging slots' reads (on the read threads, or inline
for a small slot), a file held whole going straight into a host cache, and the copy kernel run
by Triton's interpreter on host memory. A signed capture binds every page.

The page is changed in the file after the reader opened it and checked its signature: nothing
remembered from the open vouches for it, only its digest (and a reader holding the key checks
no xxh3-64 of a page it checks by BLAKE3, so without that check the page would load).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvsnap import format as fmt
from kvsnap.errors import RestoreIncompleteError
from kvsnap.format.signing import KeyRing
from kvsnap.pipeline import Pipeline, fused
from kvsnap.snapshot import Snapshot, capture
from kvsnap.store import tuning
from kvsnap.store.head_parts import open_snapshot
from tests.support.pipeline_caches import (
    SOURCE,
    assert_restored,
    caches,
    flip_byte,
    sequences,
)

KEYS = KeyRing([bytes(range(32))])
#: Device blocks of the one sequence captured (snapshot blocks 0..3), and where they go.
USED, TARGETS = [3, 7, 1, 9], [0, 2, 4, 5]


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


def _restore(path: Path, kind: str, *, held: bool) -> tuple[RestoreIncompleteError | None, list]:
    """Restore the sequence into a fresh cache of ``kind`` with the keys, the file's page
    ``layers.1.value`` block 2 changed after the open checked its signature (before it, for a
    file held whole: its bytes are read as it opens): the error, and the targets."""
    targets, _ = caches(kind, heads=4, blocks=12, seed=9, fill=False)
    if held:
        flip_byte(path, "layers.1.value", 2)
    opened = open_snapshot(path, keys=KEYS, read_whole_max_bytes=(1 << 30) if held else 0)
    with Snapshot(opened, str(path)) as snap:
        assert (snap.reader.held_file() is not None) is held
        if not held:
            flip_byte(path, "layers.1.value", 2)
        try:
            snap.restore([c.layout for c in targets], {"s0": TARGETS})
        except RestoreIncompleteError as error:
            return error, targets
    return None, targets


@pytest.mark.parametrize(
    "path_kind",
    ["slot-reads", "slot-reads-inline", "held-whole", "triton-interpreter"],
)
def test_every_restore_path_refuses_a_page_changed_after_signing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path_kind: str
) -> None:
    path, content, _ = _signed_capture(tmp_path)
    # A slot of at most INLINE_READ_MAX_BYTES is read on the calling thread into a host cache.
    monkeypatch.setattr(tuning, "INLINE_READ_MAX_BYTES", 1 << 30 if "inline" in path_kind else 0)
    if path_kind == "triton-interpreter":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(fused, "run_on_cpu", None)
    error, targets = _restore(path, "vllm-nhd", held=path_kind == "held-whole")
    assert error is not None, "a page changed after signing was restored"
    assert error.failed_block_ids.tolist() == [4]  # snapshot block 2's target
    assert "BLAKE3" in str(error.__cause__)
    assert_restored(targets, content, [3, 7, 9], [0, 2, 5])  # every other block, exactly


def test_a_restore_without_keys_checks_the_xxh3_of_the_same_file(tmp_path: Path) -> None:
    # The same change without keys: the page's xxh3-64 catches it (an accident check).
    path, content, _ = _signed_capture(tmp_path)
    targets, _ = caches("vllm-nhd", heads=4, blocks=12, seed=9, fill=False)
    flip_byte(path, "layers.1.value", 2)
    with Snapshot.open(path) as snap, pytest.raises(RestoreIncompleteError) as caught:
        snap.restore([c.layout for c in targets], {"s0": TARGETS})
    assert "xxh3-64" in str(caught.value.__cause__)
    assert_restored(targets, content, [3, 7, 9], [0, 2, 5])
