"""Shared pieces of the parted-snapshot tests: caches of random bytes at any TP size, the
sequences captured from them, and the check that a restore put every page where it belongs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kvsnap.format import SourceInfo
from kvsnap.format.signing import KeyRing
from kvsnap.layout import KVGeometry
from kvsnap.pipeline import SequenceBlocks
from kvsnap.snapshot import capture
from kvsnap.testing.caches import KVContent, SyntheticCache, make_cache, random_content, same_bytes

LAYERS, HEAD_DIM, BLOCK, NUM_BLOCKS = 2, 8, 4, 12
#: Layout kinds with a TP form; ``flat-paged`` and ``contiguous`` (DynamicCache) are TP=1 only.
TP_KINDS = ("vllm-nhd", "vllm-hnd", "packed", "vllm-legacy", "cross-layer")
SOURCE = SourceInfo(
    engine="test", engine_version="0", model_id="random", model_fingerprint="f" * 32
)


def caches(
    kind: str, tp: int, heads: int, num_blocks: int = NUM_BLOCKS, device: str = "cpu"
) -> list[SyntheticCache]:
    """One zeroed cache per TP rank of a model with ``heads`` KV heads, on ``device``."""
    return [
        make_cache(
            kind,
            num_layers=LAYERS,
            num_blocks=num_blocks,
            block_size=BLOCK,
            num_kv_heads=heads,
            head_dim=HEAD_DIM,
            tp_rank=rank,
            tp_size=tp,
            device=device,
        )
        for rank in range(tp)
    ]


def geometry(heads: int) -> KVGeometry:
    return KVGeometry(
        num_layers=LAYERS, block_size=BLOCK, dtype="float16", num_kv_heads=heads, head_dim=HEAD_DIM
    )


def sequences(seed: int = 0) -> list[SequenceBlocks]:
    """Two sequences on device blocks 0..7 and 8..11; snapshot block ``b`` is device block
    ``b`` (distinct tokens: no block is shared)."""
    tokens = np.random.default_rng(seed).integers(0, 50_000, 43)
    return [
        SequenceBlocks("a", tokens[:30], np.arange(8)),
        SequenceBlocks("b", tokens[30:], np.arange(8, 12)),
    ]


def filled(
    kind: str, tp: int, heads: int, seed: int = 1, device: str = "cpu"
) -> tuple[list[SyntheticCache], KVContent]:
    """TP ``tp`` caches of ``kind`` on ``device`` holding random content in every block."""
    ranks = caches(kind, tp, heads, device=device)
    content = random_content(geometry(heads), NUM_BLOCKS, torch.Generator().manual_seed(seed))
    for rank in ranks:
        rank.fill(content)
    return ranks, content


def parted_snapshot(
    path: Path,
    kind: str = "vllm-nhd",
    heads: int = 8,
    tp: int = 2,
    seed: int = 1,
    keys: KeyRing | None = None,
) -> KVContent:
    """A parted snapshot at ``path`` captured from TP ``tp`` caches (signed with ``keys``);
    the content it holds."""
    ranks, content = filled(kind, tp, heads, seed)
    capture(
        [rank.layout for rank in ranks],
        sequences(seed),
        path,
        source=SOURCE,
        per_rank_parts=True,
        keys=keys,
    )
    return content


#: Restore targets: snapshot block ``b`` goes to target block ``TARGETS[b]``.
TARGETS = np.array([11, 10, 9, 8, 3, 2, 1, 0, 7, 6, 5, 4])


def restore_map() -> dict[str, np.ndarray]:
    return {"a": TARGETS[:8], "b": TARGETS[8:]}


def restored_exactly(ranks: list[SyntheticCache], content: KVContent) -> bool:
    """Whether every rank's target block ``TARGETS[b]`` holds its heads of snapshot block
    ``b``, bit for bit, in every layer tensor."""
    snapshot_blocks = torch.arange(NUM_BLOCKS)
    targets = torch.from_numpy(TARGETS)
    return all(
        same_bytes(rank.logical(name)[targets], rank.expected(content, name, snapshot_blocks))
        for rank in ranks
        for name in content.geometry.tensor_names()
    )
