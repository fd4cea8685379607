"""Golden KV snapshots stored lossless (``check_golden(..., compression="lossless")``): smaller
than plain ones on the KV of a real prefill, compared exactly (a one-bit change is a
difference, also one a comparison of values cannot see: a zero's sign, a NaN's payload),
reproducible, and plain golden files still read (and are re-encoded on request)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from kvsnap.encoded.summary import file_encoding
from kvsnap.snapshot import Snapshot
from kvsnap.testing.golden import check_golden, stored_compression
from tests.support.prefill_kv import TEXT

pytest.importorskip("transformers")


@functools.lru_cache(maxsize=2)
def _prefill(dtype: torch.dtype) -> tuple[object, list[int]]:
    """The built-in model's ``DynamicCache`` of 100 byte tokens of English text, and the ids."""
    from kvsnap.engines import transformers as kt
    from kvsnap.engines.default_model import load_model

    model = load_model(dtype=dtype)
    [(cache, ids)] = kt.prefill_token_ids(model, [model.encode(TEXT)[:100]])
    return cache, ids


def _kv(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The prefill's KV as a mapping ``layers.{i}.key|value``: ``(tokens, heads, head_dim)``."""
    cache, _ = _prefill(dtype)
    kv = {}
    for index, layer in enumerate(cache.layers):  # type: ignore[attr-defined]
        kv[f"layers.{index}.key"] = layer.keys[0].transpose(0, 1).clone()
        kv[f"layers.{index}.value"] = layer.values[0].transpose(0, 1).clone()
    return kv


def _flip_lowest_bit(tensor: torch.Tensor, index: tuple[int, ...]) -> torch.Tensor:
    """A copy of ``tensor`` with the lowest bit of one element's bits flipped."""
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[tensor.dtype]
    changed = tensor.clone()
    changed.view(bits)[index] ^= 1
    return changed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_lossless_golden_file_of_real_kv_is_smaller_and_compares_exactly(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    cache, ids = _prefill(dtype)
    plain, lossless = tmp_path / "plain.safetensors", tmp_path / "lossless.safetensors"
    assert check_golden(cache, plain, token_ids=[ids]).status == "missing"
    assert check_golden(cache, lossless, token_ids=[ids], compression="lossless").written
    assert stored_compression(plain) == "none" and stored_compression(lossless) == "lossless"
    encoding, ratio = file_encoding(str(lossless))
    assert encoding == "lossless"
    # bf16 KV shrinks by its exponent bytes, fp32 by its top two bytes' share of them.
    assert lossless.stat().st_size * ratio == pytest.approx(plain.stat().st_size, rel=0.01)
    assert ratio >= (1.5 if dtype == torch.bfloat16 else 1.25), ratio
    # The same KV compares equal (bit for bit: no tolerance), and the file holds it exactly.
    assert check_golden(cache, lossless, token_ids=[ids]).status == "matched"
    with Snapshot.open(lossless) as snapshot:
        assert snapshot.sequences[0].token_ids.tolist() == ids
        for name, values in _kv(dtype).items():
            assert torch.equal(snapshot.sequence_kv("seq-0", name), values), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_one_bit_change_in_the_kv_is_a_difference(tmp_path: Path, dtype: torch.dtype) -> None:
    _, ids = _prefill(dtype)
    kv = _kv(dtype)
    golden = tmp_path / "golden.safetensors"
    check_golden(kv, golden, token_ids=ids, compression="lossless")
    changed = dict(kv)
    changed["layers.2.value"] = _flip_lowest_bit(kv["layers.2.value"], (37, 1, 5))
    result = check_golden(changed, golden, token_ids=ids)
    assert result.status == "mismatch"
    report = " ".join(result.report.split())
    assert (
        "first difference beyond the tolerance: layer 2 (layers.2.value), sequence seq-0, "
        "token 37, head 1, channel 5" in report
    )
    assert check_golden(kv, golden, token_ids=ids).status == "matched"


@pytest.mark.parametrize("compression", ["none", "lossless"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_one_bit_change_that_values_cannot_see_is_a_difference(
    tmp_path: Path, dtype: torch.dtype, compression: str
) -> None:
    # -0.0 == 0.0 and NaN != NaN whatever its payload: a comparison of values misses a flipped
    # sign bit of a zero and a flipped payload bit of a NaN. An exact golden check does not.
    _, ids = _prefill(dtype)
    kv = dict(_kv(dtype))
    values = kv["layers.1.key"].clone()
    values[20, 1, 3], values[41, 0, 7] = 0.0, float("nan")
    kv["layers.1.key"] = values
    golden = tmp_path / "golden.safetensors"
    check_golden(kv, golden, token_ids=ids, compression=compression)
    assert check_golden(kv, golden, token_ids=ids).status == "matched"
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[dtype]
    top = {torch.bfloat16: -(1 << 15), torch.float32: -(1 << 31)}[dtype]
    for index, flip, shown in (
        ((20, 1, 3), top, "token 20, head 1, channel 3"),  # the sign of a zero
        ((41, 0, 7), 1, "token 41, head 0, channel 7"),  # a NaN's lowest payload bit
    ):
        changed = dict(kv)
        changed["layers.1.key"] = values.clone()
        changed["layers.1.key"].view(bits)[index] ^= flip
        result = check_golden(changed, golden, token_ids=ids)
        assert result.status == "mismatch", shown
        assert (
            "bits differ where the values compare equal (a zero's sign or a NaN's payload): "
            f"layers.1.key, sequence seq-0, {shown}" in " ".join(result.report.split())
        )
    # A tolerance compares values: the same change is then within it.
    assert check_golden(changed, golden, token_ids=ids, atol=1e-9).status == "matched"


def test_a_plain_golden_file_still_reads_and_update_re_encodes_it(tmp_path: Path) -> None:
    kv = _kv(torch.bfloat16)
    golden = tmp_path / "golden.safetensors"
    check_golden(kv, golden)
    plain_bytes = golden.read_bytes()
    # Asking for lossless without --kvsnap-update compares the plain file and leaves it.
    assert check_golden(kv, golden, compression="lossless").status == "matched"
    assert golden.read_bytes() == plain_bytes
    # With update, the equal file is re-encoded, and then matches as it is.
    result = check_golden(kv, golden, update=True, compression="lossless")
    assert result.status == "updated"
    assert "stored as none, rewritten as lossless" in result.report
    assert stored_compression(golden) == "lossless"
    lossless_bytes = golden.read_bytes()
    assert len(lossless_bytes) < len(plain_bytes)
    assert check_golden(kv, golden, update=True, compression="lossless").status == "matched"
    assert check_golden(kv, golden, update=True).status == "matched"
    assert golden.read_bytes() == lossless_bytes  # untouched
    # A change rewritten in update mode keeps the file's encoding when none is asked for.
    changed = dict(kv)
    changed["layers.0.key"] = _flip_lowest_bit(kv["layers.0.key"], (3, 0, 0))
    assert check_golden(changed, golden, update=True).status == "updated"
    assert stored_compression(golden) == "lossless"
    # Golden files are reproducible: the same KV gives the same lossless bytes.
    assert check_golden(kv, golden, update=True).status == "updated"
    assert golden.read_bytes() == lossless_bytes
    # And back to plain when asked.
    assert check_golden(kv, golden, update=True, compression="none").status == "updated"
    assert golden.read_bytes() == plain_bytes


def test_golden_files_are_stored_exactly_or_not_at_all(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="golden compression 'fp8': one of none, lossless"):
        check_golden(_kv(torch.bfloat16), tmp_path / "g.safetensors", compression="fp8")
    assert not (tmp_path / "g.safetensors").exists()
