"""How a first touch's slot read is cut for kvikio's pool (no kvikio or GPU needed: the
reads themselves are tested in ``test_kvikio_reads_gpu.py``)."""

from __future__ import annotations

from kvsnap.store import kvikio_reads


def test_a_slot_read_is_cut_in_pieces_of_one_task_each_spread_over_the_threads():
    mib = 1 << 20
    assert kvikio_reads.read_piece_bytes(64 * mib, 16) == 4 * mib  # a large slot: 16 tasks
    assert kvikio_reads.read_piece_bytes(1024 * mib, 16) == kvikio_reads.TASK_BYTES
    assert kvikio_reads.read_piece_bytes(8 * mib, 16) == 512 << 10  # a small one: every thread
    assert kvikio_reads.read_piece_bytes(2 * mib, 16) == kvikio_reads.MIN_PIECE_BYTES
    assert kvikio_reads.read_piece_bytes(3 * mib + 5, 4) == 832 << 10  # whole 64 KiB
