"""The dequantizing page scatter: staged fp8 pages and their scales written into every cache
layout, dtype and TP split, bit for bit what the host twin (``kvsnap.encoding.fp8.dequantize``)
makes of them, and nothing else written. The Triton kernel runs under its interpreter on host
memory (``TRITON_INTERPRET=1``), as on the GPU; the host path (no interpreter) is checked the
same way, and on CUDA the kernel itself (marked ``gpu``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsnap.encoding import fp8
from kvsnap.testing.caches import LAYOUT_KINDS, TP_KINDS, KVContent, make_cache, same_bytes
from kvsnap.transfer import page_dequant, triton_copy
from kvsnap.transfer.page_copy import kernel_table
from kvsnap.transfer.page_table import PageTable

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

BLOCKS = 5
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _rank_caches(kind: str, dtype: torch.dtype, tp_size: int, device: str = "cpu"):
    geometry = {"latent_dim": 16} if kind == "mla" else {"num_kv_heads": 4, "head_dim": 8}
    return [
        make_cache(
            kind,
            num_layers=2,
            num_blocks=BLOCKS,
            block_size=4,
            dtype=dtype,
            device=device,
            tp_rank=rank,
            tp_size=tp_size,
            **geometry,
        )
        for rank in range(tp_size)
    ]


def _staged(
    geometry, num_pages: int, seed: int, min_exponent: int = -126
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages of every e4m3 code (NaN included) and scales from 2**min_exponent to 2**120:
    results that are subnormal (from the default), ordinary and past the largest bf16/fp16
    value."""
    rng = np.random.default_rng(seed)
    shape = (num_pages, *geometry.canonical_page_shape)
    codes = rng.permutation(np.resize(np.arange(256, dtype=np.uint8), int(np.prod(shape))))
    heads = 1 if geometry.is_mla else geometry.num_kv_heads
    exponents = rng.integers(min_exponent, 121, (num_pages, heads))
    scales = np.exp2(exponents) * rng.uniform(1, 2, (num_pages, heads))
    scales = np.maximum(scales.astype(np.float32), np.float32(2.0**min_exponent))
    return torch.from_numpy(codes.reshape(shape)), torch.from_numpy(scales)


def _expected(geometry, page_tensors, device_blocks, codes, scales, dtype, flags=None):
    """What every canonical tensor must hold: zeros, but the pages written, as the twin
    decodes them."""
    decoded = fp8.dequantize(codes, scales, dtype)
    names = geometry.tensor_names()
    pages = {
        name: torch.zeros((BLOCKS, *geometry.canonical_page_shape), dtype=dtype) for name in names
    }
    for index, (tensor, block) in enumerate(zip(page_tensors, device_blocks, strict=True)):
        if flags is None or flags[index]:
            pages[names[tensor]][block] = decoded[index]
    return KVContent(geometry, pages)


def _check(rank_caches, content: KVContent) -> None:
    for cache in rank_caches:
        every_block = torch.arange(BLOCKS)
        for name in content.geometry.tensor_names():
            want = cache.expected(content, name, every_block)
            assert same_bytes(cache.views[name].cpu(), want), name


def _scatter_case(
    kind: str,
    tp_size: int,
    dtype: torch.dtype,
    seed: int,
    flags: bool = False,
    exact: bool | None = None,
):
    rank_caches = _rank_caches(kind, dtype, tp_size)
    geometry = rank_caches[0].layout.geometry
    rng = np.random.default_rng(seed)
    num_tensors = len(geometry.tensor_names())
    pairs = rng.permutation(num_tensors * BLOCKS)[:7]
    page_tensors, device_blocks = np.divmod(pairs, BLOCKS)
    codes, scales = _staged(geometry, len(pairs), seed, -126 if exact is not False else -117)
    page_ok = torch.from_numpy(rng.integers(0, 2, len(pairs))) if flags else None
    table = PageTable([cache.layout for cache in rank_caches])
    page_dequant.dequant_scatter(
        table, page_tensors, device_blocks, codes, scales, page_ok=page_ok, exact=exact
    )
    flags_array = None if page_ok is None else page_ok.numpy()
    _check(
        rank_caches,
        _expected(geometry, page_tensors, device_blocks, codes, scales, dtype, flags_array),
    )


