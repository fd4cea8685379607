"""fp8 pages dequantized into the cache as they are scattered: one launch per fragment group.

A restore of an fp8 snapshot stages the stored pages (``uint8`` e4m3fn bits, one byte per
element: half the bytes of bf16 over PCIe) and their scales (``float32`` per page and head).
The kernel here is the fused page copy (:mod:`kvsnap.transfer.page_copy`) with the
dequantization inside: each element of a fragment is read as one byte, turned into its value
(``e4m3`` built from its bits, in fp64), multiplied by its page's scale for its head (in fp64:
the product of a 4-bit and a 24-bit significand is exact there, and never subnormal), then
rounded to nearest even to fp32 and from fp32 to the cache's dtype on the integer bits, with
subnormals kept, and written to the cache's address for it. Every NaN is written as the
dtype's canonical quiet NaN. No fp32 arithmetic takes part, so the result does not depend on
whether the compiler flushes fp32 subnormals to zero (an H100 run of 2026-12-06 found the
earlier kernel, which multiplied in fp32, differing from the host on pages whose scales made
subnormal products; tests/transfer/test_page_dequant.py has those cases, and a GPU test of the
8B shape's pages over many program steps that names the first differing element, if any).
:func:`kvsnap.encoding.fp8.dequantize` is its host twin, bit for bit
(tests/transfer/test_page_dequant.py compares them on every code and on scales that make
subnormal and overflowing results).

The copy arrays are the page table's own, built with every staging address 0
(:func:`dequant_copies`): a page's source base is then the byte offset of its first fragment
in the canonical page of the cache's dtype, from which the kernel finds the element, its head
and its byte in the staged fp8 page (``page_starts[slot_page]`` into ``fp8``). So one table
serves every layout the page table does (vLLM split NHD/HND, packed, MLA, cross-layer, a TP
rank's head slice), with the same ``page_ok`` flags and page ranges as the plain copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvsnap.encoding.fp8 import dequantize
from kvsnap.transfer.page_copy import kernel_arrays, kernel_table, run_on_cpu
from kvsnap.transfer.plan import Direction
from kvsnap.transfer.triton_copy import interpreting, kernel_for, tl, triton

if TYPE_CHECKING:
    from kvsnap.transfer.page_table import GroupCopy, PageTable

#: Elements one program handles per step (ROWS x BLOCK).
STEP_ELEMENTS = 4096
#: Elements per step of the exact product's launches. At 1,024 to 4,096 the H100's compiled
#: kernel (Triton 3.6, 2026-12-06) wrote wrong words for every other head of fp32 and bf16
#: pages while the same arithmetic was right alone and at 512 (the test of the 8B shape's
#: pages over many program steps catches it); the exact product is for the rare scales below
#: :data:`FAST_MIN_SCALE`, so its speed matters little.
EXACT_STEP_ELEMENTS = 512
#: Programs per streaming multiprocessor of a launch without a bound.
PROGRAMS_PER_SM = 4
#: Scales from which the fast product is exact (:func:`_fast_fp32`): every launch whose pages'
#: scales are all at least this takes it (a scale is ``amax / 448``: any KV whose blocks reach
#: 2**-108 in magnitude).
FAST_MIN_SCALE = 2.0**-117
#: The kernel's code for each cache dtype, and its element size.
OUT_KINDS = {torch.bfloat16: (0, 2), torch.float16: (1, 2), torch.float32: (2, 4)}

if triton is not None:

    def _dequant_copy_kernel(
        src_bases,
        dst_bases,
        src_offsets,
        dst_offsets,
        slot_pages,
        page_ok,
        fp8,
        page_starts,
        scales,
        num_items,
        num_fragments,
        OUT_KIND: tl.constexpr,
        OUT_BYTES: tl.constexpr,
        FRAGMENT_ELEMENTS: tl.constexpr,
        HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK: tl.constexpr,
        ROWS: tl.constexpr,
        CHECKED: tl.constexpr,
        EXACT: tl.constexpr,
    ):
        """Item ``i`` is fragment ``i % num_fragments`` of page ``i // num_fragments``: its
        elements start at canonical byte ``src_bases[page] + src_offsets[fragment]`` of slot
        page ``slot_pages[page]`` (whose fp8 bytes start at ``fp8 + page_starts[slot_page]``
        and whose scales at ``scales + slot_page * HEADS``) and go to byte address
        ``dst_bases[page] + dst_offsets[fragment]``. With ``CHECKED``, a page whose slot page
        has ``page_ok`` 0 is not written."""
        program = tl.program_id(0)
        num_programs = tl.num_programs(0)
        rows = tl.arange(0, ROWS)
        columns = tl.arange(0, BLOCK)
        for first in range(program * ROWS, num_items, num_programs * ROWS):
            items = first + rows
            live = items < num_items
            page = items // num_fragments
            fragment = items - page * num_fragments
            slot_page = tl.load(slot_pages + page, mask=live, other=0)
            if CHECKED:
                live = live & (tl.load(page_ok + slot_page, mask=live, other=0) != 0)
            element = tl.load(src_bases + page, mask=live, other=0)
            element = (element + tl.load(src_offsets + fragment, mask=live, other=0)) // OUT_BYTES
            dst = tl.load(dst_bases + page, mask=live, other=0)
            dst += tl.load(dst_offsets + fragment, mask=live, other=0)
            source = fp8 + tl.load(page_starts + slot_page, mask=live, other=0)
            scale_row = scales + slot_page * HEADS
            if OUT_BYTES == 4:
                out = dst.to(tl.pointer_type(tl.int32))
            else:
                out = dst.to(tl.pointer_type(tl.int16))
            for start in range(0, FRAGMENT_ELEMENTS, BLOCK):
                offsets = start + columns
                mask = live[:, None] & (offsets[None, :] < FRAGMENT_ELEMENTS)
                elements = element[:, None] + offsets[None, :]
                codes = tl.load(source[:, None] + elements, mask=mask, other=0).to(tl.int32)
                scale = tl.load(scale_row[:, None] + (elements // HEAD_DIM) % HEADS, mask=mask)
                word = _decoded_words(codes, scale, OUT_KIND, EXACT)
                tl.store(out[:, None] + offsets[None, :], word, mask=mask)


def _rne_shift(value, shift):
    """``value`` (non-negative ``int64``) divided by ``2**shift`` (1 to 62), rounded to nearest
    even, in integers: no floating-point operation, so no flush of subnormals can touch it."""
    quotient = value >> shift
    remainder = value - (quotient << shift)
    half = (remainder * 0 + 1) << (shift - 1)
    up = (remainder > half) | ((remainder == half) & ((quotient & 1) == 1))
    return quotient + up.to(tl.int64)


def _exact_fp32(codes, scale):
    """The fp32 bits (``int64``, sign apart) of e4m3 ``codes`` times ``scale``, for any scale a
    file may hold: the product in fp64, where it is exact and normal, rounded to fp32 to nearest
    even on the integers, subnormals kept, overflow to infinity. No fp32 arithmetic takes part,
    so the compiler's denormal mode cannot change it."""
    exponent = (codes >> 3) & 15
    mantissa = codes & 7
    normal = ((exponent.to(tl.int64) + 1016) << 52) | (mantissa.to(tl.int64) << 49)
    magnitude = tl.where(
        exponent == 0,
        mantissa.to(tl.float64) * 0.001953125,  # subnormal: mantissa x 2**-9
        normal.to(tl.float64, bitcast=True),
    )
    product = magnitude * scale.to(tl.float64)
    product_bits = product.to(tl.int64, bitcast=True)
    # product = significand x 2**(power - 52), significand of 53 bits (0 when product is 0).
    power = ((product_bits >> 52) & 2047) - 1023
    significand = (product_bits & 0xFFFFFFFFFFFFF) | 0x10000000000000
    # fp32 keeps 24 bits above 2**-126 and units of 2**-149 below (subnormals).
    unit = tl.maximum(power - 23, -149)
    shift = tl.minimum(unit - power + 52, 62)
    fp32 = _rne_shift(significand, shift) + ((unit + 149) << 23)
    return tl.where(product == 0, 0, tl.minimum(fp32, 0x7F800000))  # overflow: infinity


