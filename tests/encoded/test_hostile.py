"""Hostile encoded files: corrupt chunks, scales that are NaN or zero, chunk tables that overlap
or run past the data, tensors that overlap or run past the file, an absurd header. Each is
refused with one clear error (``SnapshotCorruptError`` naming what, or ``NotASnapshotError``)
before anything is decoded from it; the trailer of every mutated file is recomputed so that the
check under test, not the checksums, is what refuses it."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
import xxhash

import kvsnap
from kvsnap.encoded.read import decode, read_encoded
from kvsnap.encoded.write import encode_file
from kvsnap.encoding import lossless
from kvsnap.errors import NotASnapshotError, SnapshotCorruptError
from kvsnap.format import encoded as enc
from kvsnap.format.hashing import digest128, encode_trailer
from tests.support.encoded_files import capture_mixed, capture_real


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    source = folder / "kv.safetensors"
    capture_real(source, "vllm-nhd", torch.bfloat16)
    for encoding in ("lossless", "fp8"):
        encode_file(source, folder / f"{encoding}.safetensors", encoding)
    return folder


def _mutated(files, encoding: str, tmp_path, mutate) -> str:
    """A copy of the ``encoding`` file with ``mutate(data, layout)`` applied to its bytes and
    its trailer recomputed, so it passes the checksums."""
    data = np.fromfile(files / f"{encoding}.safetensors", dtype=np.uint8)
    layout = enc.parse_header(
        data[: enc.header_length(data[:8].tobytes(), len(data)) + 8].tobytes(), len(data)
    )
    mutate(data, layout.by_name)
    header = data[: layout.data_start].tobytes()
    rows = [digest128(header)] + [digest128(data[t.begin : t.end]) for t in layout.checksummed]
    trailer = layout.by_name[enc.ENCODED_CHECKSUMS_TENSOR]
    data[trailer.begin : trailer.end] = np.frombuffer(encode_trailer(rows), dtype=np.uint8)
    path = tmp_path / f"mutated.{encoding}.safetensors"
    data.tofile(path)
    return str(path)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A lossless file of real KV (coded) beside a tensor with a raw low plane
    (``layers.1.key``) and a tensor stored raw (``layers.1.value``)."""
    folder = tmp_path_factory.mktemp("mixed")
    capture_mixed(folder / "kv.safetensors")
    encode_file(folder / "kv.safetensors", folder / "lossless.safetensors", "lossless")
    kinds = read_encoded(folder / "lossless.safetensors").encoding["tensors"]
    assert kinds["layers.1.value"] == "raw" and kinds["layers.1.key"] == "lossless"
    return folder


def test_a_raw_page_that_differs_from_the_original_is_refused_naming_its_block(mixed, tmp_path):
    # The encoded container is consistent (its trailer recomputed): only the original's own
    # page checksums, checked as each piece of the decode is written, can find the change.
    def flip(data, by_name):
        entry = by_name["layers.1.value"]
        page_bytes = entry.nbytes // entry.shape[0]
        data[entry.begin + 5 * page_bytes + 17] ^= 0x01

    with pytest.raises(SnapshotCorruptError, match="page checksum mismatch") as raised:
        _decode(_mutated(mixed, "lossless", tmp_path, flip))
    assert (raised.value.tensor, raised.value.block) == ("layers.1.value", 5)


def test_a_tensor_that_differs_from_the_original_is_refused_by_its_trailer(files, tmp_path):
    # A token id changed (the encoded container consistent): the decoded file's own trailer,
    # checked after its pages, is what refuses it.
    def retoken(data, by_name):
        entry = by_name["sequences.1.token_ids"]
        data[entry.begin : entry.end].view("<i8")[40] += 1

    with pytest.raises(SnapshotCorruptError, match="checksum trailer mismatch"):
        _decode(_mutated(files, "lossless", tmp_path, retoken))


def test_a_chunk_rewritten_with_its_checksum_is_refused_by_the_page_checksums(mixed, tmp_path):
    # A hostile writer changes a raw plane's byte and rewrites the chunk's xxh3-64 and the
    # file's trailer: the chunk decodes, and the decoded page is what gives it away.
    def rewrite(data, by_name):
        table = _table(data, by_name, "layers.1.key")
        stored = by_name["layers.1.key"]
        row = table[0]
        assert row[lossless.PLANES_START] == lossless.CODEC_RAW  # plane 0: mantissas, raw
        length = int(row[lossless.PLANES_START + 1 :: 2].sum())
        chunk = data[stored.begin : stored.begin + length]
        chunk[3000] ^= 0x80  # word 3000 of plane 0: page 3000 // (page_bytes / 2)
        row[lossless.CHECKSUM] = xxhash.xxh3_64_intdigest(chunk.tobytes())

    with pytest.raises(SnapshotCorruptError, match="page checksum mismatch") as raised:
        _decode(_mutated(mixed, "lossless", tmp_path, rewrite))
    assert raised.value.tensor == "layers.1.key"
    with kvsnap.Snapshot.open(mixed / "kv.safetensors") as original:
        page_words = original.geometry.block_size * original.geometry.num_kv_heads
        page_words *= original.geometry.head_dim
    assert raised.value.block == 3000 // page_words


