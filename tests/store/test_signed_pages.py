"""Signed means every KV byte: a reader holding the key refuses any byte of a signed file
changed after signing, however well the changer recomputed the fast checksums.

The changes are made as someone who can write the file and compute xxh3 but has no key would
make them (tests/support/tamper.py): every xxh3-64 page checksum, xxh3-128 trailer row and
prefix hash recomputed, so that a reader without the key finds the file intact. With the key,
the token ids, block ids, prefix hashes, checksums and page digests are signed as they are,
and every page is checked against its signed BLAKE3 digest wherever it is read.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvsnap import format as fmt
from kvsnap.errors import BadSignatureError, SnapshotCorruptError
from kvsnap.format.signing import KeyRing
from kvsnap.snapshot import Snapshot
from kvsnap.store import SnapshotReader
from kvsnap.store import reader as reader_module
from tests.support.store_helpers import GEOMETRIES, make_metadata, random_pages, write_snapshot
from tests.support.tamper import RawSnapshot

KEYS = KeyRing([bytes(range(32))])


@pytest.fixture
def signed(tmp_path: Path) -> Path:
    """A signed snapshot of one 30-token sequence: 8 blocks of 4 tokens, 3 layers."""
    rng = np.random.default_rng(11)
    metadata = make_metadata(GEOMETRIES["bf16"], [rng.integers(0, 50_000, 30, dtype=np.int64)])
    path = tmp_path / "signed.safetensors"
    write_snapshot(path, metadata, random_pages(rng, metadata), keys=KEYS)
    return path


def _change_page(raw: RawSnapshot) -> None:
    raw.page("layers.1.value", 3)[:8] ^= 0xFF


def _change_token_ids(raw: RawSnapshot) -> None:
    raw.array("sequences.0.token_ids", "<i8")[9] += 1
    raw.recompute_prefix_hashes()


def _change_block_ids(raw: RawSnapshot) -> None:
    # Blocks 1 and 2 swapped, and their prefix hashes with them: the sequence's KV reordered.
    ids = raw.array("sequences.0.block_ids", "<i8")
    ids[[1, 2]] = ids[[2, 1]]
    hashes = raw.array(fmt.BLOCK_HASHES_TENSOR, np.uint8).reshape(-1, 16)
    hashes[[1, 2]] = hashes[[2, 1]].copy()


def _change_block_hashes(raw: RawSnapshot) -> None:
    raw.array(fmt.BLOCK_HASHES_TENSOR, np.uint8).reshape(-1, 16)[4, 0] ^= 1


CHANGES = {
    "a page": _change_page,
    "token ids": _change_token_ids,
    "block ids": _change_block_ids,
    "block hashes": _change_block_hashes,
}


@pytest.mark.parametrize("what", list(CHANGES))
def test_a_change_with_every_fast_checksum_recomputed_is_refused_with_the_key(
    signed: Path, what: str
) -> None:
    raw = RawSnapshot(signed)
    CHANGES[what](raw)
    raw.recompute_checksums()
    raw.save()
    with Snapshot.open(signed) as snapshot:
        problems = snapshot.verify()
    # Without the key every checksum passes: only a change a reader can reason about (a
    # prefix hash that no token ids give) is noticed at all.
    assert [p for p in problems if "xxh3" in p.message or "checksum" in p.message] == []
    if what != "block hashes":
        assert problems == []
    with pytest.raises(BadSignatureError, match="does not match the file's bytes") as caught:
        Snapshot.open(signed, keys=KEYS)
    assert caught.value.file == str(signed)


def test_a_page_changed_after_signing_is_named_by_its_blake3_digest(signed: Path) -> None:
    raw = RawSnapshot(signed)
    _change_page(raw)
    raw.save()
    with Snapshot.open(signed, keys=KEYS) as snapshot:  # the signature covers no page
        problems = snapshot.verify()
        assert [(p.tensor, p.block) for p in problems] == [("layers.1.value", 3)]
        assert "BLAKE3" in problems[0].message
        with pytest.raises(SnapshotCorruptError, match="BLAKE3") as caught:
            snapshot.read_tensor("layers.1.value")
        assert (caught.value.tensor, caught.value.block) == ("layers.1.value", 3)
        # Another tensor's pages, and this one's other blocks, read as written.
        snapshot.read_tensor("layers.1.key")
        snapshot.sequence_kv("seq-0", "layers.0.value")


def test_a_slot_read_checks_every_page_against_its_signed_digest(signed: Path) -> None:
    raw = RawSnapshot(signed)
    _change_page(raw)
    raw.save()
    with SnapshotReader(signed, keys=KEYS, verify=False) as reader:
        # Keys bind the pages whatever ``verify`` says.
        assert reader.verifies and reader.page_digest_table is not None
        tensors = np.repeat(np.arange(len(reader.layer_names)), reader.num_blocks)
        blocks = np.tile(np.arange(reader.num_blocks), len(reader.layer_names))
        offsets = np.arange(len(tensors)) * reader.page_bytes
        out = np.empty(len(tensors) * reader.page_bytes, dtype=np.uint8)
        for inline in (False, True):
            failed = reader.read_slot_async(tensors, blocks, offsets, out, inline=inline).result()
            (page,) = failed.tolist()
            assert reader.layer_names[tensors[page]] == "layers.1.value" and blocks[page] == 3


def test_bytes_the_signature_covered_are_what_the_reader_uses_after_the_check(
    signed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Right after the signature is checked (and before anything else is read), the file is
    # rewritten in place: other token ids, their prefix hashes and every checksum recomputed,
    # a page changed and its xxh3-64 recomputed. The reader holding the key goes on with the
    # bytes it checked: the signed token ids, and the page refused against its signed digest.
    tokens = RawSnapshot(signed).array("sequences.0.token_ids", "<i8").copy()
    real = reader_module.checked_page_digests

    def then_rewritten(*args: object) -> object:
        digests = real(*args)  # type: ignore[arg-type]
        raw = RawSnapshot(signed)
        _change_token_ids(raw)
        _change_page(raw)
        raw.recompute_checksums()
        raw.save()  # the same inode: written in place
        return digests

    monkeypatch.setattr(reader_module, "checked_page_digests", then_rewritten)
    with Snapshot.open(signed, keys=KEYS) as snapshot:
        assert np.array_equal(snapshot.sequences[0].token_ids, tokens)
        problems = snapshot.verify()
        assert [(p.tensor, p.block) for p in problems] == [("layers.1.value", 3)]
    monkeypatch.setattr(reader_module, "checked_page_digests", real)
    with Snapshot.open(signed) as snapshot:  # what the file holds now, unsigned: consistent
        assert not np.array_equal(snapshot.sequences[0].token_ids, tokens)
        assert snapshot.verify() == []


@pytest.mark.parametrize("max_shard_bytes", [None, 600])
def test_a_signed_stream_write_is_the_local_files_byte_for_byte(
    tmp_path: Path, max_shard_bytes: int | None
) -> None:
    # The fsspec target writes the page digests and signs as the local one does, and a reader
    # of the stream checks them (its signed bytes kept from its one read of each range).
    import fsspec

    rng = np.random.default_rng(13)
    metadata = make_metadata(
        GEOMETRIES["bf16"],
        [rng.integers(0, 50_000, 30, dtype=np.int64)],
        created="2026-12-06T00:00:00Z",
    )
    pages = random_pages(rng, metadata)
    local = tmp_path / "local.safetensors"
    remote = f"memory://signed-{max_shard_bytes}/stream.safetensors"
    for target in (local, remote):
        write_snapshot(target, metadata, pages, keys=KEYS, max_shard_bytes=max_shard_bytes)
    with SnapshotReader(local, keys=KEYS) as local_reader:
        local_files = local_reader.files
    with SnapshotReader(remote, keys=KEYS) as reader:
        assert reader.page_digest_table is not None and reader.verify() == []
        fs = fsspec.filesystem("memory")
        for local_file, remote_file in zip(local_files, reader.files, strict=True):
            assert fs.cat_file(remote_file) == Path(local_file).read_bytes()
