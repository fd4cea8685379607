"""The committed format fixtures (fixtures/v*/) stay readable, intact and reproducible.

Every run reads every committed snapshot with kvsnap *and* with ``safetensors.safe_open``,
recomputes every checksum from the raw bytes following docs/format.md (independently of
kvsnap's reader), checks the decoded KV equals a regeneration from the recorded seed, and, for
the format version kvsnap writes today, that a regeneration is byte-identical to the committed
file. So a kvsnap that can no longer read a v1 file, or that silently changes what it writes
or what the generator draws, fails CI.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from safetensors import safe_open

from kvsnap import format as fmt
from kvsnap.layout import SAFETENSORS_DTYPES
from kvsnap.snapshot import Snapshot
from kvsnap.testing.synthetic import (
    ATTENTIONS,
    GENERATOR_VERSION,
    LAYOUTS,
    generate,
    make_spec,
    synthesize,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
MANIFESTS = sorted(FIXTURES.glob("v*/manifest.json"))


def _entries() -> list[tuple[Path, dict[str, Any], dict[str, Any]]]:
    entries = []
    for manifest_path in MANIFESTS:
        manifest = json.loads(manifest_path.read_text())
        for entry in manifest["fixtures"]:
            entries.append((manifest_path.parent / entry["file"], entry, manifest))
    return entries


ENTRIES = _entries()
IDS = [f"{path.parent.name}/{path.stem}" for path, _, _ in ENTRIES]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)


def test_fixtures_exist_cover_every_layout_and_attention_and_stay_small() -> None:
    assert MANIFESTS, f"no fixtures/v*/manifest.json under {FIXTURES}"
    current = FIXTURES / f"v{fmt.FORMAT_VERSION}" / "manifest.json"
    assert current in MANIFESTS, f"no fixtures for the current format version {fmt.FORMAT_VERSION}"
    arguments = [entry["arguments"] for path, entry, _ in ENTRIES if path.parent == current.parent]
    assert {a["layout"] for a in arguments} == set(LAYOUTS)
    assert {a["attention"] for a in arguments} == set(ATTENTIONS)
    total = sum(path.stat().st_size for path, _, _ in ENTRIES)
    assert total < 1 << 20, f"committed fixtures take {total} bytes; keep them under 1 MiB"
    listed = {path for path, _, _ in ENTRIES}
    on_disk = set(FIXTURES.glob("v*/*.safetensors"))
    assert on_disk == listed, f"fixtures not in a manifest: {sorted(map(str, on_disk - listed))}"


def _raw_checks(path: Path) -> None:
    """Check a snapshot file's container and checksums from raw bytes, per docs/format.md."""
    raw = path.read_bytes()
    (header_length,) = struct.unpack("<Q", raw[:8])
    data_start = 8 + header_length
    assert data_start % fmt.DATA_ALIGNMENT == 0
    header = json.loads(raw[8:data_start])
    tensors = {name: spec for name, spec in header.items() if name != "__metadata__"}
    ordered = sorted(tensors.items(), key=lambda item: item[1]["data_offsets"][0])
    # Tensors tile the data region exactly, and the file ends at the last one.
    position = 0
    for _, spec in ordered:
        assert spec["data_offsets"][0] == position
        position = spec["data_offsets"][1]
    assert data_start + position == len(raw)

    def data(name: str) -> bytes:
        begin, end = tensors[name]["data_offsets"]
        return raw[data_start + begin : data_start + end]

    for name in tensors:
        if name.startswith(fmt.PADDING_PREFIX):
            assert set(data(name)) <= {0}, f"{name} is not zero"
        if name.startswith("layers."):
            offset = data_start + tensors[name]["data_offsets"][0]
            assert offset % fmt.DATA_ALIGNMENT == 0, f"{name} is not 4096-aligned"
    # Per-block xxh3-64 of every layer tensor, rows in layer-tensor order.
    layer_names = [name for name, _ in ordered if name.startswith("layers.")]
    block_checksums = np.frombuffer(data(fmt.BLOCK_CHECKSUMS_TENSOR), dtype="<u8").reshape(
        len(layer_names), -1
    )
    for row, name in enumerate(layer_names):
        pages = data(name)
        num_blocks = tensors[name]["shape"][0]
        page = len(pages) // num_blocks
        expected = [
            xxhash.xxh3_64_intdigest(pages[b * page : (b + 1) * page]) for b in range(num_blocks)
        ]
        assert block_checksums[row].tolist() == expected, f"{name}: block checksums"
    # The trailer: header digest, one digest per tensor in file order, then its own digest.
    rows = [xxhash.xxh3_128_digest(raw[:data_start])]
    for name, _ in ordered:
        if name == fmt.CHECKSUMS_TENSOR or name.startswith(fmt.PADDING_PREFIX):
            continue
        if name.startswith("layers."):
            row = block_checksums[layer_names.index(name)].astype("<u8").tobytes()
            rows.append(xxhash.xxh3_128_digest(row))
        else:
            rows.append(xxhash.xxh3_128_digest(data(name)))
    body = b"".join(rows)
    assert data(fmt.CHECKSUMS_TENSOR) == body + xxhash.xxh3_128_digest(body)


