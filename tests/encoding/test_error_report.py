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
