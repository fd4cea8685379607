"""docs/format.md's "Encoded snapshots" is enough to read one without kvsnap: its decoding
recipe (numpy, zstandard, xxhash only), taken from the doc itself, reproduces kvsnap's decode
of real KV in every dtype, and with the doc's text ("Checksums") rebuilds the whole decoded file
byte for byte (lossless: the original file); the error an fp8 file records is the error measured
from the original (read by safetensors) and the recipe's decode, in float64 numpy; a plain
safetensors reader opens an fp8 file and gets F8_E4M3 pages and F32 scales that torch's own fp8
arithmetic decodes bit for bit as kvsnap does; a signed encoded file checks with its key and no
other."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import kvsnap
from kvsnap.encoded.read import decode, read_encoded
from kvsnap.encoded.write import encode_file
from kvsnap.errors import BadSignatureError, UnsignedSnapshotError
from kvsnap.format.signing import KeyRing
from tests.support.encoded_files import capture_mixed, capture_real
from tests.support.format_doc import decoded_file, doc_recipe, fp8_pages
from tests.support.independent_error import held_tokens, numpy_tensor_error

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
SAFETENSORS_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def _encoded(tmp_path, kind: str, dtype: torch.dtype, encoding: str):
    source = tmp_path / "kv.safetensors"
    capture_real(source, kind, dtype)
    target = tmp_path / f"kv.{encoding}.safetensors"
    encode_file(source, target, encoding)
    return source, target


@pytest.mark.parametrize("kind", ["vllm-nhd", "mla"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
def test_the_doc_recipe_decodes_an_fp8_file_as_kvsnap_does(tmp_path, dtype, kind):
    _, target = _encoded(tmp_path, kind, dtype, "fp8")
    recipe = doc_recipe()
    meta, header, data = recipe["tensors"](target)
    assert meta["format_version"] == 3 and meta["encoding"]["name"] == "fp8"
    with kvsnap.Snapshot.open(target) as snapshot:
        for name in snapshot.geometry.tensor_names():
            assert header[name]["dtype"] == "F8_E4M3"
            pages = fp8_pages(recipe, header, data, name, SAFETENSORS_NAMES[dtype])
            want = snapshot.read_tensor(name).contiguous().view(torch.uint8).numpy()
            np.testing.assert_array_equal(np.frombuffer(pages, np.uint8), want.reshape(-1))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
def test_the_doc_recipe_decodes_a_lossless_file_to_the_original_pages(tmp_path, dtype):
    source, target = _encoded(tmp_path, "vllm-nhd", dtype, "lossless")
    recipe = doc_recipe()
    meta, _, data = recipe["tensors"](target)
    _, original_header, original = recipe["tensors"](source)
    coded = [name for name, kind in meta["encoding"]["tensors"].items() if kind == "lossless"]
    assert coded, "real KV shrinks by more than 5%"
    for name in coded:
        shape = original_header[name]["shape"]
        word = 2 if dtype != torch.float32 else 4
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


@pytest.mark.parametrize(
    ("encoding", "kind", "dtype"),
    [
        ("lossless", "vllm-nhd", torch.float16),
        ("lossless", "mla", torch.float32),
        ("lossless", "mixed", torch.bfloat16),  # coded, raw-plane and raw tensors in one file
        ("fp8", "vllm-nhd", torch.bfloat16),
        ("fp8", "mla", torch.float16),
        ("fp8", "vllm-nhd", torch.float32),
    ],
)
def test_the_doc_rebuilds_the_whole_decoded_file_byte_for_byte(tmp_path, encoding, kind, dtype):
    source = tmp_path / "kv.safetensors"
    if kind == "mixed":
        capture_mixed(source)
    else:
        capture_real(source, kind, dtype)
    target = tmp_path / "encoded.safetensors"
    encode_file(source, target, encoding)
    rebuilt = decoded_file(target)
    assert rebuilt == decode(read_encoded(target)).tobytes()
    if encoding == "lossless":
        assert rebuilt == source.read_bytes()
    else:  # an ordinary file kvsnap opens and checks: its checksums are the doc's
        plain = tmp_path / "rebuilt.safetensors"
        plain.write_bytes(rebuilt)
        with kvsnap.Snapshot.open(plain) as snapshot:
            assert snapshot.encoded is None and snapshot.verify() == []


@pytest.mark.parametrize("kind", ["vllm-nhd", "mla"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
def test_the_recorded_error_is_the_error_measured_without_kvsnap(tmp_path, dtype, kind):
    source, target = _encoded(tmp_path, kind, dtype, "fp8")
    recipe = doc_recipe()
    meta, header, data = recipe["tensors"](target)
    original_meta, original_header, original_data = recipe["tensors"](source)
    originals = load_file(source)  # the pages as captured, read by safetensors
    block_size = original_meta["layout"]["block_size"]
    uses = [
        (record["num_tokens"], original_data[f"sequences.{j}.block_ids"].view("<i8"))
        for j, record in enumerate(original_meta["sequences"])
    ]
    counts = held_tokens(block_size, original_meta["num_blocks"], uses)
    recorded = {entry["tensor"]: entry for entry in meta["encoding"]["error"]["tensors"]}
    assert sorted(recorded) == sorted(originals.keys() & recorded.keys())
    numpy_type = {torch.bfloat16: np.float32, torch.float16: np.float16}.get(dtype, np.float32)
    for name, entry in recorded.items():
        pages = np.frombuffer(
            fp8_pages(recipe, header, data, name, SAFETENSORS_NAMES[dtype]), "<u1"
        )
        if dtype == torch.bfloat16:  # bfloat16 bits are the top half of a float32's
            decoded = (pages.view("<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            decoded = pages.view(numpy_type)
        original = originals[name].float().numpy()
        shape = (original.shape[0], block_size, -1, original.shape[-1])  # MLA: one head
        want = numpy_tensor_error(original.reshape(shape), decoded.reshape(shape), counts)
        assert entry["values"] == want["values"] and entry["non_finite"] == want["non_finite"]
        for field in ("max_abs", "max_abs_rel_block", "rms_rel", "underflow_share"):
            assert entry[field] == pytest.approx(want[field], rel=1e-5, abs=1e-12), (name, field)
        for field in ("min_cosine", "mean_cosine"):
            assert entry[field] == pytest.approx(want[field], abs=2e-6), (name, field)
    assert original_header[next(iter(recorded))]["dtype"] == SAFETENSORS_NAMES[dtype]


@pytest.mark.parametrize("kind", ["vllm-nhd", "mla"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
def test_a_plain_safetensors_reader_opens_an_fp8_snapshot(tmp_path, dtype, kind):
    source, target = _encoded(tmp_path, kind, dtype, "fp8")
    with kvsnap.Snapshot.open(source) as original:
        geometry = original.geometry
        names = geometry.tensor_names()
        heads = 1 if geometry.is_mla else geometry.num_kv_heads
    with kvsnap.Snapshot.open(target) as snapshot:
        decoded = {name: snapshot.read_tensor(name) for name in names}
    with safe_open(target, framework="pt") as stored:
        assert stored.metadata()["format"] == "pt" and "kvsnap" in stored.metadata()
        for name in names:
            values, scales = stored.get_tensor(name), stored.get_tensor(name + ".scales")
            assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
            assert scales.shape == (values.shape[0], heads)
            # Torch's own fp8 arithmetic: the fp32 product rounded to the cache dtype.
            by_head = values.reshape(*values.shape[:2], heads, -1).float()
            product = (by_head * scales[:, None, :, None]).reshape(values.shape).to(dtype)
            want = decoded[name].contiguous().view(torch.uint8)
            assert torch.equal(product.contiguous().view(torch.uint8), want), name
    # numpy has no fp8 type: a numpy reader gets everything else, and sees the fp8 dtype.
    with safe_open(target, framework="np") as stored:
        for name in stored.keys():
            if stored.get_slice(name).get_dtype() == "F8_E4M3":
                assert name in names
            else:
                stored.get_tensor(name)
        assert stored.get_tensor(names[0] + ".scales").dtype == np.float32


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