def _fast_fp32(codes, scale):
    """:func:`_exact_fp32` for scales of at least :data:`FAST_MIN_SCALE`: every product of a
    non-zero code is then a normal fp32 number (at least 2**-9 x 2**-117 = 2**-126), so one
    IEEE fp32 multiplication, rounded to nearest even, gives the same bits, whatever the
    compiler does with subnormals."""
    exponent = (codes >> 3) & 15
    mantissa = codes & 7
    normal = ((exponent + 120) << 23) | (mantissa << 20)
    magnitude = tl.where(
        exponent == 0,
        mantissa.to(tl.float32) * 0.001953125,  # subnormal: mantissa x 2**-9, normal in fp32
        normal.to(tl.float32, bitcast=True),
    )
    return (magnitude * scale).to(tl.int32, bitcast=True).to(tl.int64)


def _decoded_words(codes, scale, OUT_KIND: tl.constexpr, EXACT: tl.constexpr):
    """The cache words of e4m3 ``codes`` (``int32``) times ``scale`` (``float32``, finite and
    normal, as :func:`~kvsnap.encoding.fp8.check_scales` requires): the product rounded to
    fp32 and then to the cache's dtype, each to nearest even with subnormals kept, exactly as
    IEEE arithmetic on the host does it. The product is :func:`_exact_fp32` (``EXACT``) or
    :func:`_fast_fp32` (when every scale of the launch is at least :data:`FAST_MIN_SCALE`);
    every later rounding is done on integers, so the result does not depend on the compiler's
    denormal mode (a GPU flushing fp32 subnormals to zero would otherwise differ from the host
    for the smallest codes times the smallest scales)."""
    if EXACT:
        fp32 = _exact_fp32(codes, scale)
    else:
        fp32 = _fast_fp32(codes, scale)
    sign = ((codes >> 7) & 1).to(tl.int64)
    nan = (codes & 127) == 127  # a finite scale makes no other NaN
    if OUT_KIND == 0:
        bf16 = _rne_shift(fp32, 16) | (sign << 15)
        word = tl.where(nan, 0x7FC0, bf16).to(tl.int16)
    elif OUT_KIND == 1:
        # fp16 keeps 11 bits above 2**-14 and units of 2**-24 below; an fp32 subnormal is 0.
        biased = fp32 >> 23
        unit16 = tl.maximum(biased - 137, -24)
        shift16 = tl.minimum(unit16 - biased + 150, 62)
        fp16 = _rne_shift((fp32 & 0x7FFFFF) | 0x800000, shift16) + ((unit16 + 24) << 10)
        fp16 = tl.where(biased == 0, 0, tl.minimum(fp16, 0x7C00)) | (sign << 15)
        word = tl.where(nan, 0x7E00, fp16).to(tl.int16)
    else:
        word = tl.where(nan, 0x7FC00000, fp32 | (sign << 31)).to(tl.int32)
    return word


