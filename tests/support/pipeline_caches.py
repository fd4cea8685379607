"""Shared pieces of the warm-pipeline tests (tests/pipeline, tests/store): caches of random bytes
in every layout and TP split, the sequences captured from them, the check that a restore put
every page where it belongs, and a byte flipped inside one stored page."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kvsnap.format import SourceInfo
from kvsnap.snapshot import SequenceBlocks
from kvsnap.store import SnapshotReader
from kvsnap.testing.caches import (
    KVContent,
    SyntheticCache,
    make_cache,
    random_content,
    same_bytes,
)

#: The source every pipeline test's snapshot names.
SOURCE = SourceInfo(
    engine="test", engine_version="0", model_id="m", model_revision=None, model_fingerprint="f" * 64
)
#: Tokens per block of every cache built here.
BLOCK = 4


def caches(
    kind: str,
    *,
    layers: int = 2,
    heads: int = 4,
    tp_size: int = 1,
    blocks: int = 12,
    seed: int = 0,
    fill: bool = True,
    device: str = "cpu",
    head_dim: int = 8,
    latent_dim: int = 24,
) -> tuple[list[SyntheticCache], KVContent]:
    """A ``kind`` cache per TP rank and the random content of ``seed`` (filled in if ``fill``)."""
    geometry_args = (
        {"latent_dim": latent_dim}
        if kind == "mla"
        else {"num_kv_heads": heads, "head_dim": head_dim}
    )
    rank_caches = [
        make_cache(
            kind,
            num_layers=layers,
            num_blocks=blocks,
            block_size=BLOCK,
            tp_rank=rank,
            tp_size=tp_size,
            device=device,
            **geometry_args,
        )
        for rank in range(tp_size)
    ]
    content = random_content(
        rank_caches[0].layout.geometry, blocks, torch.Generator().manual_seed(seed)
    )
    if fill:
        for cache in rank_caches:
            cache.fill(content)
    return rank_caches, content


def sequences(blocks_used: list[list[int]]) -> list[SequenceBlocks]:
    """Sequences ``s0``, ``s1``, ... over these device blocks, each last block one token short."""
    # One token stream: sequences agreeing on their first block ids share those blocks' tokens,
    # so their prefix hash chains coincide and the snapshot stores the blocks once.
    stream = np.random.default_rng(5).integers(0, 1000, 4096)
    return [
        SequenceBlocks(f"s{index}", stream[: BLOCK * len(block_ids) - 1], np.array(block_ids))
        for index, block_ids in enumerate(blocks_used)
    ]


def assert_restored(
    targets: list[SyntheticCache],
    content: KVContent,
    source_blocks: list[int],
    target_blocks: list[int],
) -> None:
    """Assert every target holds ``content``'s ``source_blocks`` in its ``target_blocks``."""
    for cache in targets:
        for name in cache.views:
            want = cache.expected(content, name, torch.tensor(source_blocks))
            got = cache.logical(name)[torch.tensor(target_blocks)]
            assert same_bytes(want, got), (cache.kind, name)


#: ``(kind, tp_size, heads)`` of every layout and TP split the pipeline tests round-trip.
LAYOUTS = [
    ("vllm-nhd", 1, 4),
    ("vllm-hnd", 1, 4),
    ("vllm-legacy", 1, 4),
    ("packed", 1, 4),
    ("cross-layer", 1, 4),
    ("flat-paged", 1, 4),
    ("contiguous", 1, 4),
    ("mla", 1, 0),
    ("vllm-nhd", 2, 4),
    ("vllm-hnd", 4, 4),
    ("packed", 2, 4),
    ("vllm-nhd", 4, 2),  # more ranks than heads: replicated heads, one elected writer per block
    ("mla", 2, 0),  # the latent on every rank
]


def flip_byte(path: Path, name: str, block: int, offset: int = 5) -> None:
    """Flip one bit of byte ``offset`` of snapshot block ``block`` of tensor ``name``, in place."""
    with SnapshotReader(path) as reader:
        _, entry = reader.locate(name)
        page = reader.page_size_bytes(name)
    with open(path, "r+b") as handle:
        handle.seek(entry.begin + block * page + offset)
        byte = handle.read(1)
        handle.seek(entry.begin + block * page + offset)
        handle.write(bytes([byte[0] ^ 0x40]))
