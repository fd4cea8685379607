"""``verify`` of a file read whole, in one pass (``kvsnap/store/held_verify.py``): taken for an
intact chunk-shaped file, and the same verdict as the general verify of the same file read in
pieces on every damaged, cut, extended or wrongly signed copy."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvsnap import format as fmt
from kvsnap.errors import KVSnapError
from kvsnap.format.signing import KeyRing
from kvsnap.layout import KVGeometry
from kvsnap.store import SnapshotReader
from kvsnap.store.held_verify import verified_held
from tests.support.store_helpers import make_metadata, random_pages, write_snapshot

#: A vLLM chunk's shape in small: pages of 4096 bytes, every layer tensor back to back.
GEOMETRY = KVGeometry(num_layers=2, block_size=16, dtype="bfloat16", num_kv_heads=2, head_dim=64)
KEY = b"k" * 32


def _chunk(path: Path, seed: int, *, signed: bool = False) -> bytes:
    """A chunk-like snapshot at ``path`` (one sequence of 6 full blocks, each referenced):
    its bytes."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, size=6 * GEOMETRY.block_size)
    metadata = make_metadata(GEOMETRY, [tokens], created="2026-12-02T08:00:00.000000Z")
    keys = KeyRing([KEY]) if signed else None
    write_snapshot(path, metadata, random_pages(rng, metadata), keys=keys)
    return path.read_bytes()


def _outcome(path: Path, whole: bool, keys: KeyRing | None = None) -> Any:
    """What opening and verifying ``path`` gives, read whole (the one-pass verify first) or in
    pieces (the general verify only): the error at open, or the problems found."""
    try:
        reader = SnapshotReader(path, keys=keys, read_whole_max_bytes=(1 << 30) * whole)
    except KVSnapError as error:
        return ("refused", type(error).__name__, str(error))
    with reader:
        assert reader.open_files[0].source.holds_whole is (whole and path.stat().st_size > 0)
        return ("problems", [dataclasses.astuple(problem) for problem in reader.verify()])


def test_an_intact_chunk_read_whole_is_verified_in_one_pass(tmp_path: Path) -> None:
    path = tmp_path / "chunk.safetensors"
    size = len(_chunk(path, seed=1))
    with SnapshotReader(path, read_whole_max_bytes=size) as reader:
        assert verified_held(reader)
        # It keeps the checked table for the restore, as the general verify does.
        assert reader.checksums.table().shape == (2 * GEOMETRY.num_layers, 6)
        assert reader.verify() == []
    with SnapshotReader(path, read_whole_max_bytes=size - 1) as reader:
        assert not verified_held(reader)  # not read whole: the general verify's
        assert reader.verify() == []


def test_an_intact_signed_chunk_read_whole_is_checked_in_one_pass_against_its_digests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "chunk.safetensors"
    size = len(_chunk(path, seed=7, signed=True))
    hashed: list[int] = []
    real = fmt.page_digests
    monkeypatch.setattr(fmt, "page_digests", lambda *a: hashed.append(1) or real(*a))
    with SnapshotReader(path, keys=KeyRing([KEY]), read_whole_max_bytes=size) as reader:
        assert reader.page_digest_table is not None
        assert verified_held(reader) and hashed == [1]  # every page, in one call
    with SnapshotReader(path, read_whole_max_bytes=size) as reader:  # no key: xxh3-64 only
        hashed.clear()
        assert verified_held(reader) and hashed == []


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed-with-key"])
def test_every_damaged_copy_gets_the_general_verdict(tmp_path: Path, signed: bool) -> None:
    """Flips in every region (header JSON, metadata string, padding, token ids, block ids,
    prefix hashes, pages, checksum table, page digests, trailer, signature), the file cut
    short or extended: the one pass accepts none of them, and open and verify give what they
    give from the file read in pieces, refusal for refusal, problem for problem (signed and
    opened with the key: a page against its BLAKE3 digest, the rest by the signature)."""
    path = tmp_path / "chunk.safetensors"
    original = _chunk(path, seed=2, signed=signed)
    keys = KeyRing([KEY]) if signed else None
    (layout,) = [SnapshotReader(path).open_files[0].layout]
    rng = np.random.default_rng(3)
    positions = [int(p) for p in rng.integers(0, len(original), 150)]
    # Every entry (the small ones too) and the header at least a few times.
    for entry in layout.entries:
        positions += [int(p) for p in rng.integers(entry.begin, entry.end, 3)]
    positions += [int(p) for p in rng.integers(0, layout.data_start, 20)]
    damaged = tmp_path / "damaged.safetensors"
    kinds = set()
    for position in positions:
        flipped = bytearray(original)
        flipped[position] ^= 1 << int(rng.integers(0, 8))
        damaged.write_bytes(bytes(flipped))
        whole, pieces = _outcome(damaged, True, keys), _outcome(damaged, False, keys)
        assert whole == pieces, position
        assert whole != ("problems", []), f"a flip at {position} went unnoticed"
        kinds.add(whole[0])
    for size in (len(original) - 1, len(original) - 4096, len(original) + 1, 8):
        damaged.write_bytes((original + b"\0" * 8)[:size])
        assert _outcome(damaged, True, keys) == _outcome(damaged, False, keys) != ("problems", [])
    assert kinds == {"refused", "problems"}


