"""The warm pipeline: fused copies for every layout, cost flat in layers and ranks, warm state
reused, and a restore that never writes a page failing its checksum.

Real caches of random bytes (``kvsnap.testing.caches``, whose logical views are an oracle
independent of the copy runs) and real snapshot files.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from kvsnap.engines.vllm import BlockOrder, vllm_layout
from kvsnap.errors import IncompatibleSnapshotError, RestoreIncompleteError
from kvsnap.pipeline import Pipeline, StagingOptions, TransferOptions, fused, shared_tables
from kvsnap.snapshot import SequenceBlocks, Snapshot, capture
from kvsnap.store.base import tuning
from kvsnap.testing.caches import make_cache, same_bytes
from kvsnap.transfer import page_copy, page_table, pinned
from tests.support.pipeline_caches import (
    BLOCK,
    LAYOUTS,
    SOURCE,
    assert_restored,
    caches,
    flip_byte,
    sequences,
)


@pytest.mark.parametrize(("kind", "tp_size", "heads"), LAYOUTS)
def test_every_layout_round_trips_through_the_fused_copy(tmp_path, kind, tp_size, heads):
    sources, content = caches(kind, heads=heads, tp_size=tp_size)
    used = [[3, 7, 1], [3, 7, 9, 10]]  # a shared prefix block, and partial last blocks
    path = tmp_path / "snap.safetensors"
    result = capture([c.layout for c in sources], sequences(used), path, source=SOURCE)
    assert result.backend == "fused"
    targets, _ = caches(kind, heads=heads, tp_size=tp_size, seed=1, fill=False)
    other = "mla" if kind == "mla" else "vllm-hnd"
    targets += caches(other, heads=heads, seed=2, fill=False)[0]
    with Snapshot.open(path) as snap:
        for group in (targets[:tp_size], targets[tp_size:]):
            restored = snap.restore(
                [c.layout for c in group], {"s0": [0, 2, 4], "s1": [0, 2, 5, 6]}
            )
            assert restored.backend == "fused"
    assert_restored(targets, content, [3, 7, 1, 9, 10], [0, 2, 4, 5, 6])


@pytest.mark.parametrize(
    ("kind", "tp_size", "heads"),
    [("vllm-hnd", 2, 4), ("mla", 1, 0), ("contiguous", 1, 4), ("packed", 1, 4)],
)
def test_the_kernel_itself_round_trips_under_the_triton_interpreter(
    tmp_path, monkeypatch, kind, tp_size, heads
):
    # The GPU kernel's index arithmetic, run on host memory by Triton's interpreter.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launches = []
    real = fused.launch_kernel
    monkeypatch.setattr(fused, "launch_kernel", lambda *a: launches.append(1) or real(*a))
    monkeypatch.setattr(fused, "run_on_cpu", None)  # the numpy path must not run
    sources, content = caches(kind, heads=heads, tp_size=tp_size, blocks=6)
    path = tmp_path / "snap.safetensors"
    capture([c.layout for c in sources], sequences([[5, 0]]), path, source=SOURCE)
    targets, _ = caches(kind, heads=heads, tp_size=tp_size, seed=3, blocks=6, fill=False)
    with Snapshot.open(path) as snap:
        snap.restore([c.layout for c in targets], {"s0": [1, 4]})
    assert launches == [1, 1]
    assert_restored(targets, content, [5, 0], [1, 4])


def test_one_copy_per_slot_whatever_the_number_of_layers_and_ranks(tmp_path, monkeypatch):
    groups_per_call: list[int] = []
    real = fused.run_on_cpu
    monkeypatch.setattr(
        fused, "run_on_cpu", lambda copies: groups_per_call.append(len(copies)) or real(copies)
    )
    for layers, tp_size in ((2, 1), (24, 4)):
        groups_per_call.clear()
        sources, content = caches("vllm-nhd", layers=layers, heads=4, tp_size=tp_size)
        path = tmp_path / f"{layers}-{tp_size}.safetensors"
        capture([c.layout for c in sources], sequences([[2, 6]]), path, source=SOURCE)
        targets, _ = caches("vllm-nhd", layers=layers, heads=4, tp_size=tp_size, seed=4, fill=False)
        with Snapshot.open(path) as snap:
            snap.restore([c.layout for c in targets], {"s0": [8, 3]})
        # One copy each way, of one fragment group: every layer, K/V and rank together.
        assert groups_per_call == [1, 1], (layers, tp_size)
        assert_restored(targets, content, [2, 6], [8, 3])


def test_head_slices_of_many_ranks_are_copied_without_a_descriptor_per_fragment(
    tmp_path, monkeypatch
):
    # One KV head per rank: each rank's share of a page is a fragment per token. Those are
    # copied in vectorized batches of pages; unrolled into descriptors, 1,280 tensors cost
    # several times more per byte than 64 (issue 26).
    descriptors: list[int] = []
    real = page_copy.copy_descriptors
    monkeypatch.setattr(
        page_copy,
        "copy_descriptors",
        lambda src, dst, sizes: descriptors.append(len(sizes)) or real(src, dst, sizes),
    )
    sources, content = caches("vllm-nhd", layers=5, heads=4, tp_size=4, blocks=12)
    path = tmp_path / "heads.safetensors"
    capture([c.layout for c in sources], sequences([[2, 6, 7, 11]]), path, source=SOURCE)
    targets, _ = caches("vllm-nhd", layers=5, heads=4, tp_size=4, seed=4, fill=False)
    with Snapshot.open(path) as snap:
        snap.restore([c.layout for c in targets], {"s0": [8, 3, 0, 5]})
    assert descriptors == []
    assert_restored(targets, content, [2, 6, 7, 11], [8, 3, 0, 5])


def test_dim_major_cpu_blocks_are_copied_as_strided_views(tmp_path, monkeypatch):
    # vLLM's CPU attention backend keeps each head's keys dim-major inside a block: the
    # token-major canonical page reaches the cache as one fragment per element. Those pages
    # are a transpose, copied as strided views: no fragment gather, no descriptor (issue 26).
    layers, blocks, tokens, heads, head_dim = 3, 9, 8, 2, 5
    t, h, d = np.indices((tokens, heads, head_dim))
    plane = h * 2 * tokens * head_dim
    order = BlockOrder(
        key=plane + d * tokens + t, value=plane + tokens * head_dim + t * head_dim + d
    )
    generator = torch.Generator().manual_seed(3)
    shape = (blocks, heads, tokens, 2 * head_dim)
    source = [
        torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=generator).view(
            torch.bfloat16
        )
        for _ in range(layers)
    ]
    target = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(layers)]

    def layout(caches):
        return vllm_layout(
            caches,
            backend="CPU_ATTN",
            kv_cache_layout="LBHNC",
            head_size=head_dim,
            num_kv_heads=heads,
            block_order=order,
        )

    paths: list[tuple] = []
    for name in ("copy_page_fragments", "copy_descriptors"):
        real = getattr(page_copy, name)
        monkeypatch.setattr(
            page_copy, name, lambda *a, name=name, real=real: paths.append((name,)) or real(*a)
        )
    real_strided = page_copy.copy_strided_pages
    monkeypatch.setattr(
        page_copy,
        "copy_strided_pages",
        lambda pattern, *a: (
            paths.append((pattern.shape, pattern.fragment_bytes)) or real_strided(pattern, *a)
        ),
    )
    used, placed = [7, 2, 4], [0, 5, 8]
    sequence = SequenceBlocks("s0", np.arange(len(used) * tokens), np.array(used))
    path = tmp_path / "dim-major.safetensors"
    capture([layout(source)], [sequence], path, source=SOURCE)
    with Snapshot.open(path) as snap:
        for layer, cache in enumerate(source):
            flat = cache[used].reshape(len(used), -1)
            for part, offsets in (("key", order.key), ("value", order.value)):
                logical = flat[:, torch.from_numpy(offsets)].reshape(-1, heads, head_dim)
                got = snap.sequence_kv("s0", f"layers.{layer}.{part}")
                assert same_bytes(got, logical), (layer, part)
        snap.restore([layout(target)], {"s0": placed})
    for layer in range(layers):
        assert same_bytes(target[layer][placed], source[layer][used])
        untouched = [block for block in range(blocks) if block not in placed]
        assert not target[layer][untouched].view(torch.int16).any()
    # Per call one strided copy of the keys (every layer's pages together: a transpose of
    # (tokens, heads, dims) elements) and one of the values (token-major head_dim rows).
    key_copy, value_copy = ((tokens, heads, head_dim), 2), ((tokens, heads), 2 * head_dim)
    assert sorted(paths) == sorted([key_copy, value_copy] * 2)


def test_a_second_call_reuses_the_page_table_and_the_pinned_staging(tmp_path, monkeypatch):
    sources, _ = caches("vllm-nhd", layers=3)
    layouts = [c.layout for c in sources]
    tables, pools = [], []
    real_table, real_pool = page_table.PageTable.__init__, pinned.PinnedPool.__init__
    monkeypatch.setattr(
        page_table.PageTable, "__init__", lambda self, *a: tables.append(1) or real_table(self, *a)
    )
    monkeypatch.setattr(
        pinned.PinnedPool,
        "__init__",
        lambda self, *a, **k: pools.append(1) or real_pool(self, *a, **k),
    )
    path = tmp_path / "snap.safetensors"
    capture(layouts, sequences([[1, 2]]), path, source=SOURCE)
    first = (len(tables), len(pools))
    for _ in range(3):
        capture(layouts, sequences([[1, 2]]), path, source=SOURCE)
        with Snapshot.open(path) as snap:
            snap.restore(layouts, {"s0": [4, 5]})
    assert (len(tables), len(pools)) == first  # nothing built or pinned again
    assert first[0] == 1


def test_a_kept_pipeline_serves_many_calls(tmp_path):
    sources, content = caches("vllm-hnd", layers=3, tp_size=2)
    targets, _ = caches("vllm-nhd", layers=3, seed=9, fill=False)
    source_pipeline = Pipeline([c.layout for c in sources])
    target_pipeline = Pipeline([c.layout for c in targets])
    for step in range(3):
        path = tmp_path / f"{step}.safetensors"
        source_pipeline.capture(sequences([[step, step + 4]]), path, source=SOURCE)
        target_pipeline.restore(path, {"s0": [10, step]})
        assert_restored(targets, content, [step, step + 4], [10, step])


@pytest.mark.parametrize("inline", [True, False], ids=["calling-thread", "read-threads"])
@pytest.mark.parametrize("slot_pages", [1, 3, 1000])
def test_a_page_failing_its_checksum_never_reaches_the_cache(
    tmp_path, monkeypatch, slot_pages, inline
):
    """On both read paths of a host cache: slots read and checked on the calling thread
    (``INLINE_READ_MAX_BYTES`` holds them) and on the read threads (it is 0)."""
    monkeypatch.setattr(tuning, "INLINE_READ_MAX_BYTES", 1 << 20 if inline else 0)
    read_on: set[bool] = set()

    def trace(kind, _started, _finished, _nbytes):
        if kind in ("read", "verify"):
            read_on.add(threading.get_ident() == threading.main_thread().ident)

    sources, content = caches("vllm-nhd", layers=3)
    path = tmp_path / "snap.safetensors"
    capture([sources[0].layout], sequences([[4, 5, 6, 7]]), path, source=SOURCE)
    flip_byte(path, "layers.1.value", 2)  # snapshot block 2 = device block 6 of the source
    targets, _ = caches("vllm-nhd", layers=3, seed=6, fill=False)
    target = targets[0]
    page = target.layout.geometry.canonical_page_size_bytes
    staging = StagingOptions(slot_bytes=max(4096, slot_pages * page), num_slots=2)
    with Snapshot.open(path) as snap, pytest.raises(RestoreIncompleteError) as caught:
        snap.restore(target.layout, {"s0": [0, 1, 2, 3]}, staging=staging, trace=trace)
    assert read_on == {inline}
    assert caught.value.failed_block_ids.tolist() == [2]
    assert "layers.1.value" in str(caught.value)
    for name in target.views:
        for source_block, target_block in ((4, 0), (5, 1), (6, 2), (7, 3)):
            got = target.logical(name)[target_block]
            if (name, target_block) == ("layers.1.value", 2):
                assert not got.view(torch.uint8).any(), "a corrupt page reached the cache"
            else:
                want = target.expected(content, name, torch.tensor([source_block]))[0]
                assert same_bytes(want, got), (name, target_block)


def test_restore_refuses_bad_requests_before_writing_anything(tmp_path):
    sources, _ = caches("vllm-nhd")
    path = tmp_path / "snap.safetensors"
    capture([sources[0].layout], sequences([[1, 2]]), path, source=SOURCE)
    targets, _ = caches("vllm-nhd", seed=2, fill=False)
    layout = targets[0].layout
    sliding, _ = caches("vllm-nhd", seed=2, fill=False)
    with Snapshot.open(path) as snap:
        with pytest.raises(IncompatibleSnapshotError, match="no sequence 'nope'"):
            snap.restore(layout, {"nope": [0, 1]})
        with pytest.raises(ValueError, match="integers"):
            snap.restore(layout, {"s0": [0.0, 1.5]})
        swa = make_cache(
            "vllm-nhd",
            num_layers=2,
            num_blocks=12,
            block_size=BLOCK,
            num_kv_heads=4,
            head_dim=8,
            attention_types=["full", "sliding"],
        )
        with pytest.raises(IncompatibleSnapshotError, match="attention type of layer 1"):
            snap.restore(swa.layout, {"s0": [0, 1]})
    for cache in targets:
        assert not any(view.view(torch.uint8).any() for view in cache.views.values())
    assert shared_tables.MAX_SHARED_TABLES >= 1 and sliding


@pytest.mark.parametrize("backend", ["auto", "cpu"])
def test_a_capture_refuses_block_ids_outside_the_cache_and_writes_nothing(tmp_path, backend):
    # The copies read where an id points: past the cache's tensor, or (far past) a crash.
    sources, _ = caches("vllm-nhd")  # 12 blocks
    path = tmp_path / "snap.safetensors"
    path.write_bytes(b"the previous snapshot")
    for bad in (12, -1, 1 << 40):
        outside = f"sequence 's1': block id {bad} is outside the cache's 12 blocks"
        with pytest.raises(ValueError, match=outside):
            capture(
                [sources[0].layout],
                sequences([[1, 2], [1, bad]]),
                path,
                source=SOURCE,
                transfer=TransferOptions(backend=backend),
            )
    assert path.read_bytes() == b"the previous snapshot"
    assert list(tmp_path.iterdir()) == [path]


def test_a_slot_of_whole_tensors_is_one_file_write_and_verifies(tmp_path, monkeypatch):
    from kvsnap.store.write.writer import SnapshotWriter

    writes: list[int] = []
    real = SnapshotWriter._submit_write

    def recorded(self, shard, offset, view):
        writes.append(view.nbytes)
        return real(self, shard, offset, view)

    monkeypatch.setattr(SnapshotWriter, "_submit_write", recorded)
    # 4 tokens x 8 heads x 64 x fp16: 4096-byte pages, so the tensors lie back to back.
    sources, content = caches("vllm-nhd", layers=6, heads=8, blocks=16, head_dim=64)
    path = tmp_path / "snap.safetensors"
    result = capture([sources[0].layout], sequences([[1, 2, 3, 4]]), path, source=SOURCE)
    assert writes == [result.num_blocks * 12 * sources[0].layout.geometry.canonical_page_size_bytes]
    with Snapshot.open(path) as snap:
        assert snap.verify() == []
    targets, _ = caches("vllm-nhd", layers=6, heads=8, blocks=16, seed=8, fill=False, head_dim=64)
    with Snapshot.open(path) as snap:
        snap.restore([targets[0].layout], {"s0": [5, 6, 7, 8]})
    assert_restored(targets, content, [1, 2, 3, 4], [5, 6, 7, 8])


def test_a_pipeline_restores_chosen_blocks_of_a_snapshot(tmp_path):
    # What an engine whose own prefix cache already holds a chunk's first blocks does.
    sources, content = caches("vllm-hnd", layers=3, blocks=16)
    path = tmp_path / "snap.safetensors"
    capture([sources[0].layout], sequences([[2, 4, 6, 8]]), path, source=SOURCE)
    targets, _ = caches("vllm-nhd", layers=3, blocks=16, seed=4, fill=False)
    pipeline = Pipeline([targets[0].layout])
    with Snapshot.open(path) as snap:
        result = pipeline.restore_blocks(snap, [3, 2], [11, 10])  # snapshot blocks 2 and 3 only
        assert result.num_blocks == 2 and result.backend == "fused"
        with pytest.raises(IncompatibleSnapshotError, match="outside the snapshot's 4 blocks"):
            pipeline.restore_blocks(snap, [4], [0])
        with pytest.raises(IncompatibleSnapshotError, match="two different snapshot blocks"):
            pipeline.restore_blocks(snap, [0, 1], [5, 5])
    assert_restored(targets, content, [6, 8], [10, 11])
    untouched = [block for block in range(16) if block not in (10, 11)]
    for view in targets[0].views.values():
        assert not view[torch.tensor(untouched)].view(torch.uint8).any()


def test_captures_and_restores_take_large_slots_from_their_own_thresholds(monkeypatch):
    from kvsnap.pipeline import options, staging

    monkeypatch.setattr(options, "LARGE_JOB_BYTES", 1000)
    monkeypatch.setattr(options, "LARGE_RESTORE_JOB_BYTES", 5000)
    monkeypatch.setattr(options, "LARGE_DEVICE_RESTORE_JOB_BYTES", 3000)
    small, large, default = options.SMALL_SLOT_BYTES, options.LARGE_SLOT_BYTES, StagingOptions()
    assert staging.staging_ring(default, 256, 999).slot_bytes == small
    assert staging.staging_ring(default, 256, 1000).slot_bytes == large
    assert staging.staging_ring(default, 256, 1000, restore=True).slot_bytes == small
    assert staging.staging_ring(default, 256, 3000, restore=True).slot_bytes == small
    assert staging.staging_ring(default, 256, 5000, restore=True).slot_bytes == large
    # A restore the device checks takes large slots from its own, lower threshold.
    on_device = {"restore": True, "device_checked": True}
    assert staging.staging_ring(default, 256, 2999, **on_device).slot_bytes == small
    assert staging.staging_ring(default, 256, 3000, **on_device).slot_bytes == large


@pytest.mark.parametrize("slot_pages", [1, 1000])
def test_while_copying_runs_once_after_the_last_copy_is_enqueued(tmp_path, slot_pages):
    """The caller's overlapped work runs once per restore, after every slot was moved (on a
    CPU cache the copies are done by then), whatever the number of slots."""
    sources, content = caches("vllm-nhd", layers=3)
    path = tmp_path / "snap.safetensors"
    capture([sources[0].layout], sequences([[4, 5, 6, 7]]), path, source=SOURCE)
    targets, _ = caches("vllm-nhd", layers=3, seed=6, fill=False)
    page = targets[0].layout.geometry.canonical_page_size_bytes
    staging = StagingOptions(slot_bytes=max(4096, slot_pages * page), num_slots=2)
    seen_written: list[bool] = []

    def while_copying() -> None:
        last = targets[0].logical("layers.2.value")[3]
        want = targets[0].expected(content, "layers.2.value", torch.tensor([7]))[0]
        seen_written.append(same_bytes(want, last))

    Pipeline([targets[0].layout]).restore(
        path, {"s0": [0, 1, 2, 3]}, staging=staging, while_copying=while_copying
    )
    assert seen_written == [True]
    assert_restored(targets, content, [4, 5, 6, 7], [0, 1, 2, 3])


def test_what_while_copying_raises_is_raised_once_the_copies_are_complete(tmp_path):
    sources, content = caches("vllm-nhd", layers=3)
    path = tmp_path / "snap.safetensors"
    capture([sources[0].layout], sequences([[4, 5, 6, 7]]), path, source=SOURCE)
    targets, _ = caches("vllm-nhd", layers=3, seed=6, fill=False)

    def refuse() -> None:
        raise IncompatibleSnapshotError("the caller's check refused the snapshot")

    with pytest.raises(IncompatibleSnapshotError, match="caller's check"):
        Pipeline([targets[0].layout]).restore(path, {"s0": [0, 1, 2, 3]}, while_copying=refuse)
    assert_restored(targets, content, [4, 5, 6, 7], [0, 1, 2, 3])
