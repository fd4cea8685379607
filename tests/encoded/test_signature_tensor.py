"""A signed encoded file whose signature tensor is not ``U8 (48,)`` (key id and HMAC-SHA256) is
refused as corrupt when opened or inspected, with or without keys, as an ordinary signed file's
is: without keys nothing else reads that tensor, and ``inspect`` would show whatever its first
16 bytes are as the signing key. The files are written by kvsnap's own capture, then the
signature's header entry (and its bytes) rewritten and the trailer recomputed, so the check
under test, not the checksums, is what refuses them."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import kvsnap
from kvsnap.errors import SnapshotCorruptError
from kvsnap.format import encoded as enc
from kvsnap.format.constants import SIGNATURE_TENSOR
from kvsnap.format.hashing import digest128, encode_trailer
from kvsnap.format.signing import KeyRing
from tests.support.cli_runs import run_kvsnap
from tests.support.encoded_files import real_caches, real_sequences

KEY = KeyRing([bytes(range(32))])

#: Signature tensors that are not the format's: too short (the key id alone), too long, empty,
#: the right 48 bytes as another dtype, and as another shape.
MALFORMED = [("U8", (16,)), ("U8", (64,)), ("U8", (0,)), ("F32", (12,)), ("U8", (6, 8))]


@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real KV (the built-in model's prefill, bf16) captured signed, lossless and fp8."""
    folder = tmp_path_factory.mktemp("signature-tensor")
    (cache,) = real_caches("vllm-nhd", torch.bfloat16)
    for compression in ("lossless", "fp8"):
        path = folder / f"{compression}.safetensors"
        kvsnap.capture(
            cache.layout,
            real_sequences(),
            path,
            reproducible=True,
            keys=KEY,
            compression=compression,
        )
    return folder


def _with_signature(source: Path, target: Path, dtype: str, shape: tuple[int, ...]) -> None:
    """``source`` with its signature tensor (its last) declared ``dtype`` ``shape``, its bytes
    the stored signature's cut or extended with zeros to that size, and its trailer recomputed
    for the new header."""
    data = source.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    entries = json.loads(data[8 : 8 + length])
    spec = entries[SIGNATURE_TENSOR]
    begin, end = spec["data_offsets"]
    nbytes = math.prod(shape) * enc.ITEM_BYTES[dtype]
    spec.update(dtype=dtype, shape=list(shape), data_offsets=[begin, begin + nbytes])
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=True).encode()
    assert len(text) <= length
    header = struct.pack("<Q", length) + text + b" " * (length - len(text))
    signature = (data[8 + length + begin : 8 + length + end] + bytes(nbytes))[:nbytes]
    out = np.frombuffer(header + data[8 + length : 8 + length + begin] + signature, np.uint8)
    out = out.copy()
    layout = enc.parse_header(header, len(out))
    rows = [digest128(header)] + [digest128(out[t.begin : t.end]) for t in layout.checksummed]
    trailer = layout.by_name[enc.ENCODED_CHECKSUMS_TENSOR]
    out[trailer.begin : trailer.end] = np.frombuffer(encode_trailer(rows), dtype=np.uint8)
    out.tofile(target)


@pytest.mark.parametrize("compression", ["lossless", "fp8"])
def test_the_rewrite_alone_changes_nothing(signed, tmp_path, compression):
    # The rewrite with the format's own dtype and shape gives back the file byte for byte,
    # which opens and is vouched for by its key: what the tests below refuse is the tensor.
    source, target = signed / f"{compression}.safetensors", tmp_path / "same.safetensors"
    _with_signature(source, target, "U8", (48,))
    assert target.read_bytes() == source.read_bytes()
    with kvsnap.Snapshot.open(target, keys=KEY) as snapshot:
        assert snapshot.signing_key_ids() == [KEY.signing_key_id]


@pytest.mark.parametrize("compression", ["lossless", "fp8"])
@pytest.mark.parametrize(("dtype", "shape"), MALFORMED)
def test_a_malformed_signature_tensor_is_refused_as_corrupt(
    signed, tmp_path, compression, dtype, shape
):
    path = tmp_path / f"malformed.{compression}.safetensors"
    _with_signature(signed / f"{compression}.safetensors", path, dtype, shape)
    for keys in (None, KEY):  # without keys no other check reads the tensor
        with pytest.raises(SnapshotCorruptError) as refused:
            kvsnap.Snapshot.open(path, keys=keys).close()
        error = refused.value
        assert (error.file, error.tensor) == (str(path), SIGNATURE_TENSOR)
        assert f"is {dtype} {shape}, the metadata implies U8 (48,)" in str(error)


@pytest.mark.parametrize("compression", ["lossless", "fp8"])
def test_inspect_refuses_it_in_one_line_with_the_corrupt_exit_code(signed, tmp_path, compression):
    path = tmp_path / f"short.{compression}.safetensors"
    _with_signature(signed / f"{compression}.safetensors", path, "U8", (16,))
    shown = run_kvsnap("inspect", str(path))
    assert shown.returncode == 1
    (line,) = shown.stderr.strip().splitlines()
    assert line.startswith("error: ") and SIGNATURE_TENSOR in line and "U8 (48,)" in line
    assert "Traceback" not in shown.stderr + shown.stdout
    as_json = run_kvsnap("inspect", str(path), "--json")
    assert as_json.returncode == 1
    assert json.loads(as_json.stdout)["ok"] is False