def test_a_zeroed_page_with_its_checksum_rewritten_is_still_refused(tmp_path: Path) -> None:
    """A page and its stored xxh3-64 changed together: the row no longer matches its trailer
    digest, which the one pass checks as the general verify does."""
    path = tmp_path / "chunk.safetensors"
    original = bytearray(_chunk(path, seed=4))
    reader = SnapshotReader(path)
    layout = reader.open_files[0].layout
    reader.close()
    layer = layout.by_name["layers.1.key"]
    table = layout.by_name[fmt.BLOCK_CHECKSUMS_TENSOR]
    page = GEOMETRY.canonical_page_size_bytes
    original[layer.begin + 2 * page : layer.begin + 3 * page] = bytes(page)
    row = 2 * 1 + 0  # layers.1.key is the third layer tensor
    slot = table.begin + (row * 6 + 2) * 8
    original[slot : slot + 8] = fmt.block_digests(np.zeros(page, np.uint8), page).tobytes()
    path.write_bytes(bytes(original))
    whole, pieces = _outcome(path, True), _outcome(path, False)
    assert whole == pieces and whole[0] == "problems" and whole[1]


@pytest.mark.parametrize("key", [KEY, b"x" * 32, None])
def test_a_signed_chunk_gets_the_same_verdict_under_any_key(tmp_path: Path, key: Any) -> None:
    path = tmp_path / "chunk.safetensors"
    _chunk(path, seed=5, signed=True)
    keys = None if key is None else KeyRing([key])
    whole, pieces = _outcome(path, True, keys), _outcome(path, False, keys)
    assert whole == pieces
    assert (whole == ("problems", [])) is (key != b"x" * 32)


def test_forged_trailers_and_tokens_get_the_general_verdict(tmp_path: Path) -> None:
    """A trailer whose own digest was recomputed after one row was changed (every row in
    turn: the header's, each metadata tensor's, each layer tensor's, the table's), and token
    ids changed with their trailer digest recomputed (the prefix hash chain no longer holds):
    the one pass accepts none, and both ways give the same refusal or the same problems."""
    path = tmp_path / "chunk.safetensors"
    original = _chunk(path, seed=6)
    with SnapshotReader(path) as reader:
        layout = reader.open_files[0].layout
    trailer = layout.by_name[fmt.CHECKSUMS_TENSOR]
    body = bytearray(original[trailer.begin : trailer.end - fmt.DIGEST_BYTES])
    forged = tmp_path / "forged.safetensors"

    def write(new_body: bytes, prefix: bytes = original[: trailer.begin]) -> None:
        forged.write_bytes(
            prefix + fmt.encode_trailer([new_body[i : i + 16] for i in range(0, len(new_body), 16)])
        )

    for row in range(len(body) // fmt.DIGEST_BYTES):
        changed = bytearray(body)
        changed[16 * row] ^= 0xFF
        write(bytes(changed))
        whole, pieces = _outcome(forged, True), _outcome(forged, False)
        assert whole == pieces != ("problems", []), row
    tokens = layout.by_name["sequences.0.token_ids"]
    prefix = bytearray(original[: trailer.begin])
    prefix[tokens.begin] ^= 1
    changed = bytearray(body)
    row = layout.checksum_rows[tokens.name]
    changed[16 * row : 16 * row + 16] = fmt.digest128(bytes(prefix[tokens.begin : tokens.end]))
    write(bytes(changed), bytes(prefix))
    whole, pieces = _outcome(forged, True), _outcome(forged, False)
    assert whole == pieces and whole[0] == "problems"
    assert any("hash to" in problem[2] for problem in whole[1])
