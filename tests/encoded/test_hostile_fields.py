"""Hostile values in the fields an encoded file adds, each written into an otherwise consistent
file (kvsnap's own container code lays it out and checksums it: tests/support/encoded_tamper.py):
a decoded size or a block count with nothing stored behind it, the decoded file's header naming
a shard or a part, page-check tables of the wrong length, scales a quantizer cannot write read by
the open that reads no page. Each is one ``SnapshotCorruptError`` naming what is wrong, through
``Snapshot.open`` and through the whole-file decode that ``convert`` runs, and nothing sized by
the claim is allocated (tracemalloc's peak, which numpy's allocations report to, stays at the
file's own size). tests/cli/test_hostile_encoded.py runs such files through the CLI."""

from __future__ import annotations

import dataclasses
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

import kvsnap
from kvsnap import format as fmt
from kvsnap.encoded.read import decode, read_encoded
from kvsnap.encoded.write import encode_file
from kvsnap.errors import SnapshotCorruptError
from kvsnap.format import encoded as enc
from kvsnap.format.signing import KeyRing
from tests.support.encoded_files import capture_real
from tests.support.encoded_tamper import (
    original_header,
    set_original_metadata,
    stored_parts,
    write_parts,
)

KEY = KeyRing([bytes(range(32))])
#: What an open or decode of one of these small files may allocate at most: a few times the
#: decoded file (about 170 KiB), nothing like any size the hostile fields claim.
PEAK_BYTES = 8 << 20


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hostile-fields")
    source = folder / "kv.safetensors"
    capture_real(source, "vllm-nhd", torch.bfloat16)
    for encoding in ("lossless", "fp8"):
        encode_file(source, folder / f"{encoding}.safetensors", encoding)
    encode_file(source, folder / "signed-fp8.safetensors", "fp8", keys=KEY)
    return folder


def _refusals(path: Path) -> list[SnapshotCorruptError]:
    """The error of ``Snapshot.open`` (and a read) and of the whole-file decode of ``path``,
    each checked to allocate less than :data:`PEAK_BYTES`."""
    errors = []
    for attempt in (_open_and_read, _decode_whole):
        tracemalloc.start()
        try:
            with pytest.raises(SnapshotCorruptError) as raised:
                attempt(path)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < PEAK_BYTES, (attempt.__name__, peak)
        errors.append(raised.value)
    return errors


def _open_and_read(path: Path) -> None:
    with kvsnap.Snapshot.open(path) as snapshot:
        snapshot.read_tensor("layers.0.key")


def _decode_whole(path: Path) -> None:
    decode(read_encoded(path))


@pytest.mark.parametrize("encoding", ["lossless", "fp8"])
@pytest.mark.parametrize("claim", [2**60, 2**34, "one byte more", "one byte less"])
def test_a_decoded_size_with_nothing_behind_it_is_refused_unallocated(
    files, tmp_path, encoding, claim
):
    parts = stored_parts(files / f"{encoding}.safetensors")
    real = parts.document["encoding"]["decoded_bytes"]
    size = {"one byte more": real + 1, "one byte less": real - 1}.get(claim, claim)
    parts.document["encoding"]["decoded_bytes"] = size
    path = write_parts(parts, tmp_path / "claims.safetensors")
    for error in _refusals(path):
        assert f"does not describe a file of decoded_bytes = {size} bytes" in str(error)
        assert error.file == str(path)


@pytest.mark.parametrize("encoding", ["lossless", "fp8"])
def test_a_header_of_two_to_the_26_blocks_with_its_size_is_refused_unallocated(
    files, tmp_path, encoding
):
    # The decoded file's header and decoded_bytes agree on 2**26 blocks (terabytes of pages):
    # what is stored, ten blocks of each tensor, is what refuses them, before any allocation.
    parts = stored_parts(files / f"{encoding}.safetensors")
    with kvsnap.Snapshot.open(files / "kv.safetensors") as original:
        metadata = dataclasses.replace(original.metadata, num_blocks=2**26)
    (layout,) = fmt.file_layouts(metadata)
    header = np.frombuffer(layout.header, dtype=np.uint8)
    parts.replace(enc.ORIGINAL_HEADER_TENSOR, "U8", (len(header),), header)
    parts.document["encoding"]["decoded_bytes"] = layout.file_size
    assert layout.file_size > 2**40
    path = write_parts(parts, tmp_path / "huge.safetensors")
    for error in _refusals(path):
        # The first tensor checked (the page-check open checks the layer tensors first, the
        # decode the tensors in file order: kvsnap.block_hashes) holds ten blocks, not 2**26.
        assert error.tensor in ("layers.0.key", fmt.BLOCK_HASHES_TENSOR), str(error)
        stored, dtype = ("", "F8_E4M3") if error.tensor == "layers.0.key" else ("U8 (10, 16)", "U8")
        assert f"stored as {stored}" in str(error) and f"expected {dtype} ({2**26}, " in str(error)


