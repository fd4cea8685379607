"""Parted snapshots on real CUDA caches (skipped without CUDA): parts captured from TP=2 caches
through the fused path and restored at TP 1, 2 and 4, bit-exact, warm on the second call."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvsnap.pipeline import Pipeline
from kvsnap.snapshot import Snapshot, capture
from tests.support.parts_helpers import (
    NUM_BLOCKS,
    SOURCE,
    TARGETS,
    TP_KINDS,
    caches,
    filled,
    restore_map,
    restored_exactly,
    sequences,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("heads", [8, 2])
@pytest.mark.parametrize("kind", TP_KINDS)
def test_parts_round_trip_on_the_gpu_at_any_tp(tmp_path: Path, kind: str, heads: int) -> None:
    ranks, content = filled(kind, 2, heads, device="cuda")
    path = tmp_path / "parted.safetensors"
    result = capture(
        [rank.layout for rank in ranks], sequences(1), path, source=SOURCE, per_rank_parts=True
    )
    assert result.backend == "fused"
    with Snapshot.open(path) as snap:
        assert snap.verify() == []
        for tp in (1, 2, 4):
            targets = caches(kind, tp, heads, device="cuda")
            restored = snap.restore([target.layout for target in targets], restore_map())
            assert restored.backend == "fused"
            torch.cuda.synchronize()
            assert restored_exactly(targets, content), f"TP {tp}"


def test_a_warm_pipeline_restores_parts_again(tmp_path: Path) -> None:
    ranks, content = filled("vllm-hnd", 2, 8, device="cuda")
    path = tmp_path / "parted.safetensors"
    capture([rank.layout for rank in ranks], sequences(1), path, source=SOURCE, per_rank_parts=True)
    targets = caches("vllm-nhd", 4, 8, device="cuda")
    pipeline = Pipeline([target.layout for target in targets])
    with Snapshot.open(path) as snap:
        for _ in range(3):
            pipeline.restore_blocks(snap, np.arange(NUM_BLOCKS), TARGETS)
    torch.cuda.synchronize()
    assert restored_exactly(targets, content)
