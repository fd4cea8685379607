"""The warm pipeline on real CUDA caches (skipped without CUDA): the fused kernel and DMA per
slot for every layout and TP split, restores ordered before the caller's next work, captures
of KV still being written by the caller's stream, and many warm calls reusing one state.
"""

from __future__ import annotations

import pytest
import torch

from kvsnap.errors import RestoreIncompleteError
from kvsnap.pipeline import Pipeline, StagingOptions, fused, slot_pieces
from kvsnap.snapshot import Snapshot, capture
from kvsnap.testing.caches import same_bytes
from tests.support.pipeline_caches import (
    LAYOUTS,
    SOURCE,
    assert_restored,
    caches,
    flip_byte,
    sequences,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("kind", "tp_size", "heads"), LAYOUTS)
def test_every_layout_round_trips_on_the_gpu(tmp_path, kind, tp_size, heads):
    sources, content = caches(kind, heads=heads, tp_size=tp_size, device="cuda", blocks=40)
    used = [[3, 7, 1], [3, 7, 9, 10, 33]]
    path = tmp_path / "snap.safetensors"
    result = capture([c.layout for c in sources], sequences(used), path, source=SOURCE)
    assert result.backend == "fused"
    targets, _ = caches(
        kind, heads=heads, tp_size=tp_size, seed=1, fill=False, device="cuda", blocks=40
    )
    other = "mla" if kind == "mla" else "vllm-hnd"
    targets += caches(other, heads=heads, seed=2, fill=False, device="cuda", blocks=40)[0]
    with Snapshot.open(path) as snap:
        for group in (targets[:tp_size], targets[tp_size:]):
            block_ids = {"s0": [0, 2, 4], "s1": [0, 2, 5, 6, 39]}
            assert snap.restore([c.layout for c in group], block_ids).backend == "fused"
    assert_restored(targets, content, [3, 7, 1, 9, 10, 33], [0, 2, 4, 5, 6, 39])


def test_many_slots_in_flight_restore_bit_exact(tmp_path):
    # Small private slots: dozens of slots, each kernel + DMA on the staging stream while the
    # next slots are read.
    sources, content = caches("vllm-nhd", layers=4, heads=8, blocks=300, device="cuda")
    blocks = list(range(0, 300, 2))
    path = tmp_path / "snap.safetensors"
    staging = StagingOptions(slot_bytes=64 << 10, num_slots=3)
    capture([sources[0].layout], sequences([blocks]), path, source=SOURCE, staging=staging)
    targets, _ = caches(
        "vllm-hnd", layers=4, heads=8, blocks=300, seed=7, fill=False, device="cuda"
    )
    with Snapshot.open(path) as snap:
        snap.restore([targets[0].layout], {"s0": blocks[::-1]}, staging=staging)
    assert_restored(targets, content, blocks, blocks[::-1])


def test_restored_blocks_are_ready_for_the_callers_stream(tmp_path):
    sources, content = caches("vllm-nhd", layers=8, heads=8, blocks=256, device="cuda")
    path = tmp_path / "snap.safetensors"
    capture([sources[0].layout], sequences([list(range(256))]), path, source=SOURCE)
    targets, _ = caches(
        "vllm-nhd", layers=8, heads=8, blocks=256, seed=3, fill=False, device="cuda"
    )
    side = torch.cuda.Stream()
    with torch.cuda.stream(side), Snapshot.open(path) as snap:
        snap.restore([targets[0].layout], {"s0": list(range(256))})
        # No synchronize: work the caller enqueues next on its stream must see the blocks.
        copies = {name: view.clone() for name, view in targets[0].views.items()}
    torch.cuda.synchronize()
    for name, copy in copies.items():
        assert same_bytes(copy, targets[0].expected(content, name, torch.arange(256))), name


def test_a_capture_waits_for_kv_the_callers_stream_is_still_writing(tmp_path):
    sources, content = caches("vllm-nhd", layers=4, heads=8, blocks=64, device="cuda", fill=False)
    cache = sources[0]
    side = torch.cuda.Stream()
    path = tmp_path / "snap.safetensors"
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the "model" is still running
        cache.fill(content)  # ... and writes the KV after that
        capture([cache.layout], sequences([list(range(64))]), path, source=SOURCE)
    targets, _ = caches("vllm-nhd", layers=4, heads=8, blocks=64, seed=4, fill=False, device="cuda")
    with Snapshot.open(path) as snap:
        snap.restore([targets[0].layout], {"s0": list(range(64))})
    assert_restored(targets, content, list(range(64)), list(range(64)))