CASES = [(kind, 1) for kind in LAYOUT_KINDS] + [(kind, 2) for kind in TP_KINDS]


@pytest.mark.parametrize(("kind", "tp_size"), CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_writes_what_the_twin_decodes(monkeypatch, kind, tp_size, dtype):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _scatter_case(kind, tp_size, dtype, seed=len(kind) + tp_size)


@pytest.mark.parametrize(("kind", "tp_size"), [("vllm-nhd", 1), ("packed", 2), ("mla", 1)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_fast_product_writes_what_the_twin_decodes(monkeypatch, kind, tp_size, dtype):
    """Scales of at least 2**-117 (every product normal in fp32): the one-multiplication
    product gives the exact product's bits."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _scatter_case(kind, tp_size, dtype, seed=11, exact=False)


def test_the_fast_product_is_taken_exactly_when_every_scale_allows_it():
    at_bound = torch.full((3, 2), page_dequant.FAST_MIN_SCALE)
    assert not page_dequant.needs_exact(at_bound)
    at_bound[1, 1] = float(np.nextafter(np.float32(page_dequant.FAST_MIN_SCALE), np.float32(0)))
    assert page_dequant.needs_exact(at_bound) and page_dequant.needs_exact(at_bound.numpy())


@pytest.mark.parametrize(("kind", "tp_size"), [("vllm-nhd", 1), ("vllm-hnd", 2), ("mla", 1)])
def test_the_host_path_writes_what_the_twin_decodes(monkeypatch, kind, tp_size):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for dtype in DTYPES:
        _scatter_case(kind, tp_size, dtype, seed=3)


@pytest.mark.parametrize("interpret", ["1", "0"])
def test_pages_whose_flag_is_off_are_not_written(monkeypatch, interpret):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    _scatter_case("vllm-nhd", 2, torch.bfloat16, seed=11, flags=True)
    _scatter_case("packed", 1, torch.float16, seed=12, flags=True)


@pytest.mark.parametrize("slot_pages", [(0, 3), (2, 6), (6, 7), (4, 4)])
def test_a_page_range_writes_exactly_its_pages(monkeypatch, slot_pages):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rank_caches = _rank_caches("vllm-nhd", torch.bfloat16, 2)
    geometry = rank_caches[0].layout.geometry
    page_tensors, device_blocks = np.divmod(np.random.default_rng(4).permutation(20)[:7], BLOCKS)
    codes, scales = _staged(geometry, 7, 4)
    table = PageTable([cache.layout for cache in rank_caches])
    copies = page_dequant.dequant_copies(table, page_tensors, device_blocks)
    elements = int(np.prod(geometry.canonical_page_shape))
    page_dequant.launch_dequant(
        copies,
        torch.from_numpy(kernel_table(copies)),
        table,
        codes.reshape(-1),
        torch.arange(7, dtype=torch.int64) * elements,
        scales,
        slot_pages=slot_pages,
    )
    wanted = np.zeros(7, dtype=bool)
    wanted[slot_pages[0] : slot_pages[1]] = True
    _check(
        rank_caches,
        _expected(geometry, page_tensors, device_blocks, codes, scales, torch.bfloat16, wanted),
    )


def test_pages_in_the_wrong_shape_or_dtype_are_refused():
    rank_caches = _rank_caches("vllm-nhd", torch.bfloat16, 1)
    table = PageTable([rank_caches[0].layout])
    codes, scales = _staged(rank_caches[0].layout.geometry, 2, 0)
    with pytest.raises(ValueError, match="uint8, 2 pages of 128 elements"):
        page_dequant.dequant_scatter(table, [0, 1], [0, 1], codes.float(), scales)
    with pytest.raises(ValueError, match="uint8, 3 pages"):
        page_dequant.dequant_scatter(table, [0, 1, 2], [0, 1, 2], codes, scales)


def test_the_compiled_kernel_and_its_helpers_keep_their_constexpr_parameters(monkeypatch):
    """Triton's JIT finds a kernel's compile-time parameters by their ``tl.constexpr``
    annotations; the kernel re-made with its helpers must keep them, or ``BLOCK`` reaches
    ``tl.arange`` as a runtime integer and the GPU compile fails (the interpreter never looks:
    an H100 run of 2026-12-06 found it)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setitem(triton_copy._KERNELS, (page_dequant._dequant_copy_kernel, False), None)
    kernel = triton_copy.kernel_for(page_dequant._dequant_copy_kernel, page_dequant._HELPERS)
    assert "BLOCK" in [param.name for param in kernel.params if param.is_constexpr]
    for function, jitted in [(page_dequant._dequant_copy_kernel, kernel)] + [
        (helper, kernel.fn.__globals__[helper.__name__]) for helper in page_dequant._HELPERS
    ]:
        annotated = [
            name for name, kind in function.__annotations__.items() if "constexpr" in str(kind)
        ]
        assert [param.name for param in jitted.params if param.is_constexpr] == annotated


@pytest.mark.gpu
@pytest.mark.parametrize(("kind", "tp_size"), CASES)
def test_on_cuda_the_kernel_writes_what_the_twin_decodes(kind, tp_size):
    for dtype in DTYPES:
        rank_caches = _rank_caches(kind, dtype, tp_size, device="cuda")
        geometry = rank_caches[0].layout.geometry
        rng = np.random.default_rng(tp_size)
        pairs = rng.permutation(len(geometry.tensor_names()) * BLOCKS)[:7]
        page_tensors, device_blocks = np.divmod(pairs, BLOCKS)
        codes, scales = _staged(geometry, len(pairs), 9)
        table = PageTable([cache.layout for cache in rank_caches])
        page_dequant.dequant_scatter(
            table, page_tensors, device_blocks, codes.cuda(), scales.cuda()
        )
        torch.cuda.synchronize()
        _check(rank_caches, _expected(geometry, page_tensors, device_blocks, codes, scales, dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("exact", [True, False])
def test_on_cuda_large_pages_over_many_program_steps_decode_as_the_twin(dtype, exact):
    """The 8B shape's pages (16 tokens x 8 heads x 128: one fragment of 4 tiles) and more pages
    than programs, so every program loops: every element as the host twin decodes it, the
    first difference named by page, element, code and scale."""
    blocks = 640
    cache = make_cache(
        "vllm-nhd",
        num_layers=2,
        num_blocks=blocks,
        block_size=16,
        num_kv_heads=8,
        head_dim=128,
        dtype=dtype,
        device="cuda",
    )
    geometry = cache.layout.geometry
    rng = np.random.default_rng(5)
    pages = 4 * blocks
    page_tensors, device_blocks = np.divmod(np.arange(pages), blocks)
    codes = torch.from_numpy(rng.integers(0, 256, (pages, 16, 8, 128), dtype=np.uint8))
    exponents = rng.integers(-12, 2, (pages, 8)).astype(np.float64)
    if exact:
        exponents[::97] = -125  # some pages whose smallest codes decode below fp32's normal range
    scales = torch.from_numpy(
        (np.exp2(exponents) * rng.uniform(1, 2, (pages, 8))).astype(np.float32)
    )
    table = PageTable([cache.layout])
    page_dequant.dequant_scatter(
        table, page_tensors, device_blocks, codes.cuda(), scales.cuda(), exact=exact
    )
    torch.cuda.synchronize()
    want = fp8.dequantize(codes, scales, dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for index, name in enumerate(geometry.tensor_names()):
        got = cache.views[name].cpu().view(bits)
        expected = want[index * blocks : (index + 1) * blocks].view(bits)
        differ = torch.nonzero(got != expected)
        if len(differ):
            block, *element = (int(i) for i in differ[0])
            page = index * blocks + block
            raise AssertionError(
                f"{name}: {len(differ)} elements differ; first block {block} element {element}: "
                f"code {int(codes[page][tuple(element)]):#04x}, scale "
                f"{float(scales[page, element[1]])!r}, kernel {int(got[block][tuple(element)])}, "
                f"twin {int(expected[block][tuple(element)])}"
            )
