"""A signed encoded file whose signature tensor is not ``U8 (48,)`` (key id and HMAC-SHA256) is
refused as corrupt when opened or inspected, with or without keys, as an ordinary signed file's
is: without keys nothing else reads that tensor, and ``inspect`` would show whatever its first
16 bytes are as the signing key. The files are written by kvsnap's own capture, then the
signature's header entry (and its bytes) rewritten and the trailer recomputed, so the check
under test, not the checksums, is what refuses them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import kvsnap
from kvsnap.errors import SnapshotCorruptError
from kvsnap.format.constants import SIGNATURE_TENSOR
from kvsnap.format.signing import KeyRing
from tests.support.cli_runs import run_kvsnap
from tests.support.encoded_files import real_caches, real_sequences, with_signature_tensor

KEY = KeyRing([bytes(range(32))])

#: Signature tensors that are not the format's: too short (the key id alone), too long, empty,
#: the right 48 bytes as another dtype, and as another shape.
MALFORMED = [("U8", (16,)), ("U8", (64,)), ("U8", (0,)), ("F32", (12,)), ("U8", (6, 8))]


@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real KV (the built-in model's prefill, bf16) captured signed: lossless, fp8 and
    ordinary (``none``)."""
    folder = tmp_path_factory.mktemp("signature-tensor")
    (cache,) = real_caches("vllm-nhd", torch.bfloat16)
    kvsnap.capture(cache.layout, real_sequences(), folder / "none.safetensors", keys=KEY)
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


@pytest.mark.parametrize("compression", ["lossless", "fp8"])
def test_the_rewrite_alone_changes_nothing(signed, tmp_path, compression):
    # The rewrite with the format's own dtype and shape gives back the file byte for byte,
    # which opens and is vouched for by its key: what the tests below refuse is the tensor.
    source, target = signed / f"{compression}.safetensors", tmp_path / "same.safetensors"
    with_signature_tensor(source, target, "U8", (48,))
    assert target.read_bytes() == source.read_bytes()
    with kvsnap.Snapshot.open(target, keys=KEY) as snapshot:
        assert snapshot.signing_key_ids() == [KEY.signing_key_id]


@pytest.mark.parametrize("compression", ["lossless", "fp8"])
@pytest.mark.parametrize(("dtype", "shape"), MALFORMED)
def test_a_malformed_signature_tensor_is_refused_as_corrupt(
    signed, tmp_path, compression, dtype, shape
):
    path = tmp_path / f"malformed.{compression}.safetensors"
    with_signature_tensor(signed / f"{compression}.safetensors", path, dtype, shape)
    for keys in (None, KEY):  # without keys no other check reads the tensor
        with pytest.raises(SnapshotCorruptError) as refused:
            kvsnap.Snapshot.open(path, keys=keys).close()
        error = refused.value
        assert (error.file, error.tensor) == (str(path), SIGNATURE_TENSOR)
        assert f"is {dtype} {shape}, the metadata implies U8 (48,)" in str(error)


@pytest.mark.parametrize(("dtype", "shape"), MALFORMED)
def test_an_ordinary_signed_file_is_refused_in_the_same_words(signed, tmp_path, dtype, shape):
    # The one check both kinds of file take (format/container.py check_declared_as).
    refusals = set()
    for compression in ("none", "lossless", "fp8"):
        path = tmp_path / f"{compression}.safetensors"
        with_signature_tensor(signed / f"{compression}.safetensors", path, dtype, shape)
        with pytest.raises(SnapshotCorruptError) as refused:
            kvsnap.Snapshot.open(path).close()
        refusals.add(str(refused.value).replace(str(path), "FILE"))
    assert refusals == {
        f"FILE, tensor {SIGNATURE_TENSOR}: is {dtype} {shape}, the metadata implies U8 (48,)"
    }


@pytest.mark.parametrize("compression", ["lossless", "fp8"])
def test_inspect_refuses_it_in_one_line_with_the_corrupt_exit_code(signed, tmp_path, compression):
    path = tmp_path / f"short.{compression}.safetensors"
    with_signature_tensor(signed / f"{compression}.safetensors", path, "U8", (16,))
    shown = run_kvsnap("inspect", str(path))
    assert shown.returncode == 1
    (line,) = shown.stderr.strip().splitlines()
    assert line.startswith("error: ") and SIGNATURE_TENSOR in line and "U8 (48,)" in line
    assert "Traceback" not in shown.stderr + shown.stdout
    as_json = run_kvsnap("inspect", str(path), "--json")
    assert as_json.returncode == 1
    assert json.loads(as_json.stdout)["ok"] is False
