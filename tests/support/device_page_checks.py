"""The child process of tests/pipeline/test_device_page_checks.py: a restore's device step
(:meth:`FusedMover.check_and_scatter <kvsnap.pipeline.fused.FusedMover.check_and_scatter>`)
run by Triton's interpreter, which must be chosen before Triton is imported (``python -m
tests.support.device_page_checks DIRECTORY`` with ``TRITON_INTERPRET=1``). Prints one JSON
object: the BLAKE3 verdicts, whether every page that passed landed where it belongs and the
refused one's target stayed untouched, and the xxh3 verdicts of the same slot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import xxhash

from kvsnap.format.signing import KeyRing
from kvsnap.pipeline import fused
from kvsnap.pipeline.page_checks import PageChecks, hash_constants
from kvsnap.pipeline.shared_tables import shared_page_table
from kvsnap.snapshot import Snapshot, capture
from kvsnap.transfer import page_blake3
from kvsnap.transfer.page_copy import kernel_table
from kvsnap.transfer.plan import Direction
from tests.support.pipeline_caches import SOURCE, caches, sequences
from tests.support.xxh3_forgery import forge_page

KEYS = KeyRing([bytes(range(32))])
USED = [3, 7, 1, 9]  # device blocks of the sequence: snapshot blocks 0..3
FORGED = 5  # the slot's page replaced by a forgery (tensor 1, block 1)


def _slot(tmp_path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, list[str]]:
    """Every page of a signed snapshot as one slot (tensor-major), its signed digests, each
    page's stored xxh3-64, the page size and the layer names."""
    sources, _ = caches("vllm-nhd", heads=4, blocks=12)
    path = tmp_path / "signed.safetensors"
    capture([c.layout for c in sources], sequences([USED]), path, source=SOURCE, keys=KEYS)
    with Snapshot.open(path, keys=KEYS) as snap:
        reader = snap.reader
        names, blocks, page = list(reader.layer_names), reader.num_blocks, reader.page_bytes
        tensors = np.repeat(np.arange(len(names)), blocks)
        order = np.tile(np.arange(blocks), len(names))
        slot = np.empty(len(tensors) * page, dtype=np.uint8)
        offsets = np.arange(len(tensors), dtype=np.int64) * page
        assert not len(reader.read_slot_async(tensors, order, offsets, slot).result())
        signed = reader.page_digest_table
        assert signed is not None
        stored = reader.stored_checksums(tensors, order)
        return slot, signed.reshape(-1, 32).copy(), stored, page, names


def _scatter(slot: np.ndarray, checks_of: object, page: int, names: list[str], blocks: int):
    """Check and scatter ``slot`` into a fresh cache through the fused mover's device step:
    the verdicts and the target cache."""
    targets, _ = caches("vllm-nhd", heads=4, blocks=12, seed=9, fill=False)
    (target,) = targets
    table = shared_page_table([target.layout], Direction.HOST_TO_DEVICE)
    mover = fused.FusedMover(table, Direction.HOST_TO_DEVICE, None)
    # A mover on a host cache hashes nothing itself: the xxh3 kernel's constants, as a CUDA
    # mover keeps them.
    mover._constants = hash_constants(torch.device("cpu"), page)
    count = len(slot) // page
    tensors = np.repeat(np.arange(len(names)), blocks)
    snapshot_blocks = np.tile(np.arange(blocks), len(names))
    buffer = torch.from_numpy(slot)
    offsets = np.arange(count, dtype=np.int64) * page
    copies = table.copies(
        Direction.HOST_TO_DEVICE,
        tensors,
        snapshot_blocks,  # snapshot block b goes to target block b
        buffer.data_ptr() + offsets,
        snapshot_blocks,
    )
    device_table = torch.from_numpy(kernel_table(copies))
    words = torch.from_numpy(offsets // 8)
    checks = checks_of(words, count)
    mover.check_and_scatter(buffer, copies, device_table, checks, 0, count)
    return checks.page_ok.numpy(), target


def main(directory: Path) -> dict[str, object]:
    slot, signed, stored, page, names = _slot(directory)
    assert page_blake3.supports(page)
    blocks = len(USED)
    original = slot[FORGED * page : (FORGED + 1) * page].copy()
    other = np.random.default_rng(2).integers(0, 256, page, dtype=np.uint8).tobytes()
    forged = forge_page(other, xxhash.xxh3_64_intdigest(original.tobytes()))
    slot[FORGED * page : (FORGED + 1) * page] = np.frombuffer(forged, np.uint8)

    def blake3_checks(words: torch.Tensor, count: int) -> PageChecks:
        digests = torch.from_numpy(signed.view(np.int32).copy())  # (pages, 8) int32 words
        return PageChecks(words, digests, torch.full((count,), 7, dtype=torch.int64), True)

    def xxh3_checks(words: torch.Tensor, count: int) -> PageChecks:
        expected = torch.from_numpy(stored.view(np.int64).copy())
        return PageChecks(words, expected, torch.full((count,), 7, dtype=torch.int64), False)

    verdicts, target = _scatter(slot, blake3_checks, page, names, blocks)
    landed = []
    for index in range(len(verdicts)):
        tensor, block = divmod(index, blocks)
        bytes_there = target.logical(names[tensor])[block].contiguous().view(torch.uint8).numpy()
        expected = np.zeros(page, np.uint8) if index == FORGED else slot[index * page :][:page]
        landed.append(bytes_there.tobytes() == expected.tobytes())
    unchecked, _ = _scatter(slot, xxh3_checks, page, names, blocks)
    return {
        "forged": FORGED,
        "blake3": verdicts.tolist(),
        "landed": landed,
        "xxh3": unchecked.tolist(),
    }


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
