"""Host pages for the transfer tests, and the independent expectation of where each page lands:
a host area of padded chunks, the bytes of a canonical page, one job run through the handler,
and a small cache with its one-page-per-job copies."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvsnap.testing.caches import KVContent, SyntheticCache, make_cache, random_content
from kvsnap.transfer import TransferHandler
from kvsnap.transfer.plan import Direction, HostPages, PageCopy

D2H, H2D = Direction.DEVICE_TO_HOST, Direction.HOST_TO_DEVICE


@dataclass
class HostArea:
    """Host pages for every canonical tensor: chunks of ``per_chunk`` pages, padded apart."""

    buffer: torch.Tensor  # (num_tensors, num_chunks, chunk_stride) uint8
    names: list[str]
    page_size: int
    per_chunk: int
    chunk_ids: np.ndarray
    skip: int

    @classmethod
    def create(
        cls,
        names: list[str],
        page_size: int,
        count: int,
        per_chunk: int,
        skip: int,
        padding: int,
        rng: np.random.Generator,
    ) -> HostArea:
        needed = -(-(count + skip) // per_chunk)
        num_chunks = needed + int(rng.integers(0, 3))
        chunk_ids = rng.permutation(num_chunks)[:needed]
        stride = per_chunk * page_size + padding
        buffer = torch.zeros(len(names), num_chunks, stride, dtype=torch.uint8)
        return cls(buffer, names, page_size, per_chunk, chunk_ids, skip)

    def host(self, index: int) -> HostPages:
        chunks = self.buffer[index]
        return HostPages(
            chunks.data_ptr(), chunks.shape[0], chunks.shape[1], self.page_size, self.per_chunk
        )

    def copies(self, device_blocks: np.ndarray) -> list[PageCopy]:
        return [
            PageCopy(name, device_blocks, self.host(index), self.chunk_ids, self.skip)
            for index, name in enumerate(self.names)
        ]

    def page(self, index: int, k: int) -> torch.Tensor:
        """The bytes of the ``k``-th page of the enumeration (computed here, not by plan.py)."""
        chunk_slot, sub_page = divmod(self.skip + k, self.per_chunk)
        chunk = int(self.chunk_ids[chunk_slot])
        start = sub_page * self.page_size
        return self.buffer[index, chunk, start : start + self.page_size]


def page_bytes(content: KVContent, name: str, k: int) -> torch.Tensor:
    return content.pages[name][k].contiguous().view(torch.uint8).flatten()


def run_job(cache: SyntheticCache, direction: Direction, copies: list[PageCopy], **options) -> None:
    with TransferHandler(cache.layout, direction, **options) as handler:
        assert handler.submit(7, copies), handler.last_rejection
        (result,) = handler.wait([7])
    assert result.success, result.error
    assert result.job_id == 7


def small_cache(blocks: int = 16) -> tuple[SyntheticCache, KVContent]:
    cache = make_cache(
        "vllm-nhd", num_layers=2, num_blocks=blocks, block_size=2, num_kv_heads=2, head_dim=4
    )
    content = random_content(cache.layout.geometry, blocks, torch.Generator().manual_seed(1))
    cache.fill(content)
    return cache, content


def one_block_area(cache: SyntheticCache, pages: int) -> HostArea:
    names = cache.layout.geometry.tensor_names()
    page = cache.layout.geometry.canonical_page_size_bytes
    return HostArea(
        torch.zeros(len(names), pages, page, dtype=torch.uint8), names, page, 1, np.arange(pages), 0
    )


def copies_for(area: HostArea, device_block: int, host_page: int) -> list[PageCopy]:
    return [
        PageCopy(name, np.array([device_block]), area.host(index), np.array([host_page]))
        for index, name in enumerate(area.names)
    ]
