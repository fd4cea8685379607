"""Captures of CUDA caches into memory-backed files by DMA (skipped without CUDA): the device
copies every page straight into the new file's registered mapping, and the file is the one
the pinned-staging path writes, byte for byte; its checksums are the pages' xxh3-64, a signed
capture verifies with its key, and an interrupted capture leaves the old file. The next
capture into the directory takes the spare file made (and registered) in the background, and
the mapping's unregistration after the publish finishes, reported until it has.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from kvsnap.errors import SignatureError
from kvsnap.format.signing import KeyRing
from kvsnap.pipeline import Pipeline, StagingOptions
from kvsnap.snapshot import Snapshot, capture
from kvsnap.store.base import tuning
from kvsnap.store.hot import mapping_release
from kvsnap.store.hot.mapped_file import MappedFile
from kvsnap.store.hot.spare_files import spare_files
from kvsnap.store.hot.tier import configure_hot_tier, hot_tier
from tests.support.pipeline_caches import SOURCE, assert_restored, caches, sequences
from tests.support.store_helpers import spare_names, stored_and_actual_digests, temp_files

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("mapped_from_any_size")]

#: Two sequences sharing their first two blocks (stored once), as tests/pipeline restores them.
USED = [[3, 7, 1], [3, 7, 9, 10, 33]]
SOURCE_BLOCKS = [3, 7, 1, 9, 10, 33]
TARGET_BLOCKS = {"s0": [0, 2, 4], "s1": [0, 2, 5, 6, 39]}
RESTORED_AT = [0, 2, 4, 5, 6, 39]
#: Small slots: many slots per capture, most spanning several tensors.
SMALL_SLOTS = StagingOptions(slot_bytes=48 << 10, num_slots=3)


def _traced_capture(layouts, path: Path, **options) -> tuple[object, list[str]]:
    kinds: list[str] = []
    result = capture(
        layouts,
        sequences(USED),
        path,
        source=SOURCE,
        reproducible=True,
        trace=lambda kind, *_: kinds.append(kind),
        **options,
    )
    return result, kinds


@pytest.mark.parametrize(
    ("kind", "tp_size", "staging"),
    [("vllm-nhd", 1, None), ("vllm-hnd", 2, SMALL_SLOTS), ("packed", 1, SMALL_SLOTS)],
)
def test_a_dma_capture_is_the_staged_capture_byte_for_byte(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch, kind: str, tp_size: int, staging
) -> None:
    sources, content = caches(
        kind, layers=4, heads=8, head_dim=64, tp_size=tp_size, blocks=40, device="cuda"
    )
    layouts = [cache.layout for cache in sources]
    by_dma, staged = shm_dir / "dma.safetensors", shm_dir / "staged.safetensors"
    result, kinds = _traced_capture(layouts, by_dma, staging=staging)
    assert result.data_path == "dma" and result.dma_refused is None
    assert "setup.map" in kinds and "writer.placed" in kinds
    assert "write" not in kinds and "hash" not in kinds  # no pwrite, no host hashing
    monkeypatch.setattr(tuning, "MAPPED_WRITE_MIN_BYTES", 1 << 62)
    forced, kinds = _traced_capture(layouts, staged, staging=staging)
    assert forced.data_path == "write" and "write" in kinds
    assert by_dma.read_bytes() == staged.read_bytes()
    assert temp_files(shm_dir) == []
    stored, actual = stored_and_actual_digests(by_dma)
    assert stored == actual
    targets, _ = caches(
        kind,
        layers=4,
        heads=8,
        head_dim=64,
        tp_size=tp_size,
        blocks=40,
        seed=3,
        fill=False,
        device="cuda",
    )
    with Snapshot.open(by_dma) as snap:
        assert snap.verify() == []
        snap.restore([cache.layout for cache in targets], TARGET_BLOCKS)
    torch.cuda.synchronize()
    assert_restored(targets, content, SOURCE_BLOCKS, RESTORED_AT)


def test_a_signed_dma_capture_verifies_with_its_key(shm_dir: Path) -> None:
    sources, _ = caches("vllm-nhd", layers=4, heads=8, head_dim=64, blocks=40, device="cuda")
    keys = KeyRing([b"a secret of thirty-two bytes...."])
    path = shm_dir / "signed.safetensors"
    result, _ = _traced_capture([sources[0].layout], path, keys=keys)
    assert result.data_path == "dma"
    with Snapshot.open(path, keys=keys) as snap:
        assert snap.verify() == []
    with pytest.raises(SignatureError):
        Snapshot.open(path, keys=KeyRing([b"another secret of thirty-two byte"]))
    stored, actual = stored_and_actual_digests(path)
    assert stored == actual


def test_a_pipeline_kept_warm_captures_by_dma_each_time(shm_dir: Path) -> None:
    sources, _ = caches("vllm-nhd", layers=4, heads=8, head_dim=64, blocks=40, device="cuda")
    pipeline = Pipeline([sources[0].layout])
    for step in range(3):
        path = shm_dir / f"req-{step}.safetensors"
        result = pipeline.capture(sequences(USED), path, source=SOURCE, staging=SMALL_SLOTS)
        assert result.data_path == "dma"
        with Snapshot.open(path) as snap:
            assert snap.verify() == []
    assert temp_files(shm_dir) == []


def test_a_disk_or_a_small_capture_keeps_the_staged_path(
    shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvsnap.store.write.local_file import memory_backed

    sources, _ = caches("vllm-nhd", layers=4, heads=8, head_dim=64, blocks=40, device="cuda")
    layouts = [sources[0].layout]
    if not memory_backed(str(tmp_path)):
        result, _ = _traced_capture(layouts, tmp_path / "disk.safetensors")
        assert result.data_path == "write" and result.dma_refused == "not a memory-backed file"
    monkeypatch.setattr(tuning, "MAPPED_WRITE_MIN_BYTES", 1 << 30)
    result, _ = _traced_capture(layouts, shm_dir / "small.safetensors")
    assert result.data_path == "write" and "under the" in str(result.dma_refused)
    cpu_sources, _ = caches("vllm-nhd", layers=4, heads=8, head_dim=64, blocks=40)
    monkeypatch.setattr(tuning, "MAPPED_WRITE_MIN_BYTES", 0)
    result, _ = _traced_capture([cpu_sources[0].layout], shm_dir / "cpu.safetensors")
    assert result.data_path == "write" and "CUDA device" in str(result.dma_refused)


def test_an_interrupted_dma_capture_leaves_the_old_file(shm_dir: Path) -> None:
    sources, _ = caches("vllm-nhd", layers=4, heads=8, head_dim=64, blocks=40, device="cuda")
    layouts = [sources[0].layout]
    path = shm_dir / "snap.safetensors"
    capture(layouts, sequences([[1, 2]]), path, source=SOURCE)
    before = path.read_bytes()
    calls = []

    def interrupt(done: int, total: int) -> None:
        calls.append(done)
        if len(calls) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        capture(
            layouts,
            sequences(USED),
            path,
            source=SOURCE,
            staging=SMALL_SLOTS,
            progress=interrupt,
        )
    assert path.read_bytes() == before
    assert temp_files(shm_dir) == []
    # The device's copies into the aborted file's mapping all ended before it was unmapped:
    # the next capture runs normally.
    result, _ = _traced_capture(layouts, path)
    assert result.data_path == "dma"
    with Snapshot.open(path) as snap:
        assert snap.verify() == []


@pytest.mark.usefixtures("spare_capture_files")
def test_a_dma_capture_from_the_spare_file_restores_bit_exact(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sources, content = caches("vllm-nhd", layers=4, heads=8, head_dim=64, blocks=40, device="cuda")
    layouts = [sources[0].layout]
    first, kinds = _traced_capture(layouts, shm_dir / "first.safetensors")
    assert first.data_path == "dma" and "setup.map.populate" in kinds
    [spare] = spare_names(shm_dir)  # made and registered in the background
    held, registered = spare_files().held_bytes()
    assert registered == held == (shm_dir / spare).stat().st_size
    assert hot_tier().stats().capture_registered_bytes >= registered
    second, kinds = _traced_capture(layouts, shm_dir / "second.safetensors")
    assert second.data_path == "dma"
    assert "setup.map.spare" in kinds
    assert "setup.map.populate" not in kinds and "setup.map.register" not in kinds
    assert not (shm_dir / spare).exists()
    monkeypatch.setattr(tuning, "MAPPED_WRITE_MIN_BYTES", 1 << 62)
    staged, _ = _traced_capture(layouts, shm_dir / "staged.safetensors")
    assert staged.data_path == "write"
    assert (shm_dir / "second.safetensors").read_bytes() == (
        shm_dir / "staged.safetensors"
    ).read_bytes()
    targets, _ = caches(
        "vllm-nhd", layers=4, heads=8, head_dim=64, blocks=40, seed=3, fill=False, device="cuda"
    )
    with Snapshot.open(shm_dir / "second.safetensors") as snap:
        assert snap.verify() == []
        snap.restore([targets[0].layout], TARGET_BLOCKS)
    torch.cuda.synchronize()
    assert_restored(targets, content, SOURCE_BLOCKS, RESTORED_AT)
    assert temp_files(shm_dir) == []


@pytest.mark.usefixtures("spare_capture_files")
def test_a_spare_made_unregistered_is_registered_to_the_file_s_end_when_taken(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spare is made to a whole number of huge pages and cut to the capture's size when
    taken; registering it then covers the file's pages only (the driver refuses pages past
    the end), so the capture stays on the DMA path, and the restore after it runs."""
    monkeypatch.setattr(tuning, "SPARE_CAPTURE_FILES_REGISTERED", False)
    sources, content = caches("vllm-nhd", layers=4, heads=8, head_dim=64, blocks=40, device="cuda")
    layouts = [sources[0].layout]
    _traced_capture(layouts, shm_dir / "first.safetensors")
    [spare] = spare_names(shm_dir)
    spare_size = (shm_dir / spare).stat().st_size
    assert spare_files().held_bytes()[1] == 0  # made, not registered
    second, kinds = _traced_capture(layouts, shm_dir / "second.safetensors")
    assert "setup.map.spare" in kinds and "setup.map.register" in kinds
    assert spare_size > (shm_dir / "second.safetensors").stat().st_size  # it was cut
    assert second.data_path == "dma"
    targets, _ = caches(
        "vllm-nhd", layers=4, heads=8, head_dim=64, blocks=40, seed=3, fill=False, device="cuda"
    )
    with Snapshot.open(shm_dir / "second.safetensors") as snap:
        snap.restore([targets[0].layout], TARGET_BLOCKS)
    torch.cuda.synchronize()
    assert_restored(targets, content, SOURCE_BLOCKS, RESTORED_AT)


