"""fp8 e4m3 pages with one fp32 scale per (block, head): quantized where the KV lies, and the
host twin of the device's dequantization.

A layer tensor of pages ``(num_blocks, block_size, num_heads, head_dim)`` (an MLA tensor
``(num_blocks, block_size, latent_dim)`` is one head of ``latent_dim``) becomes

* ``values``: ``uint8`` of the same shape, each the bits of a ``float8_e4m3fn``;
* ``scales``: ``float32`` ``(num_blocks, num_heads)``;

with ``value = e4m3(values) * scale``. Quantizing, in fp32:

1. ``amax`` of each (block, head) over its tokens and dims, finite elements only (and, given
   ``token_counts``, only a block's first ``token_counts[b]`` tokens: the rest of a partly
   filled block is whatever its previous user left);
2. ``base = max(amax / 448, 2**-126)`` where ``amax > 0``, else ``1`` (an all-zero, or
   all-non-finite, head of a block): never zero, never NaN or infinite, never subnormal;
3. ``scale``: of the candidates ``base * f`` for ``f`` in :data:`SCALE_FACTORS` (``base``
   itself where ``amax`` is 0), the one whose decoded values (step 4, then the decoding below)
   are nearest the originals: the least sum of squared errors over the (block, head)'s finite
   elements of the tokens kept, summed in fp32 in a fixed order (so every device chooses the
   same), the first candidate on a tie (a sum past fp32's range, as errors of 2**64 and more
   give, is infinite: a tie);
4. ``values = e4m3(clamp(x / scale, -448, 448))``, rounded to nearest even. NaN stays NaN
   (the code ``0x7f``/``0xff``); an infinity becomes ``±448`` (``0x7e``/``0xfe``), which
   decodes to ``±448 * scale``, the block's largest finite magnitude or more (e4m3fn has no
   infinity; infinite again only where that passes the cache dtype's range); the error
   report counts both (``non_finite``).

Why several candidates: e4m3 rounds a value to 3 mantissa bits, so where a block's values fall
between the grid points depends on the scale's own mantissa; a block whose large values round
badly at ``amax / 448`` may round well at another scale. Choosing the least squared error per
(block, head) lowers the error where it matters most (the largest values), and makes the
rounding errors of values repeated across blocks (a token's layer-0 values, say) differ from
block to block, so that attention, which averages them, cancels more of them
(docs/benchmarks.md, "Encodings"). It costs one quantization and decoding pass per candidate.

``granularity`` ``"head"`` (one scale per head over the whole tensor, vLLM's per-head scales)
and ``"tensor"`` (one scale per tensor) exist to measure the baselines: ``amax / 448`` of what
shares the scale, no candidates; their scales are laid out the same way, so everything
downstream is the same.

Dequantizing (:func:`dequantize`, and the device kernel :mod:`kvsnap.transfer.page_dequant`,
bit-identical): ``e4m3 -> fp32`` (exact), times the scale in fp32 (rounded to nearest even),
then to the cache's dtype rounded to nearest even; any NaN becomes the dtype's canonical quiet
NaN (:data:`CANONICAL_NAN_BITS`), whatever its sign and payload.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvsnap.encoding.fp8_scales import MIN_SCALE, check_scale_table
from kvsnap.errors import SnapshotCorruptError

#: The largest finite e4m3fn magnitude.
FP8_MAX = 448.0
#: The name recorded for this encoding.
NAME = "kvsnap-fp8-e4m3-v1"
#: How many values share a scale.
GRANULARITIES = ("block-head", "head", "tensor")
#: Bits every NaN decodes to, per cache dtype (a positive quiet NaN).
CANONICAL_NAN_BITS = {torch.bfloat16: 0x7FC0, torch.float16: 0x7E00, torch.float32: 0x7FC00000}
#: Cache dtypes fp8 pages decode into.
DECODED_DTYPES = tuple(CANONICAL_NAN_BITS)
#: Integer views of those dtypes, for writing NaN bits.
_BITS_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
#: Candidate scales of a (block, head), as factors of ``amax / 448``: its largest magnitude
#: scaled to 448, 336 and 238.9. Each keeps the error of every element under 1/16 of the
#: block's largest magnitude: at most half a step of 32 over 336 (4.8%), plus the cache dtype's
#: own rounding of the decoded value (bf16: 0.4%).
SCALE_FACTORS = (1.0, 4.0 / 3.0, 15.0 / 8.0)
#: About how many elements the quantizer's candidates are tried on at once (the pages of
#: that many blocks times candidates, in fp32, a few times over: bounded device memory).
CANDIDATE_ELEMENTS = 1 << 25


@dataclass(frozen=True)
class Fp8Pages:
    """Quantized pages: ``values`` (``uint8``, e4m3fn bits, the pages' shape) and ``scales``
    (``float32``, ``(num_blocks, num_heads)``), on the device of the pages they came from."""

    values: torch.Tensor
    scales: torch.Tensor

    @property
    def stored_bytes(self) -> int:
        return self.values.numel() + 4 * self.scales.numel()


def as_heads(pages: torch.Tensor) -> torch.Tensor:
    """``pages`` as ``(num_blocks, block_size, num_heads, head_dim)``: an MLA tensor
    ``(num_blocks, block_size, latent_dim)`` as one head."""
    if pages.dim() == 3:
        return pages.unsqueeze(2)
    if pages.dim() != 4:
        raise ValueError(f"pages of shape {tuple(pages.shape)}: expected 3 or 4 dimensions")
    return pages


def token_mask(
    token_counts: torch.Tensor | None, num_blocks: int, block_size: int, device: torch.device
) -> torch.Tensor | None:
    """``(num_blocks, block_size)`` booleans: the first ``token_counts[b]`` tokens of block
    ``b`` (every token when ``token_counts`` is ``None``)."""
    if token_counts is None:
        return None
    counts = torch.as_tensor(token_counts, device=device).reshape(num_blocks, 1)
    return torch.arange(block_size, device=device)[None, :] < counts


def block_head_amax(
    pages: torch.Tensor, token_counts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(amax, x)``: the largest finite magnitude of each (block, head) of ``pages`` (4-D),
    over the tokens ``token_counts`` keeps, and the pages in fp32."""
    x = pages.float()
    magnitude = torch.where(torch.isfinite(x), x.abs(), 0.0)
    mask = token_mask(token_counts, x.shape[0], x.shape[1], x.device)
    if mask is not None:
        magnitude = magnitude * mask[:, :, None, None]
    return magnitude.amax(dim=(1, 3)), x


def scales_for(amax: torch.Tensor, granularity: str = "block-head") -> torch.Tensor:
    """The scales of a ``(num_blocks, num_heads)`` amax at ``granularity``, same shape."""
    if granularity == "head":
        amax = amax.amax(dim=0, keepdim=True).expand_as(amax)
    elif granularity == "tensor":
        amax = amax.amax().expand_as(amax)
    elif granularity != "block-head":
        raise ValueError(f"granularity {granularity!r}: one of {', '.join(GRANULARITIES)}")
    # A true division on every device: torch on CUDA turns a division by a Python number into
    # a multiplication by its rounded reciprocal, one ulp off the CPU's quotient at times.
    scale = torch.clamp(amax / torch.full_like(amax, FP8_MAX), min=MIN_SCALE)
    return torch.where(amax > 0, scale, torch.ones_like(scale)).contiguous()


def _codes(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The e4m3 values of fp32 pages ``x`` (4-D) with ``scales`` ``(blocks, heads)``."""
    return torch.clamp(x / scales[:, None, :, None], -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _ordered_sums(squares: torch.Tensor) -> torch.Tensor:
    """``(blocks, heads)`` sums of fp32 ``squares`` ``(blocks, tokens, heads, dim)``, added
    pairwise in a fixed order (halves, then halves of those): elementwise additions only, so
    every device adds the same numbers in the same order and gets the same bits (a reduction
    kernel's order differs between devices)."""
    rows = squares.permute(0, 2, 1, 3).reshape(squares.shape[0], squares.shape[2], -1)
    while rows.shape[-1] > 1:
        if rows.shape[-1] % 2:
            rows = torch.cat([rows, rows.new_zeros((*rows.shape[:-1], 1))], dim=-1)
        half = rows.shape[-1] // 2
        rows = rows[..., :half] + rows[..., half:]
    return rows[..., 0] if rows.shape[-1] else rows.new_zeros(rows.shape[:-1])


def nearest_scales(
    x: torch.Tensor,
    amax: torch.Tensor,
    dtype: torch.dtype,
    token_counts: torch.Tensor | None = None,
    factors: tuple[float, ...] | None = None,
) -> torch.Tensor:
    """Per (block, head) of fp32 pages ``x`` (4-D; ``amax`` their :func:`block_head_amax`),
    the candidate scale (``amax / 448`` times each of ``factors``, default
    :data:`SCALE_FACTORS`) whose values decoded to ``dtype`` have the least sum of squared
    errors over the finite elements of the tokens kept (the first candidate on a tie)."""
    base = scales_for(amax)
    if factors is None:
        factors = SCALE_FACTORS
    if tuple(factors) == (1.0,):
        return base
    kept = torch.isfinite(x)
    mask = token_mask(token_counts, x.shape[0], x.shape[1], x.device)
    if mask is not None:
        kept &= mask[:, :, None, None]
    candidates = torch.stack(
        [torch.where(amax > 0, base * torch.full_like(base, factor), base) for factor in factors]
    )
    # Every candidate at once (a few kernels, not a few per candidate), over as many blocks
    # at a time as keep the stacked pages near CANDIDATE_ELEMENTS: each (block, head) is
    # computed alone, so the numbers are those of one candidate and one block at a time.
    block_elements = max(x[0].numel(), 1) * len(factors)
    step = max(1, CANDIDATE_ELEMENTS // block_elements)
    errors = torch.cat(
        [
            _candidate_errors(
                x[first : first + step],
                kept[first : first + step],
                candidates[:, first : first + step],
                dtype,
            )
            for first in range(0, x.shape[0], step)
        ],
        dim=1,
    )
    best, best_error = candidates[0], errors[0]
    for candidate, error in zip(candidates[1:], errors[1:], strict=True):
        better = error < best_error
        best = torch.where(better, candidate, best)
        best_error = torch.where(better, error, best_error)
    return best.contiguous()


def _candidate_errors(
    x: torch.Tensor, kept: torch.Tensor, candidates: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``(candidates, blocks, heads)`` sums of squared errors of fp32 pages ``x`` (4-D)
    quantized with each of ``candidates`` ``(candidates, blocks, heads)`` and decoded to
    ``dtype``, over the elements ``kept``."""
    scales = candidates[:, :, None, :, None]
    codes = torch.clamp(x / scales, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    decoded = (codes.float() * scales).to(dtype).float()
    squares = torch.where(kept, decoded - x, 0.0).square()
    sums = _ordered_sums(squares.reshape(-1, *squares.shape[2:]))
    return sums.reshape(candidates.shape)


def quantize(
    pages: torch.Tensor,
    *,
    granularity: str = "block-head",
    token_counts: torch.Tensor | None = None,
    scale_factors: tuple[float, ...] | None = None,
) -> Fp8Pages:
    """Quantize a layer tensor of pages (bf16, fp16 or fp32; 3-D MLA or 4-D) on its own
    device (torch ops only: CPU and CUDA alike, nothing leaves the device). ``scale_factors``
    (per (block, head) only; default :data:`SCALE_FACTORS`) are the candidate scales as
    factors of ``amax / 448``: ``(1.0,)`` is ``amax / 448`` alone, the quantizer's first
    rule, kept for comparisons."""
    if pages.dtype not in DECODED_DTYPES:
        raise ValueError(f"fp8 quantizes bfloat16, float16 or float32 pages, not {pages.dtype}")
    heads = as_heads(pages)
    amax, x = block_head_amax(heads, token_counts)
    if granularity == "block-head":
        scales = nearest_scales(x, amax, pages.dtype, token_counts, scale_factors)
    else:
        scales = scales_for(amax, granularity)
    values = _codes(x, scales).view(torch.uint8).reshape(pages.shape)
    return Fp8Pages(values, scales)


def check_scales(scales: torch.Tensor, tensor: str | None = None) -> None:
    """Refuse (``SnapshotCorruptError``) scales a quantizer cannot have written: not fp32,
    not 2-D, or any that is not a finite number of at least :data:`MIN_SCALE`
    (:func:`kvsnap.encoding.fp8_scales.check_scale_table`)."""
    if scales.dtype != torch.float32 or scales.dim() != 2:
        raise SnapshotCorruptError(
            f"fp8 scales of {scales.dtype} {tuple(scales.shape)}", tensor=tensor
        )
    check_scale_table(scales.detach().cpu().numpy(), tensor)


def dequantize(
    values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """The pages ``values`` (``uint8`` e4m3fn bits, 3-D or 4-D) times ``scales``, in ``dtype``:
    the host twin of the device kernel, bit for bit (NaNs canonical)."""
    if dtype not in DECODED_DTYPES:
        raise ValueError(f"fp8 pages decode to bfloat16, float16 or float32, not {dtype}")
    heads = as_heads(values)
    decoded = heads.view(torch.float8_e4m3fn).float() * scales[:, None, :, None]
    bits = decoded.to(dtype).view(_BITS_VIEW[dtype])
    canonical = torch.tensor(CANONICAL_NAN_BITS[dtype], dtype=bits.dtype, device=bits.device)
    bits = torch.where(torch.isnan(decoded), canonical, bits)
    return bits.view(dtype).reshape(values.shape)
