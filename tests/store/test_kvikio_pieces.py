"""How a first touch's slot read is cut for kvikio's pool (no kvikio or GPU needed: the
reads themselves are tested in ``test_kvikio_reads_gpu.py``)."""

from __future__ import annotations

from kvsnap.store.read import kvikio_reads


def test_a_small_slot_read_is_cut_over_the_threads_and_a_large_one_left_to_kvikio():
    mib = 1 << 20
    # A slot that gives every thread a whole task or more is read as whole runs.
    assert kvikio_reads.read_piece_bytes(64 * mib, 16) == 64 * mib
    assert kvikio_reads.read_piece_bytes(1024 * mib, 16) == 1024 * mib
    # A smaller one is cut into a share per thread (whole 64 KiB, at least 256 KiB).
    assert kvikio_reads.read_piece_bytes(8 * mib, 16) == 512 << 10
    assert kvikio_reads.read_piece_bytes(2 * mib, 16) == kvikio_reads.MIN_PIECE_BYTES
    assert kvikio_reads.read_piece_bytes(3 * mib + 5, 4) == 832 << 10
    assert kvikio_reads.read_piece_bytes(0, 16) == kvikio_reads.MIN_PIECE_BYTES
