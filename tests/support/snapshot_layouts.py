"""Random CPU caches of five layouts for the snapshot and pipeline-loop tests (tests/snapshot,
tests/pipeline): the layout factories and their logical views, sequences over random device
blocks, and a CPU copy backend that fails its third job."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from kvsnap import layout as L
from kvsnap.format import SourceInfo
from kvsnap.snapshot import SequenceBlocks
from kvsnap.transfer.cpu import CpuBackend

#: The source every snapshot of these caches names.
SOURCE = SourceInfo(
    engine="test",
    engine_version="0",
    model_id="random",
    model_revision=None,
    model_fingerprint="f" * 32,
)
#: The geometry of every cache built here: layers, KV heads over all ranks, head size, block.
LAYERS, HEADS, HEAD_DIM, BLOCK = 3, 4, 8, 4
#: A logical view: ``view(layer, part)`` is a (num_blocks, block, local_heads, head_dim) tensor.
LogicalView = Callable[[int, str], torch.Tensor]


def random_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator
) -> torch.Tensor:
    """Random bytes seen as ``dtype`` (NaN and Inf patterns included: bytes must survive)."""
    element = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(
        0, 256, (math.prod(shape) * element,), dtype=torch.uint8, generator=generator
    )
    return raw.view(dtype).reshape(shape)


# Each factory: (num_blocks, tp_rank, tp_size, generator) -> (layout, logical_view)
# where logical_view(layer, part) is a (num_blocks, block, local_heads, head_dim) tensor view.
def split_nhd(
    num_blocks: int, rank: int, tp: int, gen: torch.Generator
) -> tuple[L.CacheLayout, LogicalView]:
    """vLLM's split K/V cache, NHD (token-major) pages, for rank ``rank`` of ``tp``."""
    caches = [
        random_tensor((num_blocks, 2, BLOCK, HEADS // tp, HEAD_DIM), torch.bfloat16, gen)
        for _ in range(LAYERS)
    ]
    layout = L.vllm_split_layout(caches, num_kv_heads=HEADS, tp_rank=rank, tp_size=tp)
    return layout, lambda layer, part: caches[layer][:, L.KV_PARTS.index(part)]


def split_hnd(
    num_blocks: int, rank: int, tp: int, gen: torch.Generator
) -> tuple[L.CacheLayout, LogicalView]:
    """vLLM's split K/V cache, HND (head-major) pages, for rank ``rank`` of ``tp``."""
    physical = [
        random_tensor((num_blocks, 2, HEADS // tp, BLOCK, HEAD_DIM), torch.bfloat16, gen)
        for _ in range(LAYERS)
    ]
    caches = [tensor.transpose(2, 3) for tensor in physical]
    layout = L.vllm_split_layout(caches, num_kv_heads=HEADS, tp_rank=rank, tp_size=tp)
    return layout, lambda layer, part: caches[layer][:, L.KV_PARTS.index(part)]


def packed(
    num_blocks: int, rank: int, tp: int, gen: torch.Generator
) -> tuple[L.CacheLayout, LogicalView]:
    """K and V packed along head_dim in one tensor per layer, for rank ``rank`` of ``tp``."""
    caches = [
        random_tensor((num_blocks, HEADS // tp, BLOCK, 2 * HEAD_DIM), torch.bfloat16, gen)
        for _ in range(LAYERS)
    ]
    layout = L.packed_layout(caches, num_kv_heads=HEADS, tp_rank=rank, tp_size=tp)

    def view(layer: int, part: str) -> torch.Tensor:
        half = slice(0, HEAD_DIM) if part == L.KEY else slice(HEAD_DIM, 2 * HEAD_DIM)
        return caches[layer][..., half].transpose(1, 2)

    return layout, view


def flat_paged(
    num_blocks: int, rank: int, tp: int, gen: torch.Generator
) -> tuple[L.CacheLayout, LogicalView]:
    """Flat paged K and V tensors (a token per row), TP=1 only."""
    assert tp == 1
    keys = [
        random_tensor((num_blocks * BLOCK, HEADS, HEAD_DIM), torch.bfloat16, gen)
        for _ in range(LAYERS)
    ]
    values = [
        random_tensor((num_blocks * BLOCK, HEADS, HEAD_DIM), torch.bfloat16, gen)
        for _ in range(LAYERS)
    ]
    layout = L.flat_paged_layout(keys, values, block_size=BLOCK)

    def view(layer: int, part: str) -> torch.Tensor:
        tensor = keys[layer] if part == L.KEY else values[layer]
        return tensor.view(num_blocks, BLOCK, HEADS, HEAD_DIM)

    return layout, view


def contiguous(
    num_blocks: int, rank: int, tp: int, gen: torch.Generator
) -> tuple[L.CacheLayout, LogicalView]:
    """A contiguous DynamicCache-style K and V per layer cut into blocks, TP=1 only."""
    assert tp == 1
    keys = [
        random_tensor((1, HEADS, num_blocks * BLOCK, HEAD_DIM), torch.bfloat16, gen)
        for _ in range(LAYERS)
    ]
    values = [
        random_tensor((1, HEADS, num_blocks * BLOCK, HEAD_DIM), torch.bfloat16, gen)
        for _ in range(LAYERS)
    ]
    layout = L.contiguous_layout(keys, values, block_size=BLOCK)

    def view(layer: int, part: str) -> torch.Tensor:
        tensor = keys[layer] if part == L.KEY else values[layer]
        return tensor[0].transpose(0, 1).reshape(num_blocks, BLOCK, HEADS, HEAD_DIM)

    return layout, view


#: The layout factories by name.
FACTORIES: dict[str, Callable[..., tuple[L.CacheLayout, LogicalView]]] = {
    "split-nhd": split_nhd,
    "split-hnd": split_hnd,
    "packed": packed,
    "flat-paged": flat_paged,
    "contiguous": contiguous,
}


def sequences_for(
    num_blocks: int, lengths: list[int], rng: np.random.Generator
) -> list[SequenceBlocks]:
    """Sequences over distinct random device blocks."""
    needed = [math.ceil(length / BLOCK) for length in lengths]
    blocks = rng.permutation(num_blocks)[: sum(needed)]
    sequences, start = [], 0
    for index, (length, count) in enumerate(zip(lengths, needed, strict=True)):
        tokens = rng.integers(0, 50_000, size=length)
        sequences.append(SequenceBlocks(f"seq-{index}", tokens, blocks[start : start + count]))
        start += count
    return sequences


class FailingCopies(CpuBackend):
    """A real CPU backend whose third job fails, as a device copy error would."""

    jobs_seen = 0

    def execute(self, job):
        FailingCopies.jobs_seen += 1
        if FailingCopies.jobs_seen == 3:
            raise OSError("injected copy failure")
        super().execute(job)
