"""The capture → snapshot → restore pipeline on real CPU caches of every layout.

Caches hold random bytes; a restore into a *different* layout must reproduce every token's KV
bit for bit, and everything a restore refuses must be refused before a byte is written.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import safetensors
import torch

from kvsnap import layout as L
from kvsnap.errors import IncompatibleSnapshotError, TransferFailedError
from kvsnap.pipeline import StagingOptions, TransferOptions
from kvsnap.snapshot import SequenceBlocks, Snapshot, capture
from kvsnap.transfer import TransferHandler
from kvsnap.transfer.page_copy import run_on_cpu
from tests.support.snapshot_layouts import (
    BLOCK,
    FACTORIES,
    HEAD_DIM,
    HEADS,
    LAYERS,
    SOURCE,
    FailingCopies,
    packed,
    sequences_for,
    split_hnd,
    split_nhd,
)


@pytest.mark.parametrize("source_name", list(FACTORIES))
@pytest.mark.parametrize("target_name", ["split-nhd", "contiguous", "packed"])
def test_capture_then_restore_into_another_layout_is_bit_exact(tmp_path, source_name, target_name):
    generator = torch.Generator().manual_seed(1)
    rng = np.random.default_rng(2)
    source_layout, source_view = FACTORIES[source_name](12, 0, 1, generator)
    sequences = sequences_for(12, [9, 16, 3], rng)
    path = tmp_path / "snap.safetensors"
    result = capture(
        source_layout,
        sequences,
        path,
        source=SOURCE,
        staging=StagingOptions(slot_bytes=2048, num_slots=2),
    )
    assert result.num_sequences == 3 and result.num_tokens == 28 and result.num_blocks == 3 + 4 + 1

    target_layout, target_view = FACTORIES[target_name](10, 0, 1, generator)
    targets = sequences_for(10, [9, 16, 3], rng)
    with Snapshot.open(path) as snap:
        assert snap.verify() == []
        snap.restore(
            target_layout,
            {seq.id: target.block_ids for seq, target in zip(sequences, targets, strict=True)},
        )
    for seq, target in zip(sequences, targets, strict=True):
        for layer in range(LAYERS):
            for part in L.KV_PARTS:
                want = source_view(layer, part)[torch.from_numpy(seq.block_ids)].reshape(
                    -1, HEADS, HEAD_DIM
                )
                got = target_view(layer, part)[torch.from_numpy(target.block_ids)].reshape(
                    -1, HEADS, HEAD_DIM
                )
                count = len(seq.token_ids)
                assert torch.equal(want[:count].view(torch.int16), got[:count].view(torch.int16)), (
                    layer,
                    part,
                )


def test_safetensors_reads_the_canonical_tensors(tmp_path):
    generator = torch.Generator().manual_seed(3)
    layout, view = split_hnd(6, 0, 1, generator)
    sequences = [SequenceBlocks("only", np.arange(24), np.array([5, 0, 3, 1, 4, 2]))]
    path = tmp_path / "snap.safetensors"
    capture(layout, sequences, path, source=SOURCE)
    with safetensors.safe_open(str(path), "pt") as handle:
        key = handle.get_tensor("layers.2.key")
        assert key.shape == (6, BLOCK, HEADS, HEAD_DIM) and key.dtype == torch.bfloat16
        block_ids = handle.get_tensor("sequences.0.block_ids")
        token_ids = handle.get_tensor("sequences.0.token_ids")
    assert token_ids.tolist() == list(range(24))
    expected = view(2, L.KEY)[torch.tensor([5, 0, 3, 1, 4, 2])]
    assert torch.equal(key[block_ids].view(torch.int16), expected.view(torch.int16))


def test_shared_prefix_blocks_are_stored_once(tmp_path):
    generator = torch.Generator().manual_seed(4)
    layout, _ = split_nhd(16, 0, 1, generator)
    prefix = np.arange(100, 108)  # two full blocks
    first = SequenceBlocks("a", np.concatenate([prefix, [1, 2, 3]]), np.array([0, 1, 2]))
    second = SequenceBlocks("b", np.concatenate([prefix, [7, 7, 7, 7, 9]]), np.array([0, 1, 5, 6]))
    path = tmp_path / "snap.safetensors"
    result = capture(layout, [first, second], path, source=SOURCE)
    assert result.num_blocks == 2 + 1 + 2
    with Snapshot.open(path) as snap:
        records = {record.id: record for record in snap.sequences}
        assert records["a"].block_ids[:2].tolist() == records["b"].block_ids[:2].tolist()
        assert records["a"].prefix_hashes[:2] == records["b"].prefix_hashes[:2]
        assert records["a"].prefix_hashes[2] != records["b"].prefix_hashes[2]
        assert snap.shared_blocks() == {"a": 2, "b": 2}


def test_tp2_capture_restores_into_tp1_and_back(tmp_path):
    generator = torch.Generator().manual_seed(5)
    rank_layouts, rank_views = zip(
        *(split_nhd(8, rank, 2, generator) for rank in range(2)), strict=True
    )
    L.check_tiling(rank_layouts)
    sequences = [SequenceBlocks("s", np.arange(13), np.array([7, 2, 4, 0]))]
    tp2_path = tmp_path / "tp2.safetensors"
    capture(list(rank_layouts), sequences, tp2_path, source=SOURCE)

    single_layout, single_view = split_nhd(8, 0, 1, generator)
    with Snapshot.open(tp2_path) as snap:
        assert snap.metadata.tp_size == 2
        snap.restore(single_layout, {"s": np.array([1, 3, 5, 6])})
    for layer in range(LAYERS):
        for part in L.KV_PARTS:
            full = single_view(layer, part)[torch.tensor([1, 3, 5, 6])]
            halves = [
                rank_views[rank](layer, part)[torch.tensor([7, 2, 4, 0])] for rank in range(2)
            ]
            assert torch.equal(full.view(torch.int16), torch.cat(halves, dim=2).view(torch.int16))

    # And back: a TP=1 snapshot restored into two ranks gives each rank its heads.
    tp1_path = tmp_path / "tp1.safetensors"
    capture(
        single_layout,
        [SequenceBlocks("s", np.arange(13), np.array([1, 3, 5, 6]))],
        tp1_path,
        source=SOURCE,
    )
    fresh_layouts, fresh_views = zip(
        *(split_nhd(8, rank, 2, generator) for rank in range(2)), strict=True
    )
    with Snapshot.open(tp1_path) as snap:
        snap.restore(list(fresh_layouts), {"s": np.array([0, 1, 2, 3])})
    for layer in range(LAYERS):
        for part in L.KV_PARTS:
            full = single_view(layer, part)[torch.tensor([1, 3, 5, 6])]
            halves = [fresh_views[rank](layer, part)[:4] for rank in range(2)]
            assert torch.equal(full.view(torch.int16), torch.cat(halves, dim=2).view(torch.int16))


def test_incompatible_target_is_refused_before_any_byte_is_written(tmp_path):
    generator = torch.Generator().manual_seed(6)
    layout, _ = split_nhd(6, 0, 1, generator)
    path = tmp_path / "snap.safetensors"
    capture(layout, [SequenceBlocks("s", np.arange(8), np.array([0, 1]))], path, source=SOURCE)
    wrong_heads = [
        torch.zeros(6, 2, BLOCK, 2, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS)
    ]
    too_small = [
        torch.zeros(1, 2, BLOCK, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS)
    ]
    with Snapshot.open(path) as snap:
        with pytest.raises(IncompatibleSnapshotError, match=r"num_kv_heads: snapshot 4, target 2"):
            snap.restore(L.vllm_split_layout(wrong_heads), {"s": [0, 1]})
        with pytest.raises(IncompatibleSnapshotError, match="do not fit a cache of 1 blocks"):
            snap.restore(L.vllm_split_layout(too_small), {"s": [0, 1]})
        with pytest.raises(IncompatibleSnapshotError, match="has 2 blocks"):
            snap.restore(L.vllm_split_layout(too_small), {"s": [0]})
        with pytest.raises(IncompatibleSnapshotError, match="fingerprint"):
            snap.check_compatible(layout.geometry, model_fingerprint="0" * 32)
        snap.check_compatible(layout.geometry, model_fingerprint="0" * 32, force=True)
    assert all(not tensor.any() for tensor in wrong_heads + too_small)


def test_restore_of_one_sequence_leaves_other_blocks_alone(tmp_path):
    generator = torch.Generator().manual_seed(7)
    layout, view = split_nhd(10, 0, 1, generator)
    sequences = sequences_for(10, [8, 8], np.random.default_rng(8))
    path = tmp_path / "snap.safetensors"
    capture(layout, sequences, path, source=SOURCE)
    target = [
        torch.zeros(10, 2, BLOCK, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS)
    ]
    with Snapshot.open(path) as snap:
        result = snap.restore(L.vllm_split_layout(target), {"seq-1": [8, 9]})
    assert result.num_blocks == 2 and result.num_tokens == 8
    for layer in range(LAYERS):
        assert not target[layer][:8].any()
        assert torch.equal(
            target[layer][8:].view(torch.int16),
            torch.stack([view(layer, part) for part in L.KV_PARTS], dim=1)[
                torch.from_numpy(sequences[1].block_ids)
            ].view(torch.int16),
        )


def test_compare_names_the_first_mismatch(tmp_path):
    generator = torch.Generator().manual_seed(9)
    keys = [torch.randn(1, HEADS, 12, HEAD_DIM) for _ in range(LAYERS)]
    values = [torch.randn(1, HEADS, 12, HEAD_DIM) for _ in range(LAYERS)]
    sequence = SequenceBlocks("s", np.arange(12), np.arange(3))
    capture(
        L.contiguous_layout(keys, values, block_size=BLOCK),
        [sequence],
        tmp_path / "a.safetensors",
        source=SOURCE,
    )
    keys[1][0, 2, 5, 3] += 0.5
    capture(
        L.contiguous_layout(keys, values, block_size=BLOCK),
        [sequence],
        tmp_path / "b.safetensors",
        source=SOURCE,
    )
    with (
        Snapshot.open(tmp_path / "a.safetensors") as a,
        Snapshot.open(tmp_path / "b.safetensors") as b,
    ):
        assert a.compare(a).ok
        comparison = a.compare(b, atol=1e-3)
        loose = a.compare(b, atol=1.0)
    assert not comparison.ok and loose.ok
    mismatched = [layer for layer in comparison.layers if layer.num_mismatches]
    assert [layer.tensor for layer in mismatched] == ["layers.1.key"]
    assert mismatched[0].num_mismatches == 1
    assert mismatched[0].max_abs_diff == pytest.approx(0.5, abs=1e-6)
    assert mismatched[0].first_mismatch == {"sequence": "s", "token": 5, "head": 2, "channel": 3}
    report = " ".join(comparison.report().split())
    assert (
        "first difference beyond the tolerance: layer 1 (layers.1.key), sequence s, token 5, "
        "head 2, channel 3" in report
    )
    del generator


def test_statistics_cover_only_real_tokens(tmp_path):
    keys = [torch.full((1, HEADS, 8, HEAD_DIM), 2.0) for _ in range(LAYERS)]
    values = [torch.full((1, HEADS, 8, HEAD_DIM), -1.0) for _ in range(LAYERS)]
    keys[0][0, 0, 1, 0] = float("nan")
    # 6 real tokens in 2 blocks; tokens 6 and 7 are padding with a huge value that must not count.
    keys[2][0, :, 6:] = 1e6
    layout = L.contiguous_layout(keys, values, block_size=BLOCK)
    capture(
        layout,
        [SequenceBlocks("s", np.arange(6), np.arange(2))],
        tmp_path / "s.safetensors",
        source=SOURCE,
    )
    with Snapshot.open(tmp_path / "s.safetensors") as snap:
        assert snap.tensor_stats("layers.0.key")["nan"] == 1
        assert snap.tensor_stats("layers.2.key")["absmax"] == 2.0
        assert snap.tensor_stats("layers.1.value") == {
            "absmax": 1.0,
            "mean": -1.0,
            "std": 0.0,
            "nan": 0,
            "inf": 0,
        }
        norms = snap.token_norms("s")
    assert norms["key"].shape == (LAYERS, 6)
    assert norms["value"][0, 0] == pytest.approx(math.sqrt(HEADS * HEAD_DIM))


def _fail_third_fused_copy(monkeypatch):
    from kvsnap.pipeline import fused

    calls = []

    def failing(copies):
        calls.append(len(copies))
        if len(calls) == 3:
            raise OSError("injected copy failure")
        run_on_cpu(copies)

    monkeypatch.setattr(fused, "run_on_cpu", failing)
    return TransferOptions()


def _fail_third_handler_job(monkeypatch):
    FailingCopies.jobs_seen = 0
    monkeypatch.setattr(
        "kvsnap.pipeline.pipeline.TransferHandler",
        lambda rank, direction, backend: TransferHandler(
            rank, direction, backend=FailingCopies(rank, direction)
        ),
    )
    return TransferOptions(backend="cpu")


@pytest.mark.parametrize("inject", [_fail_third_fused_copy, _fail_third_handler_job])
def test_a_failed_copy_aborts_capture_and_keeps_the_previous_snapshot(
    tmp_path, monkeypatch, inject
):
    generator = torch.Generator().manual_seed(10)
    layout, _ = split_nhd(8, 0, 1, generator)
    sequences = sequences_for(8, [16, 16], np.random.default_rng(11))
    path = tmp_path / "snap.safetensors"
    capture(layout, sequences, path, source=SOURCE)
    before = path.read_bytes()
    transfer = inject(monkeypatch)
    with pytest.raises(TransferFailedError, match="injected copy failure"):
        capture(
            layout,
            sequences,
            path,
            source=SOURCE,
            transfer=transfer,
            staging=StagingOptions(slot_bytes=2048, num_slots=2),
        )
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap.safetensors"]


def test_a_shared_block_restores_into_every_sequence_that_uses_it(tmp_path):
    generator = torch.Generator().manual_seed(12)
    layout, view = split_nhd(8, 0, 1, generator)
    prefix = np.arange(200, 204)  # one full block, shared
    first = SequenceBlocks("a", np.concatenate([prefix, [1, 2]]), np.array([3, 5]))
    second = SequenceBlocks("b", np.concatenate([prefix, [9]]), np.array([3, 6]))
    path = tmp_path / "snap.safetensors"
    assert capture(layout, [first, second], path, source=SOURCE).num_blocks == 3
    target_layout, target_view = split_nhd(8, 0, 1, generator)
    with Snapshot.open(path) as snap:
        snap.restore(target_layout, {"a": [0, 1], "b": [2, 4]})
    for layer in range(LAYERS):
        for part in L.KV_PARTS:
            source, target = view(layer, part), target_view(layer, part)
            for source_block, target_block in ((3, 0), (5, 1), (3, 2), (6, 4)):
                assert torch.equal(
                    source[source_block].view(torch.int16), target[target_block].view(torch.int16)
                ), (layer, part, source_block, target_block)


@pytest.mark.parametrize(
    ("backend", "runs"), [("auto", "fused"), ("triton", "triton")], ids=["fused", "triton"]
)
def test_an_sm_budget_runs_a_bounded_kernel_bit_exact(tmp_path, monkeypatch, backend, runs):
    # The Triton interpreter runs the same kernels on CPU memory; the budget is the grid bound.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    generator = torch.Generator().manual_seed(13)
    layout, view = packed(4, 0, 1, generator)
    sequence = SequenceBlocks("s", np.arange(7), np.array([2, 0]))
    path = tmp_path / "snap.safetensors"
    transfer = TransferOptions(backend=backend, sm_budget=2)
    result = capture(layout, [sequence], path, source=SOURCE, transfer=transfer)
    assert result.backend == runs
    target_layout, target_view = split_nhd(4, 0, 1, generator)
    with Snapshot.open(path) as snap:
        assert (
            snap.restore(
                target_layout,
                {"s": [3, 1]},
                transfer=TransferOptions(backend=backend, sm_budget=1),
            ).backend
            == runs
        )
    with pytest.raises(ValueError, match="sm_budget bounds a kernel's grid"):
        TransferOptions(backend="torch", sm_budget=1)
    for layer in range(LAYERS):
        for part in L.KV_PARTS:
            assert torch.equal(
                view(layer, part)[torch.tensor([2, 0])].view(torch.int16),
                target_view(layer, part)[torch.tensor([3, 1])].view(torch.int16),
            )