def test_a_kept_pipeline_restores_many_requests_exactly(tmp_path):
    sources, content = caches("vllm-nhd", layers=32, heads=8, blocks=128, device="cuda")
    source = Pipeline([sources[0].layout])
    targets, _ = caches(
        "vllm-nhd", layers=32, heads=8, blocks=128, seed=5, fill=False, device="cuda"
    )
    target = Pipeline([targets[0].layout])
    for step in range(20):
        blocks = [(step * 7 + i) % 128 for i in range(8)]
        path = tmp_path / f"{step % 2}.safetensors"
        source.capture(sequences([blocks]), path, source=SOURCE)
        placed = [(b + 64) % 128 for b in blocks]
        target.restore(path, {"s0": placed})
        torch.cuda.synchronize()
        assert_restored(targets, content, blocks, placed)


def test_a_corrupt_page_is_not_written_on_the_gpu(tmp_path):
    sources, content = caches("vllm-nhd", layers=3, device="cuda")
    path = tmp_path / "snap.safetensors"
    capture([sources[0].layout], sequences([[4, 5, 6, 7]]), path, source=SOURCE)
    flip_byte(path, "layers.2.key", 1)
    targets, _ = caches("vllm-nhd", layers=3, seed=6, fill=False, device="cuda")
    with Snapshot.open(path) as snap, pytest.raises(RestoreIncompleteError) as caught:
        snap.restore(targets[0].layout, {"s0": [0, 1, 2, 3]})
    assert caught.value.failed_block_ids.tolist() == [1]
    torch.cuda.synchronize()
    target = targets[0]
    assert not target.logical("layers.2.key")[1].view(torch.uint8).any()
    for name in target.views:
        for source_block, target_block in ((4, 0), (5, 1), (6, 2), (7, 3)):
            if (name, target_block) != ("layers.2.key", 1):
                want = target.expected(content, name, torch.tensor([source_block]))[0]
                assert same_bytes(want, target.logical(name)[target_block]), (name, target_block)


@pytest.mark.parametrize("page_bytes", [248, 1024, 1032, 4096, 18432, 32768])
def test_the_page_digest_kernel_matches_xxhash_on_the_gpu(page_bytes):
    import numpy as np
    import xxhash

    from kvsnap.transfer import page_hash

    count = 37
    data = np.random.default_rng(page_bytes).integers(0, 256, page_bytes * count, dtype=np.uint8)
    digests = torch.zeros(count, dtype=torch.int64, device="cuda")
    page_hash.launch_page_digests(
        torch.from_numpy(data).cuda(),
        torch.arange(count, device="cuda") * page_bytes,
        page_bytes,
        torch.from_numpy(page_hash.constant_table(page_bytes)).cuda(),
        digests,
    )
    want = [
        xxhash.xxh3_64_intdigest(data[i * page_bytes : (i + 1) * page_bytes].tobytes())
        for i in range(count)
    ]
    assert digests.cpu().numpy().view(np.uint64).tolist() == want


def test_a_capture_on_the_gpu_stores_the_digests_the_host_computes(tmp_path):
    # The capture's checksums come from the device kernel; a full verify recomputes them all
    # on the host with python-xxhash.
    sources, _ = caches("vllm-hnd", layers=4, heads=8, blocks=64, device="cuda", head_dim=64)
    path = tmp_path / "snap.safetensors"
    capture([sources[0].layout], sequences([list(range(0, 64, 3))]), path, source=SOURCE)
    with Snapshot.open(path) as snap:
        assert snap.verify() == []


def test_chosen_blocks_restore_on_the_gpu(tmp_path):
    sources, content = caches("vllm-hnd", layers=3, blocks=16, device="cuda")
    path = tmp_path / "snap.safetensors"
    capture([sources[0].layout], sequences([[2, 4, 6, 8]]), path, source=SOURCE)
    targets, _ = caches("vllm-nhd", layers=3, blocks=16, seed=4, fill=False, device="cuda")
    with Snapshot.open(path) as snap:
        Pipeline([targets[0].layout]).restore_blocks(snap, [3, 2], [11, 10])
    torch.cuda.synchronize()
    assert_restored(targets, content, [6, 8], [10, 11])


