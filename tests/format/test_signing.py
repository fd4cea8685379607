"""Signed snapshots: an HMAC over each file's header and every byte but its pages, the pages
bound by their BLAKE3 digests, checked where keys are given."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
import struct
from pathlib import Path

import blake3
import numpy as np
import pytest
import safetensors.torch
import torch

from kvsnap import format as fmt
from kvsnap.errors import (
    BadSignatureError,
    SignatureError,
    SnapshotCorruptError,
    SnapshotIOError,
    UnsignedSnapshotError,
)
from kvsnap.format.signing import KeyRing
from kvsnap.snapshot import Snapshot
from kvsnap.store.keys import KEY_FILE_ENV, key_ring_from_environment, load_key_ring, new_key_text
from tests.support.parts_helpers import parted_snapshot
from tests.support.store_helpers import (
    GEOMETRIES,
    make_metadata,
    random_pages,
    shared_prefix_tokens,
    write_snapshot,
)

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))


@pytest.fixture
def signed(tmp_path: Path) -> tuple[Path, fmt.SnapshotMetadata, dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    metadata = make_metadata(GEOMETRIES["bf16"], shared_prefix_tokens(rng, 4))
    pages = random_pages(rng, metadata)
    path = tmp_path / "signed.safetensors"
    write_snapshot(path, metadata, pages, keys=KeyRing([KEY]))
    return path, metadata, pages


def test_a_signed_snapshot_opens_with_its_key_and_any_safetensors_reader(signed) -> None:
    path, metadata, pages = signed
    with Snapshot.open(path, keys=KeyRing([KEY])) as snapshot:
        assert snapshot.verify() == []
        assert snapshot.metadata.signature == "hmac-sha256-blake3"
        assert snapshot.page_binding == "blake3"
        assert snapshot.reader.page_digest_table is not None
        assert snapshot.signing_key_ids() == [KeyRing([KEY]).signing_key_id]
        assert snapshot.signature_problems(KeyRing([KEY])) == []
    with Snapshot.open(path) as snapshot:  # without keys: nothing checked against the digests
        assert snapshot.page_binding == "blake3" and snapshot.reader.page_digest_table is None
        assert snapshot.verify() == []
    loaded = safetensors.torch.load_file(path)
    assert tuple(loaded[fmt.SIGNATURE_TENSOR].shape) == (fmt.SIGNATURE_BYTES,)
    names = metadata.geometry.tensor_names()
    name = names[0]
    assert loaded[name].contiguous().view(torch.uint8).numpy().tobytes() == pages[name].tobytes()
    # The page digests: BLAKE3-256 of every page, one row per layer tensor in file order.
    digests = loaded[fmt.PAGE_DIGESTS_TENSOR].numpy()
    page_bytes = metadata.geometry.canonical_page_size_bytes
    assert digests.shape == (len(names), metadata.num_blocks, 32)
    for row, tensor in enumerate(names):
        for block in range(metadata.num_blocks):
            page = pages[tensor][block * page_bytes : (block + 1) * page_bytes].tobytes()
            assert digests[row, block].tobytes() == blake3.blake3(page).digest()


def test_the_signature_is_the_documented_hmac(signed) -> None:
    # Computed from the raw bytes with hashlib and hmac, as docs/format.md says: the header,
    # then every tensor but the layer tensors, the padding and the signature, in file order.
    path, _, _ = signed
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    data_start = 8 + length
    entries = sorted(
        (offsets["data_offsets"], name)
        for name, offsets in header.items()
        if name != "__metadata__"
    )
    signed_names = [
        name
        for _, name in entries
        if not name.startswith(("layers.", "kvsnap.padding.")) and name != fmt.SIGNATURE_TENSOR
    ]
    assert signed_names[-3:] == [
        fmt.BLOCK_CHECKSUMS_TENSOR,
        fmt.PAGE_DIGESTS_TENSOR,
        fmt.CHECKSUMS_TENSOR,
    ]
    assert signed_names[0] == "sequences.0.token_ids"
    message = b"kvsnap-signature-v2\0" + raw[:data_start]
    for name in signed_names:
        begin, end = header[name]["data_offsets"]
        message += raw[data_start + begin : data_start + end]
    sig_begin, sig_end = header[fmt.SIGNATURE_TENSOR]["data_offsets"]
    assert data_start + sig_end == len(raw)
    signature = raw[data_start + sig_begin :]
    key_id = hmac.new(KEY, b"kvsnap-key-id-v1", hashlib.sha256).digest()[:16]
    assert signature == key_id + hmac.new(KEY, message, hashlib.sha256).digest()


def test_another_key_is_a_bad_signature_and_rotation_accepts_the_old_one(signed) -> None:
    path, _, _ = signed
    with pytest.raises(BadSignatureError, match="not one of ours"):
        Snapshot.open(path, keys=KeyRing([OTHER_KEY]))
    with Snapshot.open(path, keys=KeyRing([OTHER_KEY, KEY])) as snapshot:
        assert snapshot.verify() == []


def test_an_unsigned_snapshot_is_refused_where_keys_are_required(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    metadata = make_metadata(GEOMETRIES["bf16"], shared_prefix_tokens(rng, 4))
    path = tmp_path / "plain.safetensors"
    write_snapshot(path, metadata, random_pages(rng, metadata))
    with pytest.raises(UnsignedSnapshotError, match="unsigned"):
        Snapshot.open(path, keys=KeyRing([KEY]))
    with Snapshot.open(path) as snapshot:
        assert snapshot.signing_key_ids() == [None]
        problems = snapshot.signature_problems(KeyRing([KEY]))
        assert [type(problem) for problem in problems] == [UnsignedSnapshotError]


def test_a_planted_file_with_valid_checksums_but_a_forged_signature_is_refused(
    signed, tmp_path: Path
) -> None:
    # Someone without the key rewrites a page and recomputes every checksum: the checksums
    # all pass, the signature cannot.
    path, metadata, pages = signed
    rng = np.random.default_rng(99)
    forged_pages = {name: data.copy() for name, data in pages.items()}
    name = metadata.geometry.tensor_names()[0]
    forged_pages[name][:16] = rng.integers(0, 256, 16, dtype=np.uint8)
    forged = tmp_path / "forged.safetensors"
    write_snapshot(forged, metadata, forged_pages, keys=KeyRing([OTHER_KEY]))
    raw = bytearray(forged.read_bytes())
    raw[-fmt.SIGNATURE_BYTES :] = path.read_bytes()[-fmt.SIGNATURE_BYTES :]  # a real key id
    forged.write_bytes(bytes(raw))
    with Snapshot.open(forged) as snapshot:
        assert snapshot.verify() == []  # every checksum is right
    with pytest.raises(BadSignatureError, match="does not match"):
        Snapshot.open(forged, keys=KeyRing([KEY]))


def test_a_stripped_signature_makes_the_file_unreadable_not_unsigned(signed) -> None:
    # The header names the signature: cutting it off breaks the layout (corrupt), and a header
    # rewritten without it changes the trailer's header digest.
    path, _, _ = signed
    path.write_bytes(path.read_bytes()[: -fmt.SIGNATURE_BYTES])
    with pytest.raises(SnapshotCorruptError):
        Snapshot.open(path, keys=KeyRing([KEY]))


def test_sharded_and_parted_snapshots_sign_every_file(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    metadata = make_metadata(GEOMETRIES["bf16"], shared_prefix_tokens(rng, 4))
    sharded = tmp_path / "sharded.safetensors"
    write_snapshot(
        sharded, metadata, random_pages(rng, metadata), max_shard_bytes=200, keys=KeyRing([KEY])
    )
    with Snapshot.open(sharded, keys=KeyRing([KEY])) as snapshot:
        ids = snapshot.signing_key_ids()
        assert len(ids) > 1 and set(ids) == {KeyRing([KEY]).signing_key_id}
        assert snapshot.verify() == []
        # Every shard carries the page digests of its own layer tensors (none: zero rows).
        rows = 0
        for name in snapshot.reader.files:
            with safetensors.safe_open(name, "np") as file:
                held = [key for key in file.keys() if key.startswith("layers.")]
                digests = file.get_tensor(fmt.PAGE_DIGESTS_TENSOR)
            assert digests.shape == (len(held), metadata.num_blocks, 32)
            rows += len(held)
        assert rows == len(metadata.geometry.tensor_names())
        table = snapshot.reader.page_digest_table
        assert table is not None and table.shape[0] == rows
    parted = tmp_path / "parted.safetensors"
    parted_snapshot(parted, keys=KeyRing([KEY]))
    with Snapshot.open(parted, keys=KeyRing([KEY])) as snapshot:
        assert len(snapshot.signing_key_ids()) == 2
        assert snapshot.verify() == []
        assert all(part.reader.page_digest_table is not None for part in snapshot.parts)
    with pytest.raises(BadSignatureError):
        Snapshot.open(parted, keys=KeyRing([OTHER_KEY]))


def test_one_unsigned_part_among_signed_ones_is_refused(tmp_path: Path) -> None:
    signed_dir, plain_dir = tmp_path / "signed", tmp_path / "plain"
    signed_dir.mkdir()
    plain_dir.mkdir()
    parted_snapshot(signed_dir / "s.safetensors", keys=KeyRing([KEY]))
    parted_snapshot(plain_dir / "s.safetensors")
    # Swap the unsigned second part in under the signed one's name, and patch the index's
    # trailer digest of it, as someone who can write the directory but has no key would.
    index_path = signed_dir / "s.safetensors.index.json"
    index = json.loads(index_path.read_text())
    plain_index = json.loads((plain_dir / "s.safetensors.index.json").read_text())
    second, plain_second = (
        index["metadata"]["kvsnap.parts"][1],
        plain_index["metadata"]["kvsnap.parts"][1],
    )
    shutil.copy(plain_dir / plain_second["file"], signed_dir / second["file"])
    second["trailer"] = plain_second["trailer"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(SignatureError):
        Snapshot.open(signed_dir / "s.safetensors", keys=KeyRing([KEY]))


def test_key_files_rotation_permissions_and_the_environment(tmp_path: Path, monkeypatch) -> None:
    first, second = new_key_text(), new_key_text()
    key_file = tmp_path / "keys"
    key_file.write_text(f"# rotation\n{first}\n\n{second}\n")
    key_file.chmod(0o600)
    ring = load_key_ring(key_file)
    assert [key.secret.hex() for key in ring.keys] == [first, second]
    assert first not in repr(ring)  # the secret never shows
    key_file.chmod(0o640)
    with pytest.raises(SnapshotIOError, match="chmod 600"):
        load_key_ring(key_file)
    key_file.chmod(0o600)
    short = tmp_path / "short"
    short.write_text("abcd\n")
    short.chmod(0o600)
    with pytest.raises(ValueError, match="64 hex digits"):
        load_key_ring(short)
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    assert key_ring_from_environment() is None
    monkeypatch.setenv(KEY_FILE_ENV, os.fspath(key_file))
    environment = key_ring_from_environment()
    assert environment is not None and environment.signing_key_id == ring.signing_key_id


def test_a_key_file_anyone_else_could_replace_is_refused(tmp_path: Path) -> None:
    """ssh's rule for private keys: the file belongs to this process's user (or root), and
    neither it nor its directory (nor, for a name that is a link, the directory it points
    into) lets group or other users write."""
    safe = tmp_path / "safe"
    safe.mkdir(mode=0o700)
    key_file = safe / "key"
    key_file.write_text(new_key_text() + "\n")
    key_file.chmod(0o600)
    assert load_key_ring(key_file).keys
    for mode in (0o777, 0o775, 0o1777):
        safe.chmod(mode)
        with pytest.raises(SnapshotIOError, match=f"writable by other users \\(mode {mode:o}\\)"):
            load_key_ring(key_file)
    safe.chmod(0o755)  # others may read and enter, not write: accepted
    assert load_key_ring(key_file).keys
    safe.chmod(0o700)
    # A link in a safe directory to a key kept where anyone may replace it.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    exposed = shared / "key"
    exposed.write_text(key_file.read_text())
    exposed.chmod(0o600)
    link = safe / "link"
    link.symlink_to(exposed)
    with pytest.raises(SnapshotIOError, match=f"{shared} is writable by other users"):
        load_key_ring(link)
    if os.geteuid() != 0:
        return  # giving a file to another user needs root
    os.chown(key_file, 65534, 65534)
    with pytest.raises(SnapshotIOError, match="key file belongs to user id 65534"):
        load_key_ring(key_file)
    os.chown(key_file, 0, 0)
    os.chown(safe, 65534, 65534)
    with pytest.raises(SnapshotIOError, match=f"its directory {safe} belongs to user id 65534"):
        load_key_ring(key_file)
