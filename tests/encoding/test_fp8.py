"""fp8 e4m3 with per-(block, head) scales: the quantizer against an independent numpy one, every
code's decoding against its definition, the scale rules (zero, NaN, infinite, tiny and huge
heads, a partly filled block's tail), the baselines' granularities, and refused scales."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsnap.encoding import fp8
from kvsnap.errors import SnapshotCorruptError
from tests.support.prefill_kv import built_in_kv


def _e4m3_value(codes: np.ndarray) -> np.ndarray:
    """What each e4m3fn code means, from the format's definition (bias 7, no infinity)."""
    codes = codes.astype(np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent, mantissa = (codes >> 3) & 0xF, codes & 0x7
    value = np.where(
        exponent == 0,
        mantissa / 8.0 * 2.0**-6,
        (1 + mantissa / 8.0) * np.exp2(exponent - 7.0),
    )
    value = np.where((codes & 0x7F) == 0x7F, np.nan, value)
    return sign * value


def _round_to_e4m3(values: np.ndarray) -> np.ndarray:
    """``values`` (|v| <= 448 or NaN) rounded to the nearest e4m3 value, ties to even."""
    magnitude = np.abs(values)
    with np.errstate(divide="ignore", invalid="ignore"):
        exponent = np.floor(np.log2(np.where(magnitude > 0, magnitude, 1.0)))
    spacing = np.exp2(np.maximum(exponent, -6.0) - 3.0)  # subnormals: 2**-9
    return np.sign(values) * np.rint(magnitude / spacing) * spacing


def _to_cache_dtype(values: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """fp32 ``values`` rounded to nearest even into ``dtype``, back as float64."""
    if dtype == torch.float16:
        return values.astype(np.float16).astype(np.float64)
    if dtype == torch.bfloat16:
        bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return rounded.astype(np.uint32).view(np.float32).astype(np.float64)
    return values.astype(np.float64)


def _numpy_candidates(pages: np.ndarray, dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
    """An independent quantizer's candidate scales ``(candidates, blocks, heads)`` (float64
    except where fp32 is the rule) and the squared error of each, summed in float64."""
    x = pages.astype(np.float32)
    finite = np.isfinite(x)
    magnitude = np.where(finite, np.abs(x), 0.0).astype(np.float32)
    amax = magnitude.max(axis=(1, 3))
    base = np.where(amax > 0, np.maximum(amax / np.float32(448), np.float32(2.0**-126)), 1.0)
    base = base.astype(np.float32)
    scales, errors = [], []
    for factor in (1.0, 4.0 / 3.0, 15.0 / 8.0):
        scale = np.where(amax > 0, base * np.float32(factor), base).astype(np.float32)
        codes = _round_to_e4m3(np.clip(x / scale[:, None, :, None], -448, 448).astype(np.float64))
        product = (codes * scale[:, None, :, None].astype(np.float64)).astype(np.float32)
        error = np.where(finite, _to_cache_dtype(product, dtype) - x, 0.0)
        scales.append(scale)
        errors.append(np.square(error).sum(axis=(1, 3)))
    return np.stack(scales), np.stack(errors)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_quantizer_matches_an_independent_one_on_real_kv(dtype):
    chose_another = heads = 0
    for name, pages in built_in_kv(256, dtype).items():
        quantized = fp8.quantize(pages)
        scales = quantized.scales.numpy()
        candidates, errors = _numpy_candidates(pages.float().numpy(), dtype)
        # Each scale is a candidate, and its error the least of them (but for the rounding
        # of the sums: kvsnap adds fp32 in a fixed order, this float64).
        chosen = candidates == scales[None]
        assert chosen.any(axis=0).all(), name
        error = np.where(chosen, errors, np.inf).min(axis=0)
        assert (error <= errors.min(axis=0) * (1 + 1e-5) + 1e-30).all(), name
        chose_another += int((scales != candidates[0]).sum())
        heads += scales.size
        # The values are those scales' e4m3 roundings.
        scaled = np.clip(pages.float().numpy() / scales[:, None, :, None], -448, 448)
        want_values = _round_to_e4m3(scaled.astype(np.float64))
        got = _e4m3_value(quantized.values.numpy())
        np.testing.assert_array_equal(got, want_values, err_msg=name)
    # On real KV many (block, head)s round better at another scale than amax / 448.
    assert chose_another > heads / 3, (chose_another, heads)


@pytest.mark.parametrize("blocks_at_once", [1, 3, 7])
def test_candidates_tried_a_few_blocks_at_a_time_choose_as_all_at_once(monkeypatch, blocks_at_once):
    pages = next(iter(built_in_kv(256, torch.bfloat16).values()))
    counts = torch.randint(
        0, pages.shape[1] + 1, (pages.shape[0],), generator=torch.Generator().manual_seed(3)
    )
    whole = fp8.quantize(pages, token_counts=counts)
    per_block = pages[0].numel() * len(fp8.SCALE_FACTORS)
    monkeypatch.setattr(fp8, "CANDIDATE_ELEMENTS", blocks_at_once * per_block)
    stepped = fp8.quantize(pages, token_counts=counts)
    assert torch.equal(stepped.scales, whole.scales)
    assert torch.equal(stepped.values, whole.values)


def test_every_code_decodes_as_its_definition_times_the_scale():
    codes = torch.arange(256, dtype=torch.uint8).reshape(1, 8, 1, 32)
    for scale in (1.0, 2.0**-126, 0.37, 2.0**100, 3.0e38):
        scales = torch.full((1, 1), scale, dtype=torch.float32)
        with np.errstate(over="ignore"):  # the fp32 product of 448 and 3e38 is infinite
            # The exact product, rounded once to fp32: the fp32 product by definition.
            want = (_e4m3_value(codes.numpy()) * np.float64(np.float32(scale))).astype(np.float32)
        decoded = fp8.dequantize(codes, scales, torch.float32).numpy()
        finite = ~np.isnan(want)
        np.testing.assert_array_equal(decoded[finite], want[finite])
        assert np.isnan(decoded[~finite]).all()
        for dtype, nan_bits in fp8.CANONICAL_NAN_BITS.items():
            bits = fp8.dequantize(codes, scales, dtype).view(
                torch.int32 if dtype == torch.float32 else torch.int16
            )
            assert (bits.numpy()[~finite] == nan_bits).all()  # 0x7f and 0xff alike


def test_zero_nan_and_infinite_heads_get_safe_scales():
    pages = torch.randn(3, 4, 4, 8, generator=torch.Generator().manual_seed(0))
    pages[0, :, 0] = 0  # an all-zero head
    pages[1, :, 1] = float("nan")  # an all-NaN head
    pages[2, 0, 2, 0], pages[2, 1, 2, 0] = float("inf"), float("-inf")
    pages[2, 2, 2, 1] = float("nan")
    quantized = fp8.quantize(pages)
    scales, values = quantized.scales, quantized.values
    assert torch.isfinite(scales).all() and (scales >= fp8.MIN_SCALE).all()
    assert scales[0, 0] == 1 and scales[1, 1] == 1
    assert (values[0, :, 0] == 0).all()
    assert ((values[1, :, 1] & 0x7F) == 0x7F).all()  # NaN stays NaN
    # The infinities saturate to +-448 of a scale set by the finite values.
    finite = torch.isfinite(pages[2, :, 2])
    assert scales[2, 2] == pages[2, :, 2][finite].abs().max() / 448
    assert values[2, 0, 2, 0] == 0x7E and values[2, 1, 2, 0] == 0xFE
    assert (values[2, 2, 2, 1] & 0x7F) == 0x7F
    fp8.check_scales(scales)


def test_scales_stay_normal_and_finite_at_the_ends_of_fp32():
    pages = torch.zeros(2, 2, 1, 4, dtype=torch.float32)
    pages[0, 0, 0, 0] = 1e-42  # subnormal fp32: amax / 448 would underflow
    pages[1, 0, 0, 0] = 3.0e38
    quantized = fp8.quantize(pages)
    assert quantized.scales[0, 0] == fp8.MIN_SCALE
    assert torch.isfinite(quantized.scales).all()
    decoded = fp8.dequantize(quantized.values, quantized.scales, torch.float32)
    assert decoded[1, 0, 0, 0] / pages[1, 0, 0, 0] == pytest.approx(1, rel=1 / 16)
    fp8.check_scales(quantized.scales)


def test_a_partly_filled_blocks_tail_does_not_set_its_scale():
    pages = torch.randn(2, 4, 2, 8, generator=torch.Generator().manual_seed(1))
    pages[1, 3] = 1000.0  # the last token of block 1 is left over from a previous request
    counts = torch.tensor([4, 3])
    quantized = fp8.quantize(pages, token_counts=counts)
    assert quantized.scales[1].max() < 1.0  # set by the three stored tokens
    base = pages[1, :3].abs().amax(dim=(0, 2)) / 448
    candidates = torch.stack([base * torch.full_like(base, f) for f in fp8.SCALE_FACTORS])
    assert (quantized.scales[1][None] == candidates).any(dim=0).all()
    # Nor does it weigh in the choice of the candidate.
    cleared = pages.clone()
    cleared[1, 3] = 0.0
    assert torch.equal(quantized.scales, fp8.quantize(cleared, token_counts=counts).scales)
    assert torch.equal(quantized.scales[0], fp8.quantize(pages[:1]).scales[0])


def test_head_and_tensor_granularities_share_scales_as_named():
    pages = torch.randn(4, 4, 3, 8, generator=torch.Generator().manual_seed(2))
    pages[2] *= 50
    per_head = fp8.quantize(pages, granularity="head").scales
    per_tensor = fp8.quantize(pages, granularity="tensor").scales
    assert (per_head == per_head[0]).all() and not (per_head[0] == per_head[0, 0]).all()
    assert (per_tensor == per_tensor[0, 0]).all()
    assert per_tensor[0, 0] == pages.abs().max() / 448
    with pytest.raises(ValueError, match="granularity"):
        fp8.quantize(pages, granularity="token")


def test_mla_pages_are_one_head():
    latent = torch.randn(3, 4, 24, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(4))
    quantized = fp8.quantize(latent)
    assert quantized.values.shape == latent.shape and quantized.scales.shape == (3, 1)
    decoded = fp8.dequantize(quantized.values, quantized.scales, torch.bfloat16)
    assert decoded.shape == latent.shape
    error = (decoded.float() - latent.float()).abs().amax()
    assert error <= 18 / 448 * latent.float().abs().amax()


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (float("nan"), "is nan"),
        (0.0, "is 0 "),
        (-1.0, "is -1 "),
        (float("inf"), "is inf"),
        (1e-40, "is 9.99995e-41"),
    ],
)
def test_scales_a_quantizer_cannot_write_are_refused_by_block_and_head(value, words):
    scales = torch.ones(5, 3)
    scales[3, 2] = value
    with pytest.raises(SnapshotCorruptError, match=words) as raised:
        fp8.check_scales(scales, tensor="layers.1.value")
    assert raised.value.block == 3 and "head 2" in str(raised.value)
    assert raised.value.tensor == "layers.1.value"
    with pytest.raises(SnapshotCorruptError, match=r"fp8 scales of torch\.float16"):
        fp8.check_scales(torch.ones(5, 3, dtype=torch.float16))


def test_only_float_pages_quantize_and_decode():
    with pytest.raises(ValueError, match="bfloat16, float16 or float32"):
        fp8.quantize(torch.zeros(1, 2, 1, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="decode to bfloat16"):
        fp8.dequantize(torch.zeros(1, 2, 1, 4, dtype=torch.uint8), torch.ones(1, 1), torch.int8)


@pytest.mark.gpu
def test_cuda_quantizes_and_decodes_exactly_as_the_cpu():
    for name, pages in built_in_kv(256, torch.bfloat16).items():
        on_cpu = fp8.quantize(pages)
        on_cuda = fp8.quantize(pages.cuda())
        assert torch.equal(on_cuda.values.cpu(), on_cpu.values), name
        assert torch.equal(on_cuda.scales.cpu(), on_cpu.scales), name
        decoded = fp8.dequantize(on_cuda.values, on_cuda.scales, torch.bfloat16).cpu()
        want = fp8.dequantize(on_cpu.values, on_cpu.scales, torch.bfloat16)
        assert torch.equal(decoded.view(torch.int16), want.view(torch.int16)), name