@pytest.mark.parametrize("hot", [False, True])
def test_a_corrupt_page_in_a_late_piece_of_a_slot_is_not_written(tmp_path, monkeypatch, hot):
    # 4 MiB slots go up in pieces of 1 MiB, each checked and scattered once it has arrived: a
    # page refused in the slot's second piece, with the pages before and after it (the first
    # piece, other slots) written, straight from the registered file or through the pinned
    # slot.
    from kvsnap.store.hot import configure_hot_tier

    monkeypatch.setattr(slot_pieces, "UPLOAD_CHUNKS_PER_SLOT", 4)
    monkeypatch.setattr(slot_pieces, "MIN_UPLOAD_CHUNK_BYTES", 1 << 20)

    geometry = {"layers": 8, "heads": 8, "head_dim": 64, "blocks": 256, "device": "cuda"}
    sources, content = caches("vllm-nhd", **geometry)  # 4 KiB pages, 16 MiB: 4 slots
    blocks = list(range(0, 256, 2))
    path = tmp_path / "snap.safetensors"
    capture([sources[0].layout], sequences([blocks]), path, source=SOURCE)
    flip_byte(path, "layers.7.value", len(blocks) - 3)
    path.read_bytes()  # in the page cache: the hot tier registers only resident files
    targets, _ = caches("vllm-nhd", **geometry, seed=8, fill=False)
    configure_hot_tier(1 << 30 if hot else 0, register_after=1)
    try:
        staging = StagingOptions(slot_bytes=4 << 20, num_slots=2, hot=hot)
        kinds: list[str] = []
        with Snapshot.open(path) as snap, pytest.raises(RestoreIncompleteError) as caught:
            snap.restore(
                targets[0].layout,
                {"s0": blocks},
                staging=staging,
                trace=lambda kind, *_: kinds.append(kind),
            )
    finally:
        configure_hot_tier()
    assert ("read" not in kinds) == hot
    refused = blocks[len(blocks) - 3]
    assert caught.value.failed_block_ids.tolist() == [refused]
    torch.cuda.synchronize()
    target = targets[0]
    assert not target.logical("layers.7.value")[refused].view(torch.uint8).any()
    for name in target.views:
        kept = [b for b in blocks if (name, b) != ("layers.7.value", refused)]
        want = target.expected(content, name, torch.tensor(kept))
        assert same_bytes(want, target.logical(name)[kept]), name


@pytest.mark.parametrize("pieces", [1, 4])
def test_slots_released_piece_by_piece_restore_exactly(tmp_path, monkeypatch, pieces):
    # Each piece of a slot releases its bytes of the device buffer to the next slot's upload
    # once scattered: released too early, the next slot's pieces would overwrite pages still
    # being hashed or scattered (refused pages, or wrong bytes written). Every check sleeps
    # ~1 ms on the device first, so the host enqueues the next slot's uploads well before the
    # pages they would overwrite are read (checked failing with the waits removed).
    from kvsnap.store.hot import configure_hot_tier
    from kvsnap.transfer import page_hash
    from kvsnap.transfer.pinned import PinnedPool

    monkeypatch.setattr(slot_pieces, "UPLOAD_CHUNKS_PER_SLOT", pieces)
    monkeypatch.setattr(slot_pieces, "MIN_UPLOAD_CHUNK_BYTES", 1 << 20)
    geometry = {"layers": 8, "heads": 8, "head_dim": 64, "blocks": 256, "device": "cuda"}
    sources, content = caches("vllm-nhd", **geometry)  # 4 KiB pages, 16 MiB: 4 slots
    blocks = list(range(256))
    path = tmp_path / "snap.safetensors"
    capture([sources[0].layout], sequences([blocks]), path, source=SOURCE)
    path.read_bytes()
    pool = PinnedPool(4 << 20, 2)
    configure_hot_tier(1 << 30, register_after=1)
    check = page_hash.launch_page_checks_at_words

    def slow_check(*args):
        torch.cuda._sleep(2_000_000)
        check(*args)

    try:
        for seed, hot, slow in ((3, True, False), (4, False, True), (5, True, True)):
            # The first restore pins and uploads what every later one reuses: nothing the
            # host does after it waits for the device.
            launch = slow_check if slow else check
            monkeypatch.setattr(page_hash, "launch_page_checks_at_words", launch)
            targets, _ = caches("vllm-nhd", **geometry, seed=seed, fill=False)
            with Snapshot.open(path) as snap:
                staging = StagingOptions(pool=pool, hot=hot)
                snap.restore(targets[0].layout, {"s0": blocks[::-1]}, staging=staging)
            assert_restored(targets, content, blocks, blocks[::-1])
    finally:
        configure_hot_tier()
        pool.close()