@pytest.mark.parametrize(("path", "entry", "manifest"), ENTRIES, ids=IDS)
def test_fixture_reads_verifies_and_matches_its_seed(
    path: Path, entry: dict[str, Any], manifest: dict[str, Any]
) -> None:
    content = path.read_bytes()
    assert hashlib.sha256(content).hexdigest() == entry["sha256"], f"{path} was modified"
    assert len(content) == entry["bytes"]
    _raw_checks(path)
    arguments = entry["arguments"]
    with Snapshot.open(path) as snapshot, safe_open(str(path), "pt") as file:
        assert snapshot.verify() == []
        document = json.loads(file.metadata()[fmt.METADATA_KEY])
        assert document["format_version"] == manifest["format_version"]
        assert document["created"] is None
        geometry = snapshot.geometry
        assert geometry.dtype == arguments["dtype"]
        assert geometry.block_size == arguments["block_size"]
        assert geometry.num_layers == arguments["num_layers"]
        for name in geometry.tensor_names():
            tensor = file.get_tensor(name)
            assert file.get_slice(name).get_dtype() == SAFETENSORS_DTYPES[geometry.dtype]
            assert tuple(tensor.shape) == (snapshot.num_blocks, *geometry.canonical_page_shape)
            assert torch.equal(_bits(tensor), _bits(snapshot.read_tensor(name)))
        if manifest["generator_version"] != GENERATOR_VERSION:
            return  # older generator: its values cannot be regenerated, reading is what counts
        expected = synthesize(make_spec(**arguments))
        assert [record.id for record in snapshot.sequences] == [seq.id for seq in expected]
        for index, (record, sequence) in enumerate(zip(snapshot.sequences, expected, strict=True)):
            token_ids = file.get_tensor(f"sequences.{index}.token_ids").numpy()
            block_ids = file.get_tensor(f"sequences.{index}.block_ids")
            assert np.array_equal(token_ids, sequence.token_ids)
            assert np.array_equal(record.token_ids, sequence.token_ids)
            for name, values in sequence.kv.items():
                assert torch.equal(_bits(snapshot.sequence_kv(record.id, name)), _bits(values))
                # The same tokens through safetensors alone: pages of the sequence's blocks.
                pages = file.get_tensor(name)[block_ids]
                tokens = pages.reshape(-1, *pages.shape[2:])[: len(token_ids)]
                assert torch.equal(_bits(tokens), _bits(values))


CURRENT = [
    (path, entry, manifest)
    for path, entry, manifest in ENTRIES
    if manifest["format_version"] == fmt.FORMAT_VERSION
]


@pytest.mark.parametrize(
    ("path", "entry", "manifest"), CURRENT, ids=[f"{p.parent.name}/{p.stem}" for p, _, _ in CURRENT]
)
def test_fixture_regenerates_byte_identical(
    tmp_path: Path, path: Path, entry: dict[str, Any], manifest: dict[str, Any]
) -> None:
    fresh = tmp_path / path.name
    generate(fresh, **entry["arguments"])
    committed, regenerated = path.read_bytes(), fresh.read_bytes()
    if committed == regenerated:
        return
    with safe_open(str(path), "pt") as old, safe_open(str(fresh), "pt") as new:
        old_meta = json.loads(old.metadata()[fmt.METADATA_KEY])
        new_meta = json.loads(new.metadata()[fmt.METADATA_KEY])
        changed_meta = sorted(
            key
            for key in old_meta.keys() | new_meta.keys()
            if old_meta.get(key) != new_meta.get(key)
        )
        changed_tensors = sorted(
            name
            for name in old.keys()
            if name in new.keys()
            and not torch.equal(_bits(old.get_tensor(name)), _bits(new.get_tensor(name)))
        )
    pytest.fail(
        f"{path} no longer regenerates byte for byte (metadata keys changed: {changed_meta}; "
        f"tensors changed: {changed_tensors}). A released format's fixtures must stay "
        "reproducible: fix the regression, or bump GENERATOR_VERSION / the format version and "
        "add new fixtures with scripts/make_fixtures.py."
    )
