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


def _numpy_quantize(pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An independent quantizer (float64 except where fp32 is the rule): e4m3 values, scales."""
    x = pages.astype(np.float32)
    magnitude = np.where(np.isfinite(x), np.abs(x), 0.0).astype(np.float32)
    amax = magnitude.max(axis=(1, 3))
    scales = np.where(amax > 0, np.maximum(amax / np.float32(448), np.float32(2.0**-126)), 1.0)
    scales = scales.astype(np.float32)
    scaled = np.clip(x / scales[:, None, :, None], -448, 448)
    return _round_to_e4m3(scaled.astype(np.float64)), scales


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_quantizer_matches_an_independent_one_on_real_kv(dtype):
    for name, pages in built_in_kv(256, dtype).items():
        quantized = fp8.quantize(pages)
        want_values, want_scales = _numpy_quantize(pages.float().numpy())
        np.testing.assert_array_equal(quantized.scales.numpy(), want_scales, err_msg=name)
        got = _e4m3_value(quantized.values.numpy())
        np.testing.assert_array_equal(got, want_values, err_msg=name)


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
    assert quantized.scales[1].max() == pages[1, :3].abs().amax(dim=(0, 2)).max() / 448
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
