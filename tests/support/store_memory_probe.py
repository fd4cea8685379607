"""Write, read back and verify a snapshot far larger than the staging memory; report peak RSS.

Run as ``python tests/support/store_memory_probe.py PATH TOTAL_MIB``; prints one JSON object:
the resident-set high-water mark before the work (after imports and the staging pool) and
after it, and the seconds each phase took. ``tests/store/test_reader.py`` runs it in a
subprocess so the measurement covers nothing but this snapshot.
"""

from __future__ import annotations

import json
import resource
import sys
import time

import numpy as np

from kvsnap import format as fmt
from kvsnap.layout import KVGeometry
from kvsnap.store import SnapshotReader, SnapshotWriter
from kvsnap.transfer.pinned import PinnedPool

SLOT_BYTES = 8 << 20
NUM_SLOTS = 4


def high_water_mark_kib() -> int:
    """VmHWM: the peak resident set size so far, in KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def chunk_pattern(base: np.ndarray, tensor: int, chunk: int, out: np.ndarray) -> None:
    """Deterministic, distinct bytes per (tensor, chunk): the random base plus a counter."""
    np.add(base[: len(out)], np.uint8((tensor * 131 + chunk * 7 + 1) % 256), out=out)


def main(path: str, total_mib: int) -> dict[str, float]:
    geometry = KVGeometry(
        num_layers=4, block_size=16, dtype="bfloat16", num_kv_heads=8, head_dim=128
    )
    page = geometry.canonical_page_size_bytes  # 32 KiB
    names = geometry.tensor_names()
    num_blocks = (total_mib << 20) // (page * len(names))
    tokens = np.arange(num_blocks * geometry.block_size, dtype=np.int64) % 32000
    chain = fmt.prefix_hash_chain(tokens, geometry.block_size)
    metadata = fmt.SnapshotMetadata(
        geometry=geometry,
        source=fmt.SourceInfo("probe", "0", "probe", None, ""),
        sequences=[fmt.SequenceRecord("probe", tokens, np.arange(num_blocks), tuple(chain))],
        num_blocks=num_blocks,
        capture_encoding="probe",
        tp_size=1,
    )
    blocks_per_slot = SLOT_BYTES // page
    base = np.random.default_rng(0).integers(0, 256, SLOT_BYTES, dtype=np.uint8)
    expected = np.empty(SLOT_BYTES, dtype=np.uint8)
    pool = PinnedPool(SLOT_BYTES, NUM_SLOTS, pin=False)
    for index in range(NUM_SLOTS):
        pool.slot(index).as_numpy()[:] = 0  # touch the staging memory: it belongs to the baseline
    baseline = high_water_mark_kib()

    started = time.perf_counter()
    writer = SnapshotWriter(path, metadata)
    for tensor, name in enumerate(writer.tensor_order()):
        for chunk, first in enumerate(range(0, num_blocks, blocks_per_slot)):
            count = min(blocks_per_slot, num_blocks - first)
            slot = pool.acquire()
            view = slot.as_numpy(count * page)
            chunk_pattern(base, tensor, chunk, view)
            writer.write_pages(name, view).add_done_callback(
                lambda _f, slot=slot: pool.release(slot)
            )
    info = writer.commit()
    write_seconds = time.perf_counter() - started

    started = time.perf_counter()
    with SnapshotReader(path) as reader:
        for tensor, name in enumerate(names):
            for chunk, first in enumerate(range(0, num_blocks, blocks_per_slot)):
                count = min(blocks_per_slot, num_blocks - first)
                with pool.borrowed() as slot:
                    view = slot.as_numpy(count * page)
                    reader.read_pages(name, np.arange(first, first + count), view)
                    chunk_pattern(base, tensor, chunk, expected[: count * page])
                    if not np.array_equal(view, expected[: count * page]):
                        raise SystemExit(f"{name} chunk {chunk} read back different bytes")
        read_seconds = time.perf_counter() - started
        started = time.perf_counter()
        problems = reader.verify()
        verify_seconds = time.perf_counter() - started
    if problems:
        raise SystemExit(f"verify found {problems[:3]}")
    pool.close()
    return {
        "snapshot_bytes": info.num_bytes,
        "baseline_kib": baseline,
        "peak_kib": high_water_mark_kib(),
        "write_s": write_seconds,
        "read_s": read_seconds,
        "verify_s": verify_seconds,
        "direct_io": info.direct_io,
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))))
