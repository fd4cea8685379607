"""An fp8 snapshot written as fp8 again (``recode_file``, what ``kvsnap convert --compress fp8``
runs) is kept, not quantized a second time: unsigned, or signed with or without its key, the
same file byte for byte (its e4m3 values, scales, page checks and recorded error); unsigned
with a key, the same tensors signed, byte for byte what a signed encode of the captured KV
writes. A corrupt one is refused, nothing written. Written as lossless it keeps its decoded
values and says its error is not carried; a lossless file written as fp8 is the captured KV's
fp8 file, as before. On the built-in model's KV a second quantization moves about half the
decoded values (49%, by up to 0.125: the reason for all this), checked here too."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvsnap.encoded.original import parse_original
from kvsnap.encoded.read import decode, read_encoded
from kvsnap.encoded.write import encode_file, recode_file
from kvsnap.errors import BadSignatureError, SnapshotCorruptError
from kvsnap.format import encoded as enc
from kvsnap.format.signing import KeyRing
from tests.support.encoded_files import capture_real
from tests.support.encoded_tamper import stored_parts, write_parts

KEY = KeyRing([bytes(range(32))])
OTHER = KeyRing([bytes(range(1, 33))])
LAYERS = [f"layers.{i}.{part}" for i in range(4) for part in ("key", "value")]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("kept-fp8")
    capture_real(folder / "kv.safetensors", "vllm-nhd", torch.bfloat16)
    encode_file(folder / "kv.safetensors", folder / "fp8.safetensors", "fp8")
    encode_file(folder / "kv.safetensors", folder / "signed-fp8.safetensors", "fp8", keys=KEY)
    encode_file(folder / "kv.safetensors", folder / "lossless.safetensors", "lossless")
    return folder


def _stored(path: Path) -> dict[str, bytes]:
    """Every fp8 layer tensor's stored values, scales and xxh3-64 page checks, by name."""
    encoded = read_encoded(path)
    names = [name + suffix for name in LAYERS for suffix in ("", enc.SCALES_SUFFIX)]
    names += [name + enc.PAGES_SUFFIX for name in LAYERS]
    return {name: encoded.tensor(name).tobytes() for name in names}


def test_fp8_written_as_fp8_is_the_same_file_not_a_second_quantization(files, tmp_path):
    source = files / "fp8.safetensors"
    result = recode_file(source, tmp_path / "again.safetensors", "fp8")
    again = tmp_path / "again.safetensors"
    assert again.read_bytes() == source.read_bytes()
    assert _stored(again) == _stored(source)
    recorded = read_encoded(source).error
    assert recorded is not None and result.error == recorded
    assert read_encoded(again).encoding["error"] == read_encoded(source).encoding["error"]
    assert (result.encoding, result.stored_bytes) == ("fp8", source.stat().st_size)
    assert result.decoded_bytes == (files / "kv.safetensors").stat().st_size
    (note,) = result.notes
    assert note.startswith(f"{source} is fp8 already: {again} is a copy of it: its values")
    # What keeping it spares: the decoded pages quantized again move about half the values.
    decoded = tmp_path / "decoded.safetensors"
    decoded.write_bytes(decode(read_encoded(source)).tobytes())
    encode_file(decoded, tmp_path / "twice.safetensors", "fp8")
    once = parse_original(decode(read_encoded(source)))
    twice = parse_original(decode(read_encoded(tmp_path / "twice.safetensors")))
    moved = [
        once.bytes_of(entry).view("<u2") != twice.bytes_of(entry).view("<u2")
        for entry in once.layer_entries
    ]
    assert np.concatenate(moved).mean() > 0.4


@pytest.mark.parametrize("keys", [None, KEY], ids=["without-key", "with-key"])
def test_a_signed_fp8_file_is_copied_signed(files, tmp_path, keys):
    source = files / "signed-fp8.safetensors"
    result = recode_file(source, tmp_path / "again.safetensors", "fp8", keys=keys)
    assert (tmp_path / "again.safetensors").read_bytes() == source.read_bytes()
    (note,) = result.notes
    assert "is a copy of it, signed as it was: its values, scales and recorded error" in note
    read_encoded(tmp_path / "again.safetensors", keys=KEY)  # its signature still checks


def test_a_signed_fp8_file_under_another_key_is_refused_and_nothing_written(files, tmp_path):
    with pytest.raises(BadSignatureError):
        recode_file(files / "signed-fp8.safetensors", tmp_path / "x.safetensors", "fp8", keys=OTHER)
    assert list(tmp_path.iterdir()) == []


def test_an_unsigned_fp8_file_given_a_key_is_its_same_tensors_signed(files, tmp_path):
    signed = tmp_path / "signed.safetensors"
    result = recode_file(files / "fp8.safetensors", signed, "fp8", keys=KEY)
    # Byte for byte the file a signed fp8 encode of the captured KV writes: the same values,
    # scales and report, with the pages' BLAKE3 digests and the signature.
    assert signed.read_bytes() == (files / "signed-fp8.safetensors").read_bytes()
    assert _stored(signed) == _stored(files / "fp8.safetensors")
    checked = read_encoded(signed, keys=KEY)
    assert checked.encoding["signature"] == enc.PAGES_SIGNATURE_ALGORITHM
    assert result.error == read_encoded(files / "fp8.safetensors").error
    (note,) = result.notes
    assert f"unchanged, signed with key {KEY.signing_key_id} " in note


def test_a_corrupt_fp8_file_is_refused_before_anything_is_written(files, tmp_path):
    parts = stored_parts(files / "fp8.safetensors")
    parts.array("layers.2.value" + enc.SCALES_SUFFIX).view("<f4")[3] = float("nan")
    corrupt = write_parts(parts, tmp_path / "corrupt.safetensors")
    with pytest.raises(SnapshotCorruptError, match="fp8 scale of head 1 is nan"):
        recode_file(corrupt, tmp_path / "out.safetensors", "fp8")
    assert not (tmp_path / "out.safetensors").exists()


def test_fp8_and_lossless_written_as_each_other_keep_their_meaning(files, tmp_path):
    # fp8 -> lossless: the fp8 file's decoded values, bit for bit, without its error report.
    source = files / "fp8.safetensors"
    result = recode_file(source, tmp_path / "lossless.safetensors", "lossless")
    decoded = decode(read_encoded(source))
    assert np.array_equal(decode(read_encoded(tmp_path / "lossless.safetensors")), decoded)
    assert result.error is None
    (note,) = result.notes
    assert note == (
        f"{source} is fp8: {tmp_path / 'lossless.safetensors'} holds its decoded values, bit for "
        f"bit; the error {source} records (against the pages it was made from, which are gone) "
        "is not carried"
    )
    # lossless -> fp8: the captured KV quantized once, as an fp8 encode of it writes.
    result = recode_file(files / "lossless.safetensors", tmp_path / "fp8.safetensors", "fp8")
    assert (tmp_path / "fp8.safetensors").read_bytes() == source.read_bytes()
    assert result.notes == ()
