"""Shared pieces of the warm-pipeline tests (tests/pipeline, tests/store): caches of random bytes
in every layout and TP split, the sequences captured from them, the check that a restore put
every page where it belongs, and a byte flipped inside one stored page."""

from __future__ import annotations

import numpy as np
import torch

from kvsnap.format import SourceInfo
from kvsnap.snapshot import SequenceBlocks
from kvsnap.store import SnapshotReader
from kvsnap.testing.caches import make_cache, random_content, same_bytes

SOURCE = SourceInfo(
    engine="test", engine_version="0", model_id="m", model_revision=None, model_fingerprint="f" * 64
)
BLOCK = 4


def _caches(
    kind, *, layers=2, heads=4, tp_size=1, blocks=12, seed=0, fill=True, device="cpu", head_dim=8
):
    geometry_args = (
        {"latent_dim": 24} if kind == "mla" else {"num_kv_heads": heads, "head_dim": head_dim}
    )
    caches = [
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
    content = random_content(caches[0].layout.geometry, blocks, torch.Generator().manual_seed(seed))
    if fill:
        for cache in caches:
            cache.fill(content)
    return caches, content


def _sequences(blocks_used: list[list[int]]) -> list[SequenceBlocks]:
    # One token stream: sequences agreeing on their first block ids share those blocks' tokens,
    # so their prefix hash chains coincide and the snapshot stores the blocks once.
    stream = np.random.default_rng(5).integers(0, 1000, 4096)
    return [
        SequenceBlocks(f"s{index}", stream[: BLOCK * len(block_ids) - 1], np.array(block_ids))
        for index, block_ids in enumerate(blocks_used)
    ]


def _assert_restored(targets, content, source_blocks, target_blocks) -> None:
    for cache in targets:
        for name in cache.views:
            want = cache.expected(content, name, torch.tensor(source_blocks))
            got = cache.logical(name)[torch.tensor(target_blocks)]
            assert same_bytes(want, got), (cache.kind, name)


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


def _flip_byte(path, name: str, block: int, offset: int = 5) -> None:
    with SnapshotReader(path) as reader:
        _, entry = reader.locate(name)
        page = reader.page_size_bytes(name)
    with open(path, "r+b") as handle:
        handle.seek(entry.begin + block * page + offset)
        byte = handle.read(1)
        handle.seek(entry.begin + block * page + offset)
        handle.write(bytes([byte[0] ^ 0x40]))