@pytest.mark.parametrize("encoding", ["lossless", "fp8"])
@pytest.mark.parametrize(
    "claim",
    [
        {"shard": {"index": 1, "count": 2}},
        {
            "format_version": 2,
            "part": {"index": 1, "count": 2, "first_head": 0, "num_kv_heads": 4},
        },
    ],
    ids=["shard", "part"],
)
def test_a_decoded_header_of_a_shard_or_part_is_corrupt_not_a_callers_mistake(
    files, tmp_path, encoding, claim
):
    parts = stored_parts(files / f"{encoding}.safetensors")
    _, metadata, _ = original_header(parts)
    set_original_metadata(parts, {**metadata, **claim})
    path = write_parts(parts, tmp_path / "piece.safetensors")
    for error in _refusals(path):
        assert str(error) == f"{path}: holds a shard or part file"


@pytest.mark.parametrize(
    ("file", "suffix", "dtype", "shape"),
    [
        ("fp8", enc.PAGES_SUFFIX, "U64", (11,)),
        ("fp8", enc.PAGES_SUFFIX, "U64", (9,)),
        ("fp8", enc.PAGES_SUFFIX, "U8", (80,)),  # the right bytes, the wrong dtype
        ("signed-fp8", enc.DIGESTS_SUFFIX, "U8", (10, 31)),
        ("signed-fp8", enc.DIGESTS_SUFFIX, "U8", (11, 32)),
    ],
)
def test_page_check_tables_of_the_wrong_length_are_refused_naming_them(
    files, tmp_path, file, suffix, dtype, shape
):
    parts = stored_parts(files / f"{file}.safetensors")
    name = "layers.1.value" + suffix
    nbytes = int(np.prod(shape)) * enc.ITEM_BYTES[dtype]
    parts.replace(name, dtype, shape, np.zeros(nbytes, dtype=np.uint8))
    path = write_parts(parts, tmp_path / "checks.safetensors")
    expected = "U64 (10,)" if suffix == enc.PAGES_SUFFIX else "U8 (10, 32)"
    for error in _refusals(path):
        assert error.tensor == name
        assert f"stored as {dtype} {shape}, expected {expected}" in str(error)


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (float("nan"), "nan"),
        (float("inf"), "inf"),
        (float("-inf"), "-inf"),
        (0.0, "0"),
        (-2.0, "-2"),
        (1e-40, "9.99995e-41"),  # subnormal
    ],
)
def test_scales_a_quantizer_cannot_write_are_refused_by_the_open_that_reads_no_page(
    files, tmp_path, value, shown
):
    parts = stored_parts(files / "fp8.safetensors")
    scales = parts.array("layers.1.key" + enc.SCALES_SUFFIX).view("<f4")
    heads = 2  # the built-in model's KV heads: scales are (blocks, heads)
    scales[7 * heads + 1] = value  # block 7, head 1
    path = write_parts(parts, tmp_path / "scales.safetensors")
    for error in _refusals(path):
        assert (error.tensor, error.block) == ("layers.1.key", 7)
        assert f"fp8 scale of head 1 is {shown} " in str(error)


def test_the_tampered_files_differ_only_in_the_field_under_test(files, tmp_path):
    # The rewriter itself leaves a file that opens and decodes as the original does.
    for name in ("lossless", "fp8"):
        again = write_parts(stored_parts(files / f"{name}.safetensors"), tmp_path / name)
        assert again.read_bytes() == (files / f"{name}.safetensors").read_bytes()
    unsigned = write_parts(stored_parts(files / "signed-fp8.safetensors"), tmp_path / "s")
    assert unsigned.read_bytes() == (files / "signed-fp8.safetensors").read_bytes()
