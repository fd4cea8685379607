"""A signed ordinary snapshot encoded (``encode_file``, ``recode_file``): the encoded file is
byte for byte what an encoded capture of the same KV signed with the same key writes (the
decoded file unsigned, the encoded file signed); the source's signature is checked first, a
page forged to keep its xxh3-64 included; without keys nothing is written."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

import kvsnap
from kvsnap.encoded.original import parse_original, read_local
from kvsnap.encoded.write import encode_file, recode_file
from kvsnap.errors import BadSignatureError, SnapshotCorruptError
from kvsnap.format.signing import KeyRing
from tests.support.encoded_files import capture_real, real_caches, real_sequences
from tests.support.xxh3_forgery import forge_page

KEY = KeyRing([bytes(range(32))])
OTHER = KeyRing([bytes(range(1, 33))])


@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    """Real KV (the built-in model's, bf16) captured signed with ``KEY``."""
    path = tmp_path_factory.mktemp("signed-sources") / "signed.safetensors"
    capture_real(path, "vllm-nhd", torch.bfloat16, keys=KEY)
    return path


@pytest.mark.parametrize("compression", ["lossless", "fp8"])
def test_a_signed_file_encodes_to_what_a_signed_encoded_capture_writes(
    signed, tmp_path, compression
):
    (cache,) = real_caches("vllm-nhd", torch.bfloat16)
    direct = tmp_path / "direct.safetensors"
    kvsnap.capture(
        cache.layout,
        real_sequences(),
        direct,
        reproducible=True,
        keys=KEY,
        compression=compression,
    )
    encoded, recoded = tmp_path / "encoded.safetensors", tmp_path / "recoded.safetensors"
    result = encode_file(signed, encoded, compression, keys=KEY)
    recode_file(signed, recoded, compression, keys=KEY)
    assert encoded.read_bytes() == direct.read_bytes() == recoded.read_bytes()
    with kvsnap.Snapshot.open(encoded, keys=KEY) as snapshot:
        assert snapshot.metadata.signature is None  # the decoded file
        assert result.decoded_bytes == snapshot.encoded.decoded_bytes
        assert result.decoded_bytes < signed.stat().st_size  # no page digests, no signature
        assert snapshot.signature_problems(KEY) == []
        with pytest.raises(BadSignatureError):
            kvsnap.Snapshot.open(encoded, keys=OTHER)
    with kvsnap.Snapshot.open(
        encoded
    ) as snapshot:  # the encoded file's signature, not the decoded's
        (problem,) = snapshot.signature_problems(OTHER)
        assert isinstance(problem, BadSignatureError) and problem.file == str(encoded)


@pytest.mark.parametrize("encode", [encode_file, recode_file])
def test_without_keys_or_with_others_nothing_is_encoded(signed, tmp_path, encode):
    target = tmp_path / "encoded.safetensors"
    with pytest.raises(ValueError, match="is signed: encode it with its key"):
        encode(signed, target, "lossless")
    with pytest.raises(BadSignatureError, match="not one of ours"):
        encode(signed, target, "fp8", keys=OTHER)
    assert list(tmp_path.iterdir()) == []


def test_a_page_forged_to_keep_its_checksum_is_refused(signed, tmp_path):
    # Block 2 of layers.1.value made block 5's bytes, forged to keep block 2's xxh3-64: every
    # checksum and the signature still match; only the signed BLAKE3 digest of the page differs.
    original = parse_original(read_local(signed), str(signed))
    entry = original.layout.by_name["layers.1.value"]
    pages = original.pages(entry)
    forged = forge_page(pages[5].tobytes(), xxhash.xxh3_64_intdigest(pages[2].tobytes()))
    data = np.fromfile(signed, dtype=np.uint8)
    begin = entry.begin + 2 * pages.shape[1]
    data[begin : begin + pages.shape[1]] = np.frombuffer(forged, dtype=np.uint8)
    attacked = tmp_path / "attacked.safetensors"
    data.tofile(attacked)
    with pytest.raises(SnapshotCorruptError, match="BLAKE3 digest") as raised:
        encode_file(attacked, tmp_path / "encoded.safetensors", "lossless", keys=KEY)
    assert (raised.value.tensor, raised.value.block) == ("layers.1.value", 2)
    assert [path.name for path in tmp_path.iterdir()] == [attacked.name]
