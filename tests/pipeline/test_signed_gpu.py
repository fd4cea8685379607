"""Signed snapshots on real CUDA caches (skipped without CUDA): a signed capture's BLAKE3
digests come from the device kernel, and a restore with the key checks every page against its
signed digest on the device before the scatter, whatever carries the page to the device
buffer: a first touch from the file (read threads, or kvikio where it is installed), the hot
tier's mapping, hot chunks packed several to a slot. The bad page is a real xxh3-64 forgery
(tests/support/xxh3_forgery.py), which the xxh3 check would let through.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from kvsnap import format as fmt
from kvsnap.errors import RestoreIncompleteError
from kvsnap.format.signing import KeyRing
from kvsnap.pipeline import Pipeline, StagingOptions, fused
from kvsnap.snapshot import Snapshot, capture
from kvsnap.store import SnapshotReader, tuning
from kvsnap.store.hot import configure_hot_tier
from kvsnap.transfer import page_blake3
from tests.support.pipeline_caches import SOURCE, assert_restored, caches, sequences
from tests.support.xxh3_forgery import forge_page

pytestmark = pytest.mark.gpu

KEYS = KeyRing([bytes(range(32))])
#: 4 KiB pages, 16 MiB of KV: several slots.
GEOMETRY = {"layers": 8, "heads": 8, "head_dim": 64, "blocks": 256, "device": "cuda"}
BLOCKS = list(range(0, 256, 2))
FORGED = ("layers.7.value", len(BLOCKS) - 3)


def _page_span(path: Path, name: str, block: int) -> tuple[int, int]:
    with SnapshotReader(path) as reader:
        _, entry = reader.locate(name)
        page = reader.page_bytes
    return entry.begin + block * page, entry.begin + (block + 1) * page


def _plant(path: Path, name: str, block: int, forged: bytes) -> None:
    begin, _ = _page_span(path, name, block)
    with open(path, "r+b") as handle:
        handle.seek(begin)
        handle.write(forged)


def _forgery(path: Path, name: str, block: int) -> bytes:
    begin, end = _page_span(path, name, block)
    page = path.read_bytes()[begin:end]
    other = np.random.default_rng(3).integers(0, 256, end - begin, dtype=np.uint8).tobytes()
    return forge_page(other, xxhash.xxh3_64_intdigest(page))


@pytest.mark.parametrize("directory", ["tmp", "shm"])
def test_a_signed_capture_takes_every_pages_blake3_from_the_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, directory: str
) -> None:
    host_hashed, device_launches = [], []
    real_host, real_device = fmt.page_digests, page_blake3.launch_page_blake3_at_words
    monkeypatch.setattr(fmt, "page_digests", lambda *a: host_hashed.append(1) or real_host(*a))
    monkeypatch.setattr(
        page_blake3,
        "launch_page_blake3_at_words",
        lambda *a, **k: device_launches.append(1) or real_device(*a, **k),
    )
    # These pages are too few for the mapped write to pay off: take that path all the same.
    monkeypatch.setattr(tuning, "MAPPED_WRITE_MIN_BYTES", 0)
    sources, _ = caches("vllm-nhd", **GEOMETRY)
    where = tmp_path if directory == "tmp" else Path("/dev/shm")
    path = where / f"signed-{tmp_path.name}.safetensors"
    try:
        result = capture([sources[0].layout], sequences([BLOCKS]), path, source=SOURCE, keys=KEYS)
        assert device_launches and not host_hashed
        if directory == "shm":
            assert result.data_path == "dma", result.dma_refused
        monkeypatch.undo()
        with Snapshot.open(path, keys=KEYS) as snap:  # every page against its digest, on the host
            assert snap.page_binding == "blake3" and snap.verify() == []
    finally:
        path.unlink(missing_ok=True)


@pytest.mark.parametrize("hot", [False, True])
def test_a_forged_page_is_refused_on_the_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hot: bool
) -> None:
    # 4 MiB slots in pieces of 1 MiB: the forged page lies in a late piece of the last slot.
    from kvsnap.pipeline import slot_pieces

    monkeypatch.setattr(slot_pieces, "UPLOAD_CHUNKS_PER_SLOT", 4)
    monkeypatch.setattr(slot_pieces, "MIN_UPLOAD_CHUNK_BYTES", 1 << 20)
    sources, content = caches("vllm-nhd", **GEOMETRY)
    path = tmp_path / "signed.safetensors"
    capture([sources[0].layout], sequences([BLOCKS]), path, source=SOURCE, keys=KEYS)
    forged = _forgery(path, *FORGED)
    targets, _ = caches("vllm-nhd", **GEOMETRY, seed=8, fill=False)
    checks = []
    real = fused.PageChecks.launch
    monkeypatch.setattr(
        fused.PageChecks, "launch", lambda self, *a: checks.append(self.blake3) or real(self, *a)
    )
    configure_hot_tier(1 << 30 if hot else 0, register_after=1)
    kinds: list[str] = []
    try:
        _plant(path, *FORGED, forged)  # the signature, which covers no page, still holds
        path.read_bytes()  # resident: the hot tier registers only page-cached files
        with Snapshot.open(path, keys=KEYS) as snap:
            staging = StagingOptions(slot_bytes=4 << 20, num_slots=2, hot=hot)
            with pytest.raises(RestoreIncompleteError) as caught:
                snap.restore(
                    targets[0].layout,
                    {"s0": BLOCKS},
                    staging=staging,
                    trace=lambda kind, *_: kinds.append(kind),
                )
    finally:
        configure_hot_tier()
    assert checks and all(checks)  # every piece checked by BLAKE3 on the device
    assert "verify" not in kinds and ("read" not in kinds) == hot
    refused = BLOCKS[FORGED[1]]
    assert caught.value.failed_block_ids.tolist() == [refused]
    assert "BLAKE3" in str(caught.value.__cause__)
    torch.cuda.synchronize()
    target = targets[0]
    assert not target.logical(FORGED[0])[refused].view(torch.uint8).any()
    kept = [block for block in BLOCKS if block != refused]
    assert_restored(targets, content, kept, kept)


def test_packed_hot_signed_chunks_refuse_only_the_forged_page(tmp_path: Path) -> None:
    geometry = {"layers": 4, "heads": 8, "head_dim": 64, "blocks": 48, "device": "cuda"}
    sources, content = caches("vllm-nhd", **geometry)  # 4 KiB pages: 256 KiB a chunk
    paths = []
    for number in range(6):
        path = tmp_path / f"chunk{number}.safetensors"
        chunk_blocks = list(range(8 * number, 8 * number + 8))
        capture([sources[0].layout], sequences([chunk_blocks]), path, source=SOURCE, keys=KEYS)
        paths.append(path)
    forged = _forgery(paths[1], "layers.1.key", 3)
    targets, _ = caches("vllm-nhd", **geometry, seed=9, fill=False)
    destination = np.arange(48)[::-1].copy()
    _plant(paths[1], "layers.1.key", 3, forged)
    for path in paths:
        path.read_bytes()  # resident: the hot tier registers only page-cached files
    configure_hot_tier(1 << 30, register_after=1)
    try:
        with contextlib.ExitStack() as stack:
            snapshots = [stack.enter_context(Snapshot.open(p, keys=KEYS)) for p in paths]
            jobs = [
                (snapshot, np.arange(8), destination[8 * number : 8 * number + 8])
                for number, snapshot in enumerate(snapshots)
            ]
            staging = StagingOptions(slot_bytes=1 << 20, num_slots=2, hot=True)
            with pytest.raises(RestoreIncompleteError) as caught:
                Pipeline(targets[0].layout).restore_chunks(jobs, staging=staging)
    finally:
        configure_hot_tier()
    refused = int(destination[8 + 3])
    assert caught.value.failed_block_ids.tolist() == [refused]
    kept = [block for block in range(48) if block != 8 + 3]
    assert_restored(targets, content, kept, destination[kept].tolist())