def test_a_restore_lands_after_what_the_callers_stream_still_writes(tmp_path):
    # The pages go up on their own stream without waiting for the caller, but the scatter
    # into the cache must follow the caller's pending writes to the same blocks.
    sources, content = caches("vllm-nhd", layers=8, heads=8, blocks=128, device="cuda")
    path = tmp_path / "snap.safetensors"
    capture([sources[0].layout], sequences([list(range(128))]), path, source=SOURCE)
    targets, _ = caches(
        "vllm-nhd", layers=8, heads=8, blocks=128, seed=3, fill=False, device="cuda"
    )
    side = torch.cuda.Stream()
    with torch.cuda.stream(side), Snapshot.open(path) as snap:
        torch.cuda._sleep(50_000_000)  # the engine's step is still running ...
        for view in targets[0].views.values():
            view.fill_(7)  # ... and writes these blocks after it
        snap.restore([targets[0].layout], {"s0": list(range(128))})
    torch.cuda.synchronize()
    assert_restored(targets, content, list(range(128)), list(range(128)))


def test_the_ring_never_hands_out_a_slot_whose_copy_still_runs():
    # A restore taking the slot it just gave back would wait for the copy it just enqueued:
    # the device would idle between slots while the host enqueues the next one.
    from kvsnap.pipeline.staging import StagingRing
    from kvsnap.transfer.pinned import PinnedPool

    ring = StagingRing(PinnedPool(4096, 2, lazy=True), owned=True)
    try:
        busy, idle = ring.acquire(), ring.acquire()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(1_000_000_000)  # about half a second of a copy still running
            still_running = torch.cuda.Event()
            still_running.record(stream)
        ring.release(idle)
        ring.release(busy, after=still_running)  # given back last, but its copy runs
        taken = ring.try_acquire()
        assert taken is not None and taken.index == idle.index
        assert not still_running.query()  # taking it waited for nothing
        assert ring.try_acquire() is None  # the only free slot's copy still runs
        assert not still_running.query()
        again = ring.acquire()  # nothing else in flight: wait for the copy
        assert again.index == busy.index and still_running.query()
        ring.release(again)
        ring.release(taken)
    finally:
        ring.finish()


def test_what_while_copying_raises_comes_after_the_device_finished(tmp_path):
    """The overlapped work runs while the device still copies; what it raises is raised only
    once every copy (and page check) has completed, so the caller may free the target."""
    sources, content = caches("vllm-nhd", layers=4, heads=8, blocks=300, device="cuda")
    blocks = list(range(300))
    path = tmp_path / "snap.safetensors"
    capture([sources[0].layout], sequences([blocks]), path, source=SOURCE)
    targets, _ = caches(
        "vllm-nhd", layers=4, heads=8, blocks=300, seed=7, fill=False, device="cuda"
    )
    called: list[int] = []

    def refuse() -> None:
        called.append(1)
        raise ValueError("refused while the device copies")

    with pytest.raises(ValueError, match="while the device copies"):
        Pipeline([targets[0].layout]).restore(
            path, {"s0": blocks}, staging=StagingOptions(slot_bytes=1 << 20), while_copying=refuse
        )
    assert called == [1]
    # No synchronisation here: the restore waited for its copies before raising.
    assert_restored(targets, content, blocks, blocks)


@pytest.mark.parametrize("damaged", [None, 1, 5])
def test_hot_chunks_share_slots_and_a_damaged_one_fails_only_its_block(
    tmp_path, monkeypatch, damaged
):
    # An engine's prefix as six small chunk files, every one hot: four go up in one slot (one
    # submit), two in the next. A page flipped in one chunk is refused and named in that
    # chunk's block; every other block of every chunk lands.
    import contextlib

    import numpy as np

    from kvsnap.store.hot import configure_hot_tier

    geometry = {"layers": 4, "heads": 8, "head_dim": 64, "blocks": 48, "device": "cuda"}
    sources, content = caches("vllm-nhd", **geometry)  # 4 KiB pages: 256 KiB a chunk
    paths = []
    for number in range(6):
        path = tmp_path / f"chunk{number}.safetensors"
        chunk_blocks = list(range(8 * number, 8 * number + 8))
        capture([sources[0].layout], sequences([chunk_blocks]), path, source=SOURCE)
        paths.append(path)
    if damaged is not None:
        flip_byte(paths[damaged], "layers.1.key", 3)
    for path in paths:
        path.read_bytes()  # resident: the hot tier registers only page-cached files
    submits = []
    real = fused.FusedMover.submit
    monkeypatch.setattr(
        fused.FusedMover, "submit", lambda self, *a, **k: submits.append(1) or real(self, *a, **k)
    )
    targets, _ = caches("vllm-nhd", **geometry, seed=9, fill=False)
    destination = np.arange(48)[::-1].copy()
    configure_hot_tier(1 << 30, register_after=1)
    try:
        with contextlib.ExitStack() as stack:
            snapshots = [stack.enter_context(Snapshot.open(path)) for path in paths]
            jobs = [
                (snapshot, np.arange(8), destination[8 * number : 8 * number + 8])
                for number, snapshot in enumerate(snapshots)
            ]
            staging = StagingOptions(slot_bytes=1 << 20, num_slots=2, hot=True)
            if damaged is None:
                Pipeline(targets[0].layout).restore_chunks(jobs, staging=staging)
            else:
                with pytest.raises(RestoreIncompleteError) as caught:
                    Pipeline(targets[0].layout).restore_chunks(jobs, staging=staging)
                refused = int(destination[8 * damaged + 3])
                assert caught.value.failed_block_ids.tolist() == [refused]
    finally:
        configure_hot_tier()
    assert len(submits) == 2
    kept = [block for block in range(48) if damaged is None or block != 8 * damaged + 3]
    assert_restored(targets, content, kept, destination[kept].tolist())


