"""docs/format.md's "Encoded snapshots" is enough to read one without kvsnap: its decoding
recipe (numpy, zstandard, xxhash only), taken from the doc itself, reproduces kvsnap's decode
of real KV; a plain safetensors reader opens an fp8 file and gets F8_E4M3 pages and F32
scales; a signed encoded file checks with its key and no other."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import kvsnap
from kvsnap.encoded.read import read_encoded
from kvsnap.encoded.write import encode_file
from kvsnap.errors import BadSignatureError, UnsignedSnapshotError
from kvsnap.format.signing import KeyRing
from tests.support.encoded_files import capture_real
from tests.support.format_doc import doc_recipe


def test_the_doc_recipe_decodes_an_fp8_file_as_kvsnap_does(tmp_path):
    source = tmp_path / "kv.safetensors"
    capture_real(source, "vllm-nhd", torch.bfloat16)
    target = tmp_path / "kv.fp8.safetensors"
    encode_file(source, target, "fp8")
    recipe = doc_recipe()
    meta, header, data = recipe["tensors"](target)
    assert meta["format_version"] == 3 and meta["encoding"]["name"] == "fp8"
    with kvsnap.Snapshot.open(target) as snapshot:
        for name in snapshot.geometry.tensor_names():
            assert header[name]["dtype"] == "F8_E4M3"
            shape = header[name]["shape"]
            codes = data[name].reshape(shape)
            scales = data[name + ".scales"].view("<f4").reshape(header[name + ".scales"]["shape"])
            bits = recipe["fp8_to_bf16_bits"](codes, scales)
            want = snapshot.read_tensor(name).view(torch.int16).numpy().view(np.uint16)
            np.testing.assert_array_equal(bits, want, err_msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_doc_recipe_decodes_a_lossless_file_to_the_original_pages(tmp_path, dtype):
    source = tmp_path / "kv.safetensors"
    capture_real(source, "vllm-nhd", dtype)
    target = tmp_path / "kv.lossless.safetensors"
    encode_file(source, target, "lossless")
    recipe = doc_recipe()
    meta, _, data = recipe["tensors"](target)
    _, original_header, original = recipe["tensors"](source)
    coded = [name for name, kind in meta["encoding"]["tensors"].items() if kind == "lossless"]
    assert coded, "real KV shrinks by more than 5%"
    for name in coded:
        shape = original_header[name]["shape"]
        word = 2 if dtype == torch.bfloat16 else 4
        pages = recipe["lossless_pages"](
            data[name],
            data[name + ".chunks"].view("<u8"),
            shape[0],
            len(original[name]) // shape[0],
            word,
        )
        np.testing.assert_array_equal(pages, original[name], err_msg=name)
    header_bytes = data["kvsnap.original_header"]
    assert np.array_equal(header_bytes, np.fromfile(source, dtype=np.uint8)[: len(header_bytes)])


def test_a_plain_safetensors_reader_opens_an_fp8_snapshot(tmp_path):
    source = tmp_path / "kv.safetensors"
    content = capture_real(source, "vllm-nhd", torch.float16)
    target = tmp_path / "kv.fp8.safetensors"
    encode_file(source, target, "fp8")
    tensors = load_file(target)
    key = tensors["layers.0.key"]
    scales = tensors["layers.0.key.scales"]
    assert key.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert scales.shape == (key.shape[0], content.geometry.num_kv_heads)
    # Torch's own fp8 arithmetic gives back the pages within fp8's precision.
    with kvsnap.Snapshot.open(source) as original:
        want = original.read_tensor("layers.0.key").float()
    approx = key.float() * scales[:, None, :, None]
    block_max = want.abs().amax(dim=(1, 2, 3), keepdim=True)
    assert ((approx - want).abs() <= block_max / 16).all()


def test_a_signed_encoded_file_checks_with_its_key_only(tmp_path):
    source = tmp_path / "kv.safetensors"
    capture_real(source, "vllm-nhd", torch.bfloat16)
    key, other = KeyRing([b"k" * 32]), KeyRing([b"o" * 32])
    signed, unsigned = tmp_path / "signed.safetensors", tmp_path / "unsigned.safetensors"
    encode_file(source, signed, "lossless", keys=key)
    encode_file(source, unsigned, "lossless")
    assert read_encoded(signed, key).encoding["signature"] == "encoded-hmac-sha256-blake3"
    with pytest.raises(BadSignatureError, match="not one of ours"):
        read_encoded(signed, other)
    with pytest.raises(UnsignedSnapshotError):
        read_encoded(unsigned, key)
    with kvsnap.Snapshot.open(signed, keys=key) as snapshot:
        assert snapshot.verify() == []
    # One flipped byte of a page's stored chunk: the checksums refuse it before the key does.
    raw = bytearray(signed.read_bytes())
    entry = read_encoded(signed).layout.by_name["layers.1.value"]
    raw[entry.begin + 5] ^= 1
    signed.write_bytes(bytes(raw))
    with pytest.raises(kvsnap.errors.SnapshotCorruptError, match="checksum mismatch"):
        read_encoded(signed, key)