def _table(data, by_name, name="layers.0.key"):
    entry = by_name[name + enc.CHUNKS_SUFFIX]
    return data[entry.begin : entry.end].view("<u8").reshape(entry.shape)


def _decode(path):
    return decode(read_encoded(path))


def test_a_corrupt_chunk_is_refused_by_its_checksum(files, tmp_path):
    def flip(data, by_name):
        entry = by_name["layers.1.value"]
        data[entry.begin + 100] ^= 0x40

    with pytest.raises(SnapshotCorruptError, match="chunk 0: the stored bytes do not match") as e:
        _decode(_mutated(files, "lossless", tmp_path, flip))
    assert e.value.tensor == "layers.1.value"
    # And through Snapshot.open, the same one error.
    with pytest.raises(SnapshotCorruptError, match="do not match their checksum"):
        kvsnap.Snapshot.open(_mutated(files, "lossless", tmp_path, flip))


@pytest.mark.parametrize(
    ("value", "words"), [(float("nan"), "is nan"), (0.0, "is 0 "), (-2.0, "is -2 ")]
)
def test_scales_that_are_nan_zero_or_negative_are_refused(files, tmp_path, value, words):
    def poison(data, by_name):
        entry = by_name["layers.1.key" + enc.SCALES_SUFFIX]
        scales = data[entry.begin : entry.end].view("<f4")
        scales[5] = value

    with pytest.raises(SnapshotCorruptError, match=words) as raised:
        _decode(_mutated(files, "fp8", tmp_path, poison))
    assert raised.value.tensor == "layers.1.key"


def test_a_chunk_table_whose_chunks_overlap_is_refused(files, tmp_path):
    def overlap(data, by_name):
        table = _table(data, by_name)
        table[0, 5] += 7  # plane 0 of chunk 0 claims bytes of plane 1

    with pytest.raises(SnapshotCorruptError, match=r"plane lengths|fill"):
        _decode(_mutated(files, "lossless", tmp_path, overlap))


def test_a_chunk_table_running_past_the_data_is_refused(files, tmp_path):
    def past(data, by_name):
        table = _table(data, by_name)
        table[-1, 2] += 1 << 40  # the last chunk starts a terabyte on

    with pytest.raises(SnapshotCorruptError, match="starts at byte"):
        _decode(_mutated(files, "lossless", tmp_path, past))


def test_a_chunk_declaring_a_huge_page_count_is_refused_without_decoding(files, tmp_path):
    def huge(data, by_name):
        _table(data, by_name)[0, 1] = 1 << 50

    with pytest.raises(SnapshotCorruptError, match="holds 1125899906842624 pages"):
        _decode(_mutated(files, "lossless", tmp_path, huge))


def _rewrite_header(files, tmp_path, edit) -> str:
    data = np.fromfile(files / "fp8.safetensors", dtype=np.uint8)
    (length,) = struct.unpack("<Q", data[:8].tobytes())
    header = json.loads(data[8 : 8 + length].tobytes())
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (length - len(text))
    assert len(text) == length
    data[8 : 8 + length] = np.frombuffer(text, dtype=np.uint8)
    path = tmp_path / "edited.safetensors"
    data.tofile(path)
    return str(path)


def test_tensors_that_overlap_or_run_past_the_file_are_refused(files, tmp_path):
    def overlap(header):
        header["layers.0.value"]["data_offsets"][0] -= 64
        header["layers.0.value"]["data_offsets"][1] -= 64

    with pytest.raises(SnapshotCorruptError, match="starts at byte"):
        read_encoded(_rewrite_header(files, tmp_path, overlap))

    def past(header):
        last = list(header)[-1]
        header[last]["shape"] = [header[last]["shape"][0] * 2, 16]
        header[last]["data_offsets"][1] += (
            header[last]["data_offsets"][1] - header[last]["data_offsets"][0]
        )

    with pytest.raises(SnapshotCorruptError, match="end at byte"):
        read_encoded(_rewrite_header(files, tmp_path, past))


def test_an_absurd_header_length_is_refused_before_reading_it(tmp_path):
    path = tmp_path / "absurd.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 60) + b'{"__metadata__":{}}')
    with pytest.raises(NotASnapshotError, match="declares a"):
        read_encoded(path)


@pytest.mark.parametrize("encoding", ["lossless", "fp8"])
def test_an_encoded_file_behind_a_url_is_refused_saying_how_it_is_read(files, encoding):
    # kvsnap reads encoded files (format version 3) as local files: behind a URL the ordinary
    # open refuses one, saying so and how to decode it; not that kvsnap is too old to read it.
    import fsspec

    name = f"/kvsnap-tests/{encoding}.safetensors"
    fsspec.filesystem("memory").pipe_file(name, (files / f"{encoding}.safetensors").read_bytes())
    try:
        with pytest.raises(kvsnap.UnsupportedVersionError, match="an encoded snapshot") as raised:
            kvsnap.Snapshot.open(f"memory://{name}")
    finally:
        fsspec.filesystem("memory").rm(name)
    assert "upgrade" not in str(raised.value) and "as a local file" in str(raised.value)
    assert "kvsnap convert FILE -o OUT --compress none" in str(raised.value)