def test_a_hot_restore_loads_as_much_as_the_device_buffer_whatever_the_job_size(
    tmp_path, monkeypatch
):
    # A slot and a half of SMALL_SLOT_BYTES is a small job (two small slots when read, below
    # LARGE_DEVICE_RESTORE_JOB_BYTES), but nothing is read into a slot of hot files: one load
    # of up to the device buffer's size.
    from kvsnap.pipeline import options
    from kvsnap.store.hot import configure_hot_tier

    probe, _ = caches("vllm-nhd", layers=8, heads=8, head_dim=64, blocks=1, fill=False)
    geometry_of = probe[0].layout.geometry
    block_bytes = geometry_of.canonical_page_size_bytes * len(geometry_of.tensor_names())
    num_blocks = 3 * options.SMALL_SLOT_BYTES // (2 * block_bytes)
    job_bytes = num_blocks * block_bytes
    assert options.SMALL_SLOT_BYTES < job_bytes < options.LARGE_DEVICE_RESTORE_JOB_BYTES
    assert job_bytes <= options.LARGE_SLOT_BYTES
    geometry = {"layers": 8, "heads": 8, "head_dim": 64, "blocks": num_blocks, "device": "cuda"}
    sources, content = caches("vllm-nhd", **geometry)
    blocks = list(range(num_blocks))
    path = tmp_path / "snap.safetensors"
    capture([sources[0].layout], sequences([blocks]), path, source=SOURCE)
    path.read_bytes()
    submits = []
    real = fused.FusedMover.submit
    monkeypatch.setattr(
        fused.FusedMover, "submit", lambda self, *a, **k: submits.append(1) or real(self, *a, **k)
    )
    configure_hot_tier(1 << 30, register_after=1)
    try:
        for hot, slots in ((False, 2), (True, 1)):
            submits.clear()
            targets, _ = caches("vllm-nhd", **geometry, seed=11, fill=False)
            staging = StagingOptions(hot=hot)
            with Snapshot.open(path) as snap:
                snap.restore(targets[0].layout, {"s0": blocks[::-1]}, staging=staging)
            assert len(submits) == slots, hot
            assert_restored(targets, content, blocks, blocks[::-1])
    finally:
        configure_hot_tier()


def test_pinned_tables_of_many_callers_pools_stay_bounded(tmp_path):
    # A table is kept per staging slot; slots of pools a caller made (here 40 pools kept alive,
    # so no slot address repeats, of two 8 KiB slots each, both used by a 16 KiB restore: 80
    # slots) must not each hold theirs for the life of the process.
    from kvsnap.pipeline.staging import MAX_PINNED_TABLES, device_staging
    from kvsnap.transfer.pinned import PinnedPool

    sources, content = caches("vllm-nhd", layers=2, heads=4, blocks=16, device="cuda")
    blocks = list(range(16))
    path = tmp_path / "snap.safetensors"
    capture([sources[0].layout], sequences([blocks]), path, source=SOURCE)
    pools = [PinnedPool(8 << 10, 2) for _ in range(40)]
    try:
        for pool in pools:
            targets, _ = caches(
                "vllm-nhd", layers=2, heads=4, blocks=16, device="cuda", seed=2, fill=False
            )
            with Snapshot.open(path) as snap:
                snap.restore(
                    targets[0].layout, {"s0": blocks}, staging=StagingOptions(pool=pool, hot=False)
                )
            assert_restored(targets, content, blocks, blocks)
        assert len(device_staging(torch.device("cuda"))._pinned) <= MAX_PINNED_TABLES
    finally:
        for pool in pools:
            pool.close()