#: The kernel's own functions (plain Python under the interpreter, JIT-compiled otherwise).
_HELPERS = (_rne_shift, _exact_fp32, _fast_fp32, _decoded_words)


def dequant_copies(
    table: PageTable, page_tensors: np.ndarray, device_blocks: np.ndarray
) -> list[GroupCopy]:
    """The copies that put slot page ``i`` (tensor ``page_tensors[i]``) into device block
    ``device_blocks[i]``, as the dequantizing kernel reads them (staging addresses 0)."""
    zeros = np.zeros(len(page_tensors), dtype=np.int64)
    return table.copies(Direction.HOST_TO_DEVICE, page_tensors, device_blocks, zeros)


def tile_shape(fragment_elements: int, step: int | None = None) -> tuple[int, int]:
    """``(BLOCK, ROWS)``: ``BLOCK`` elements per fragment row (a power of two covering the
    fragment, at most one step of ``step`` elements, default :data:`STEP_ELEMENTS`),
    ``ROWS`` fragments per step."""
    step = STEP_ELEMENTS if step is None else step
    block = min(1 << max(fragment_elements - 1, 0).bit_length(), step)
    return block, max(1, step // block)


def heads_of(table: PageTable) -> tuple[int, int]:
    """``(heads, head_dim)`` of the table's canonical page (an MLA page: one head)."""
    geometry = table.geometry
    if geometry.is_mla:
        return 1, geometry.latent_dim
    return geometry.num_kv_heads, geometry.head_dim


def launch_dequant(
    copies: Sequence[GroupCopy],
    table: torch.Tensor,
    page_table: PageTable,
    fp8: torch.Tensor,
    page_starts: torch.Tensor,
    scales: torch.Tensor,
    *,
    max_programs: int | None = None,
    page_ok: torch.Tensor | None = None,
    slot_pages: tuple[int, int] | None = None,
    exact: bool = True,
) -> None:
    """Enqueue ``copies`` (:func:`dequant_copies`) on the current stream of the cache's device,
    one launch per group: ``table`` holds their :func:`~kvsnap.transfer.page_copy.kernel_table`
    on the device (on the host under the interpreter), ``fp8`` the staged pages (``uint8``),
    ``page_starts`` each slot page's first byte in it (``int64``), ``scales`` each slot page's
    scales (``float32``, ``(slot pages, heads)``). ``page_ok`` and ``slot_pages`` as for
    :func:`~kvsnap.transfer.page_copy.launch_kernel`. ``exact=False`` (the caller knows
    every scale is at least :data:`FAST_MIN_SCALE`) takes the fp32 product."""
    dtype = page_table.geometry.dtype
    out_kind, out_bytes = OUT_KINDS.get(getattr(torch, dtype), (None, 0))
    if out_kind is None:
        raise ValueError(f"fp8 pages decode into bfloat16, float16 or float32, not {dtype}")
    heads, head_dim = heads_of(page_table)
    if max_programs is None:
        max_programs = PROGRAMS_PER_SM * _multiprocessors(fp8.device)
    position = 0
    for copy in copies:
        views = []
        for values in kernel_arrays([copy]):
            views.append(table[position : position + len(values)])
            position += len(values)
        if slot_pages is not None:
            low, high = np.searchsorted(copy.slot_pages, slot_pages).tolist()
            if low == high:
                continue
            views = [views[0][low:high], views[1][low:high], views[2], views[3], views[4][low:high]]
        fragment_elements = copy.group.fragment_bytes // out_bytes
        block, rows = tile_shape(fragment_elements, EXACT_STEP_ELEMENTS if exact else None)
        num_items = len(views[0]) * copy.group.num_fragments
        grid = (max(1, min(-(-num_items // rows), max_programs)),)
        kernel_for(_dequant_copy_kernel, _HELPERS)[grid](
            *views,
            views[4] if page_ok is None else page_ok,
            fp8,
            page_starts,
            scales,
            num_items,
            copy.group.num_fragments,
            OUT_KIND=out_kind,
            OUT_BYTES=out_bytes,
            FRAGMENT_ELEMENTS=fragment_elements,
            HEADS=heads,
            HEAD_DIM=head_dim,
            BLOCK=block,
            ROWS=rows,
            CHECKED=page_ok is not None,
            EXACT=exact,
        )


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def dequant_scatter(
    page_table: PageTable,
    page_tensors: np.ndarray,
    device_blocks: np.ndarray,
    fp8_pages: torch.Tensor,
    scales: torch.Tensor,
    *,
    page_ok: torch.Tensor | None = None,
    exact: bool | None = None,
) -> None:
    """Dequantize fp8 pages (``uint8``, ``(num_pages, *canonical page shape)``, on the cache's
    device) with their ``scales`` (``float32``, ``(num_pages, heads)``) into the caches of
    ``page_table``: page ``i`` is tensor ``page_tensors[i]``'s block ``device_blocks[i]``.

    On CUDA (and on host memory under ``TRITON_INTERPRET=1``) one kernel launch per fragment
    group; on host memory otherwise, the twin: :func:`kvsnap.encoding.fp8.dequantize` into
    canonical pages, then the page copy's host path. ``exact``: the kernel's product
    (:func:`launch_dequant`); ``None`` chooses by the scales (:func:`needs_exact`)."""
    page_tensors = np.asarray(page_tensors, dtype=np.int64)
    device_blocks = np.asarray(device_blocks, dtype=np.int64)
    num_pages = len(page_tensors)
    elements = int(np.prod(page_table.geometry.canonical_page_shape))
    if fp8_pages.dtype != torch.uint8 or fp8_pages.numel() != num_pages * elements:
        raise ValueError(f"fp8 pages must be uint8, {num_pages} pages of {elements} elements")
    if fp8_pages.device.type == "cpu" and not interpreting():
        _scatter_on_host(page_table, page_tensors, device_blocks, fp8_pages, scales, page_ok)
        return
    copies = dequant_copies(page_table, page_tensors, device_blocks)
    table = torch.from_numpy(kernel_table(copies)).to(fp8_pages.device)
    starts = torch.arange(num_pages, dtype=torch.int64, device=fp8_pages.device) * elements
    launch_dequant(
        copies,
        table,
        page_table,
        fp8_pages.reshape(-1),
        starts,
        scales,
        page_ok=page_ok,
        exact=needs_exact(scales) if exact is None else exact,
    )


def needs_exact(scales: torch.Tensor | np.ndarray) -> bool:
    """Whether a launch over pages with ``scales`` must take the exact product: some scale is
    below :data:`FAST_MIN_SCALE`."""
    if isinstance(scales, torch.Tensor):
        return bool((scales < FAST_MIN_SCALE).any())
    return bool((np.asarray(scales) < FAST_MIN_SCALE).any())


def _scatter_on_host(
    page_table: PageTable,
    page_tensors: np.ndarray,
    device_blocks: np.ndarray,
    fp8_pages: torch.Tensor,
    scales: torch.Tensor,
    page_ok: torch.Tensor | None,
) -> None:
    dtype: Any = getattr(torch, page_table.geometry.dtype)
    shape = (len(page_tensors), *page_table.geometry.canonical_page_shape)
    pages = dequantize(fp8_pages.reshape(shape), scales, dtype).contiguous()
    keep = np.ones(len(page_tensors), dtype=bool) if page_ok is None else page_ok.numpy() != 0
    page_bytes = page_table.page_size_bytes
    staging = pages.data_ptr() + np.arange(len(page_tensors), dtype=np.int64) * page_bytes
    run_on_cpu(
        page_table.copies(
            Direction.HOST_TO_DEVICE, page_tensors[keep], device_blocks[keep], staging[keep]
        )
    )
