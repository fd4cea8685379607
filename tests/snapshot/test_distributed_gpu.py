"""kvsnap.distributed with CUDA caches: one process per rank, each on its own GPU where there
are enough (ranks share GPU 0 otherwise), the fused copy and the device checksums in each."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import kvsnap
from kvsnap.testing.caches import same_bytes
from tests.support.distributed_child import Case, run_ranks

pytestmark = pytest.mark.gpu

CASE = {
    "device": "cuda",
    "num_layers": 4,
    "num_kv_heads": 8,
    "head_dim": 128,
    "block_size": 16,
    "num_blocks": 64,
}


@pytest.mark.parametrize("world", [2, 4])
def test_tp_capture_on_gpus_restores_at_every_tp_size(tmp_path: Path, world: int) -> None:
    path = tmp_path / "snap" / "gpu.safetensors"
    path.parent.mkdir()
    reports = run_ranks(tmp_path, "capture", world, path, case=CASE)
    assert [report.get("error") for report in reports] == [None] * world, reports
    assert [report["num_parts"] for report in reports] == [world] * world
    case = Case(**CASE)
    inverse = np.argsort(case.device_blocks())
    with kvsnap.Snapshot.open(path) as snapshot:
        assert snapshot.verify() == []
        sequence = case.sequences()[1]
        blocks = torch.as_tensor(snapshot.sequence(sequence.id).block_ids)
        for name, pages in case.content().pages.items():
            expected = pages[torch.as_tensor(inverse[sequence.block_ids])]
            assert same_bytes(snapshot.read_tensor(name)[blocks], expected), name
    for restore_world in (1, 2, 4):
        restored = run_ranks(tmp_path, "restore", restore_world, path, case=CASE)
        assert [(r["error"], r["mismatched"]) for r in restored] == [(None, [])] * restore_world
