"""The fused page copy restricted to a run of a slot's pages (``launch_kernel(...,
slot_pages=...)``), as a restore scatters a slot run by run: exactly those pages are written,
and of them only the ones whose flag is set. Run by Triton's interpreter on host memory, and
compared with the numpy path copying the same pages."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsnap.transfer import page_copy
from kvsnap.transfer.page_table import PageTable
from kvsnap.transfer.plan import Direction
from tests.support.pipeline_caches import caches


def _cache_bytes(rank_caches) -> list[np.ndarray]:
    tensors = [entry.tensor for cache in rank_caches for entry in cache.layout.tensors]
    return [tensor.view(torch.uint8).numpy().copy() for tensor in tensors]


@pytest.mark.parametrize(("kind", "tp_size"), [("vllm-nhd", 1), ("vllm-nhd", 2), ("mla", 1)])
@pytest.mark.parametrize("slot_pages", [(0, 5), (3, 11), (11, 12), (4, 4)])
def test_a_page_range_writes_exactly_its_pages_whose_flag_is_set(
    monkeypatch, kind, tp_size, slot_pages
):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rng = np.random.default_rng(sum(slot_pages) + tp_size)
    kernel_caches, _ = caches(kind, tp_size=tp_size, blocks=6, fill=False)
    numpy_caches, _ = caches(kind, tp_size=tp_size, blocks=6, fill=False)
    num_tensors = len(kernel_caches[0].layout.geometry.tensor_names())
    page_bytes = kernel_caches[0].layout.geometry.canonical_page_size_bytes
    # 12 pages of random tensors and distinct blocks, in a slot of random bytes.
    num_pages = 12
    pairs = rng.permutation(num_tensors * 6)[:num_pages]
    page_tensors, device_blocks = np.divmod(pairs, 6)
    slot = rng.integers(0, 256, num_pages * page_bytes, dtype=np.uint8)
    flags = rng.integers(0, 2, num_pages).astype(np.int64)
    offsets = np.arange(num_pages, dtype=np.int64) * page_bytes
    staging = slot.ctypes.data + offsets

    def copies(rank_caches, keep):
        table = PageTable([c.layout for c in rank_caches])
        return table.copies(
            Direction.HOST_TO_DEVICE, page_tensors[keep], device_blocks[keep], staging[keep]
        )

    every_page = np.ones(num_pages, dtype=bool)
    kernel_copies = copies(kernel_caches, every_page)
    page_copy.launch_kernel(
        kernel_copies,
        torch.from_numpy(page_copy.kernel_table(kernel_copies)),
        torch.device("cpu"),
        page_ok=torch.from_numpy(flags),
        slot_pages=slot_pages,
    )
    wanted = np.zeros(num_pages, dtype=bool)
    wanted[slot_pages[0] : slot_pages[1]] = True
    page_copy.run_on_cpu(copies(numpy_caches, wanted & (flags == 1)))
    for got, want in zip(_cache_bytes(kernel_caches), _cache_bytes(numpy_caches), strict=True):
        np.testing.assert_array_equal(got, want)
    if wanted.any() and flags[wanted].any():
        assert any(got.any() for got in _cache_bytes(kernel_caches))
