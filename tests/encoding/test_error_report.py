"""The error report: every measurement against an independent float64 numpy recomputation, the
attention check against its definition, the fp8 bounds on the built-in model's real KV (and the
per-tensor baseline doing worse), and the JSON form read back strictly."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from kvsnap.encoding import fp8, measure
from kvsnap.encoding.report import AttentionError, ErrorBounds, ErrorReport, TensorError
from tests.support.independent_error import numpy_tensor_error
from tests.support.prefill_kv import built_in_kv


def test_tensor_error_matches_its_definition():
    generator = torch.Generator().manual_seed(0)
    original = torch.randn(5, 4, 3, 8, generator=generator)
    original[1, :, 2] = 0  # a zero head: no cosine
    original[2, 0, 0, :4] = 1e-30  # underflows in fp8 next to large values of its block
    original[2, 0, 1, 0] = 40.0
    original[3, 1, 0, 0] = float("nan")
    decoded = original + 0.01 * torch.randn(5, 4, 3, 8, generator=generator)
    decoded[2, 0, 0, :4] = 0
    decoded[4, 2, 1, 3] = float("inf")
    decoded[4, 3] = 1e6  # past the token count of block 4: left out
    counts = torch.tensor([4, 4, 4, 4, 3])
    got = measure.tensor_error("layers.0.key", original, decoded, counts)
    want = numpy_tensor_error(original.numpy(), decoded.numpy(), counts.numpy())
    assert got.non_finite == want["non_finite"] == 2
    assert got.values == want["values"]
    assert got.underflow_share == pytest.approx(want["underflow_share"]) and got.underflow_share > 0
    for name in ("max_abs", "max_abs_rel_block", "rms_rel", "min_cosine", "mean_cosine"):
        assert getattr(got, name) == pytest.approx(want[name], rel=1e-6), name


def _random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Pages of random bits: every finite magnitude of ``dtype`` (bf16: up to 3.4e38), and
    infinities and NaNs."""
    generator = torch.Generator().manual_seed(seed)
    count = math.prod(shape) * torch.finfo(dtype).bits // 8
    raw = torch.randint(0, 256, (count,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_tensor_error_of_pages_of_every_magnitude_is_finite_and_its_definition(dtype):
    # In fp32 the squares of bf16 values past 2**64 overflow: RMS error and cosines were NaN.
    original = _random_bits((6, 16, 2, 32), dtype, seed=1)
    quantized = fp8.quantize(original)
    decoded = fp8.dequantize(quantized.values, quantized.scales, dtype)
    counts = torch.tensor([16, 16, 3, 16, 9, 16])
    got = measure.tensor_error("layers.0.key", original, decoded, counts)
    want = numpy_tensor_error(original.double().numpy(), decoded.double().numpy(), counts.numpy())
    assert got.non_finite == want["non_finite"] > 0 and got.values == want["values"]
    for name in ("max_abs", "max_abs_rel_block", "rms_rel", "min_cosine", "mean_cosine"):
        assert math.isfinite(getattr(got, name)), name
        assert getattr(got, name) == pytest.approx(want[name], rel=1e-9, abs=1e-12), name
    assert got.underflow_share == pytest.approx(want["underflow_share"])


def test_pages_are_measured_a_few_blocks_at_a_time_as_all_at_once(monkeypatch):
    kv = dict(built_in_kv(256, torch.bfloat16))  # a copy: the prefill's KV is shared
    kv["layers.1.key"] = _random_bits(tuple(kv["layers.1.key"].shape), torch.bfloat16, seed=2)
    decoded = {
        name: fp8.dequantize(*_quantized(pages), torch.bfloat16) for name, pages in kv.items()
    }
    counts = torch.randint(
        1, 17, (next(iter(kv.values())).shape[0],), generator=torch.Generator().manual_seed(4)
    )
    whole = measure.error_report(
        kv, decoded, encoding=fp8.NAME, granularity="block-head", token_counts=counts
    )
    per_block = next(iter(kv.values()))[0].numel() * len(kv)  # every tensor is of one shape
    for blocks in (1, 3):
        monkeypatch.setattr(measure, "MEASURE_ELEMENTS", blocks * per_block)
        stepped = measure.error_report(
            kv, decoded, encoding=fp8.NAME, granularity="block-head", token_counts=counts
        )
        for one, other in zip(whole.tensors, stepped.tensors, strict=True):
            assert (one.values, one.non_finite) == (other.values, other.non_finite)
            for name in ("max_abs", "max_abs_rel_block", "rms_rel", "min_cosine", "mean_cosine"):
                assert getattr(other, name) == pytest.approx(getattr(one, name), rel=1e-12)
        assert stepped.attention == whole.attention


def test_identical_pages_have_no_error():
    pages = built_in_kv(256, torch.bfloat16)["layers.0.value"]
    got = measure.tensor_error("layers.0.value", pages, pages.clone())
    assert (got.max_abs, got.max_abs_rel_block, got.rms_rel, got.underflow_share) == (0, 0, 0, 0)
    assert got.min_cosine == pytest.approx(1) and got.non_finite == 0
    assert got.values == pages.numel()


def _numpy_attention(queries, keys, values) -> np.ndarray:
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (queries, keys, values))
    out = np.empty((q.shape[1], q.shape[0], v.shape[-1]))
    for head in range(q.shape[1]):
        scores = q[:, head] @ k[:, head].T / math.sqrt(k.shape[-1])
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        weights /= weights.sum(axis=1, keepdims=True)
        out[head] = weights @ v[:, head]
    return out


@pytest.mark.parametrize("source", ["keys", "gaussian"])
def test_the_attention_check_is_softmax_attention_on_both_sides(source):
    kv = built_in_kv(256, torch.bfloat16)
    original = {"key": kv["layers.2.key"], "value": kv["layers.2.value"]}
    decoded = {
        part: fp8.dequantize(*_quantized(pages), torch.bfloat16) for part, pages in original.items()
    }
    got = measure.attention_error(2, original, decoded, queries=40, query_source=source, seed=5)
    keys = measure.valid_tokens(original["key"], None)
    queries = measure.draw_queries(keys, 40, source, torch.Generator().manual_seed(5 + 2))
    if source == "keys":  # each query is one of its head's keys
        for head in range(keys.shape[1]):
            assert all((keys[:, head] == q).all(-1).any() for q in queries[:, head])
    want = _numpy_attention(queries, keys, measure.valid_tokens(original["value"], None))
    other = _numpy_attention(
        queries,
        measure.valid_tokens(decoded["key"], None),
        measure.valid_tokens(decoded["value"], None),
    )
    rel_l2 = np.linalg.norm(other - want) / np.linalg.norm(want)
    cosine = (other * want).sum(-1) / np.linalg.norm(other, axis=-1) / np.linalg.norm(want, axis=-1)
    assert got.queries == 40
    assert got.rel_l2 == pytest.approx(rel_l2, rel=1e-3) and 0 < got.rel_l2 < 0.05
    assert got.min_cosine == pytest.approx(cosine.min(), abs=1e-6)
    assert got.mean_cosine == pytest.approx(cosine.mean(), abs=1e-6)


def test_the_attention_check_of_huge_and_non_finite_values_is_finite_and_its_definition():
    # Keys up to 3.4e38: fp32 scores overflow (softmax NaN); float64 holds them. An element not
    # finite in the original or the decoded pages is zero on both sides.
    original = {
        part: _random_bits((8, 16, 2, 32), torch.bfloat16, seed=seed)
        for seed, part in enumerate(("key", "value"), start=3)
    }
    decoded = {part: fp8.dequantize(*_quantized(p), torch.bfloat16) for part, p in original.items()}
    got = measure.attention_error(1, original, decoded, queries=16, seed=5)
    assert all(math.isfinite(v) for v in (got.rel_l2, got.min_cosine, got.mean_cosine))
    tokens = {}
    for part in ("key", "value"):
        x = original[part].double().reshape(-1, 2, 32)
        y = decoded[part].double().reshape(-1, 2, 32)
        kept = torch.isfinite(x) & torch.isfinite(y)
        tokens[part] = (torch.where(kept, x, 0.0), torch.where(kept, y, 0.0))
    queries = measure.draw_queries(tokens["key"][0], 16, "keys", torch.Generator().manual_seed(6))
    want = _numpy_attention(queries, tokens["key"][0], tokens["value"][0])
    other = _numpy_attention(queries, tokens["key"][1], tokens["value"][1])
    assert got.rel_l2 == pytest.approx(np.linalg.norm(other - want) / np.linalg.norm(want))
    norms = np.linalg.norm(other, axis=-1) * np.linalg.norm(want, axis=-1)
    # An output decoded as zero (its token's values underflowed) has cosine 0.
    cosine = np.where(norms > 0, (other * want).sum(-1) / np.where(norms > 0, norms, 1.0), 0.0)
    assert got.min_cosine == pytest.approx(cosine.min(), abs=1e-9)
    assert got.mean_cosine == pytest.approx(cosine.mean(), abs=1e-9)


def test_the_attention_check_leaves_out_a_non_finite_element_on_both_sides():
    # A key's infinity decodes to +-448 of its scale (finite): compared with a zero in the
    # original, it would count as an error of the block's largest magnitude.
    kv = built_in_kv(256, torch.bfloat16)
    original = {part: kv[f"layers.1.{part}"].clone() for part in ("key", "value")}
    original["key"][2, 5, 1, 7] = float("inf")
    original["value"][4, 0, 0, 3] = float("-inf")
    original["value"][6, 1, 1, 0] = float("nan")
    decoded = {part: fp8.dequantize(*_quantized(p), torch.bfloat16) for part, p in original.items()}
    assert torch.isfinite(decoded["key"][2, 5, 1, 7]) and torch.isfinite(
        decoded["value"][4, 0, 0, 3]
    )
    got = measure.attention_error(1, original, decoded, seed=2)
    for pages in (original, decoded):  # the same pages with those elements zero on both sides
        for part, where in (
            ("key", (2, 5, 1, 7)),
            ("value", (4, 0, 0, 3)),
            ("value", (6, 1, 1, 0)),
        ):
            pages[part] = pages[part].clone()
            pages[part][where] = 0
    assert got == measure.attention_error(1, original, decoded, seed=2)


def _quantized(pages: torch.Tensor, granularity: str = "block-head"):
    quantized = fp8.quantize(pages, granularity=granularity)
    return quantized.values, quantized.scales


def _fp8_report(granularity: str) -> ErrorReport:
    kv = built_in_kv(256, torch.bfloat16)
    decoded = {
        name: fp8.dequantize(*_quantized(pages, granularity), torch.bfloat16)
        for name, pages in kv.items()
    }
    return measure.error_report(kv, decoded, encoding=fp8.NAME, granularity=granularity)


def test_fp8_keeps_its_bounds_on_real_kv_and_beats_the_per_tensor_baseline():
    report = _fp8_report("block-head")
    assert len(report.tensors) == 8 and [a.layer for a in report.attention] == [0, 1, 2, 3]
    worst = report.worst
    # e4m3 keeps 3 mantissa bits: half a step of the top binade (16) over the least a block's
    # largest magnitude is scaled to (336, fp8.SCALE_FACTORS), plus bf16's rounding.
    assert worst["max_abs_rel_block"] <= (16 + 336 * 2**-8) / 336
    assert worst["rms_rel"] <= 0.03 and worst["min_cosine"] >= 0.998
    assert worst["non_finite"] == 0
    baseline = _fp8_report("tensor").worst
    assert worst["max_abs_rel_block"] < baseline["max_abs_rel_block"]
    assert worst["attention_rel_l2"] < baseline["attention_rel_l2"]


def test_the_report_survives_json_and_is_read_back_strictly():
    report = _fp8_report("block-head")
    data = json.loads(json.dumps(report.to_dict()))
    again = ErrorReport.from_dict(data)
    assert again.to_dict() == data
    assert again.tensors[3].tensor == "layers.1.value"
    for spoil, words in [
        (lambda d: d.pop("attention"), "missing"),
        (lambda d: d.update(extra=1), "unknown"),
        (lambda d: d["tensors"][0].update(rms_rel=float("nan")), "rms_rel must be finite"),
        (lambda d: d["tensors"][0].update(rms_rel="0.1"), "rms_rel must be a number"),
        (lambda d: d["tensors"][0].update(non_finite=True), "non_finite must be a non-negative"),
        (lambda d: d["tensors"][0].update(non_finite=-1), "non_finite must be a non-negative"),
        (lambda d: d["attention"][0].pop("rel_l2"), "missing"),
        (lambda d: d.update(query_source="random"), "query_source"),
        (lambda d: d.update(tensors={}), "tensors must be a list"),
    ]:
        spoiled = json.loads(json.dumps(data))
        spoil(spoiled)
        with pytest.raises(ValueError, match=words):
            ErrorReport.from_dict(spoiled)


def test_exceeds_names_every_measurement_past_its_bound():
    good = TensorError("layers.0.key", 10, 0.1, 0.03, 0.02, 0.999, 0.9995, 0.0, 0)
    bad = TensorError("layers.0.value", 10, 0.1, 0.07, 0.04, 0.99, 0.995, 0.0, 0)
    report = ErrorReport(
        "x", "block-head", "keys", (good, bad), (AttentionError(0, 48, 0.03, 0.99, 0.999),)
    )
    assert report.exceeds() == [
        "layers.0.value: RMS relative error 0.04",
        "layers.0.value: max error 0.07 of a block's max",
        "layers.0.value: min cosine 0.99",
        "layer 0: attention output off by 0.03",
    ]
    assert report.exceeds(ErrorBounds(0.05, 0.1, 0.9, 0.05)) == []
