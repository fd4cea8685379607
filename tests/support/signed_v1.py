"""Signed snapshots of the older form (``"hmac-sha256"``), as kvsnap wrote them before pages
were bound by BLAKE3: an HMAC over the header and the checksum trailer only, each page bound
by its xxh3-64.

kvsnap no longer writes this form; :func:`write_v1_signed` lays a file out by hand from the
format's own pieces (the packing, the checksums, the trailer, the v1 message) so that tests can
make one of any content (a vLLM chunk, a file to forge). ``fixtures/signed-v1/`` holds a file
that the older kvsnap itself wrote (commit 6fa270e); tests/format/test_signing_v1.py checks
that :func:`write_v1_signed` gives it byte for byte, so this helper writes what that kvsnap
wrote. :func:`fixture_inputs` is the content of that fixture.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from kvsnap import format as fmt
from kvsnap.format.signing import KeyRing
from kvsnap.layout import KVGeometry
from kvsnap.snapshot import Snapshot

#: The key the committed fixture is signed with (a test key: 32 bytes 0..31).
FIXTURE_KEY = bytes(range(32))
FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "signed-v1" / "signed.safetensors"


def fixture_inputs() -> tuple[fmt.SnapshotMetadata, dict[str, np.ndarray]]:
    """The metadata (reproducible: no creation time) and pages of the committed fixture."""
    rng = np.random.default_rng(20261206)
    geometry = KVGeometry(num_layers=2, block_size=4, dtype="bfloat16", num_kv_heads=2, head_dim=8)
    tokens = [rng.integers(0, 50_000, size=10, dtype=np.int64)]
    chains = [fmt.prefix_hash_chain(tokens[0], geometry.block_size)]
    dedupe = fmt.dedupe_blocks(chains)
    record = fmt.SequenceRecord("prompt", tokens[0], dedupe.sequence_block_ids[0], tuple(chains[0]))
    metadata = fmt.SnapshotMetadata(
        geometry=geometry,
        source=fmt.SourceInfo(engine="test-engine", model_id="random/model"),
        sequences=[record],
        num_blocks=dedupe.num_blocks,
        capture_encoding="test-layout",
        tp_size=1,
        kvsnap_version="0.1",
        created=None,
    )
    size = metadata.num_blocks * geometry.canonical_page_size_bytes
    pages = {
        name: rng.integers(0, 256, size=size, dtype=np.uint8) for name in geometry.tensor_names()
    }
    return metadata, pages


def write_v1_signed(
    path: Path, metadata: fmt.SnapshotMetadata, pages: dict[str, np.ndarray], keys: KeyRing
) -> None:
    """Write a one-file snapshot of ``metadata`` and ``pages`` signed in the older form with
    the first key of ``keys``."""
    metadata = dataclasses.replace(metadata, signature=fmt.SIGNATURE_ALGORITHM_V1)
    (layout,) = fmt.file_layouts(metadata)
    page_bytes = metadata.geometry.canonical_page_size_bytes
    names = metadata.geometry.tensor_names()
    checksums = np.stack([fmt.block_digests(pages[name], page_bytes) for name in names])
    statics = {
        name: np.ascontiguousarray(array).view(np.uint8).tobytes()
        for name, array in metadata.metadata_tensors().items()
    }
    data = bytearray(layout.file_size)
    data[: layout.data_start] = layout.header
    digests = [fmt.digest128(layout.header)]
    for entry in layout.checksummed():
        if fmt.is_layer_tensor(entry.name):
            row = checksums[names.index(entry.name)]
            data[entry.begin : entry.end] = pages[entry.name].tobytes()
            digests.append(fmt.layer_tensor_digest(row))
            continue
        raw = checksums.astype("<u8").tobytes()
        if entry.name != fmt.BLOCK_CHECKSUMS_TENSOR:
            raw = statics[entry.name]
        data[entry.begin : entry.end] = raw
        digests.append(fmt.digest128(raw))
    trailer = layout.by_name[fmt.CHECKSUMS_TENSOR]
    data[trailer.begin : trailer.end] = fmt.encode_trailer(digests)
    signature = layout.by_name[fmt.SIGNATURE_TENSOR]
    message = [layout.header, bytes(data[trailer.begin : trailer.end])]
    data[signature.begin : signature.end] = keys.sign(message, fmt.SIGNATURE_ALGORITHM_V1)
    path.write_bytes(bytes(data))


def rewrite_as_v1_signed(path: Path, keys: KeyRing) -> None:
    """Rewrite the one-file snapshot at ``path``, signed with ``keys``, as the older kvsnap
    signed it (same content, same key)."""
    with Snapshot.open(path, keys=keys) as snapshot:
        metadata = snapshot.metadata
        pages = {
            name: snapshot.read_tensor(name).contiguous().view(-1).view(torch.uint8).numpy()
            for name in snapshot.geometry.tensor_names()
        }
    write_v1_signed(path, metadata, pages, keys)