def test_pending_unregistration_finishes_and_is_reported_until_then(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The capture returns with its mapping still registered (the release slowed to 0.5 s);
    a hot restore of the file registers it again meanwhile and restores bit-exact; the
    release then finishes and nothing a capture registered is left."""
    monkeypatch.setattr(tuning, "SPARE_CAPTURE_FILES_BYTES", 0)
    real_close = MappedFile.close

    def slow_close(mapped: MappedFile) -> None:
        time.sleep(0.5)
        real_close(mapped)

    monkeypatch.setattr(MappedFile, "close", slow_close)
    sources, content = caches("vllm-nhd", layers=4, heads=8, head_dim=64, blocks=40, device="cuda")
    path = shm_dir / "snap.safetensors"
    result, _ = _traced_capture([sources[0].layout], path)
    assert result.data_path == "dma"
    size = path.stat().st_size
    assert mapping_release.pending_bytes() == (size, size)
    assert hot_tier().stats().capture_registered_bytes == size
    targets, _ = caches(
        "vllm-nhd", layers=4, heads=8, head_dim=64, blocks=40, seed=3, fill=False, device="cuda"
    )
    configure_hot_tier(1 << 30, register_after=1)
    try:
        with Snapshot.open(path) as snap:
            snap.restore([targets[0].layout], TARGET_BLOCKS, staging=StagingOptions(hot=True))
        torch.cuda.synchronize()
        assert hot_tier().stats().registrations == 1
        assert_restored(targets, content, SOURCE_BLOCKS, RESTORED_AT)
    finally:
        configure_hot_tier()
    mapping_release.wait_for_releases()
    assert mapping_release.pending_bytes() == (0, 0)
    assert hot_tier().stats().capture_registered_bytes == 0
