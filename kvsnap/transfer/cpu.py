"""The ``cpu`` backend: host-to-host copies of a job's descriptors.

Serves caches that live in host memory (CPU engines, the test suite). Large descriptors are
one ``memmove`` each (ctypes releases the GIL around it). Small descriptors — a head-major
``DynamicCache`` page is one ``head_dim``-sized fragment per token and head — would spend far
more time in the Python loop than in copying, so descriptors of equal size are copied together
with one numpy gather and one scatter over views of the address ranges they touch whose
elements are fragments of that size.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from kvsnap.transfer.base import CopyBackend, CopyJob

#: Descriptors up to this size are copied in vectorized groups of equal size; larger ones one
#: ``memmove`` each. Measured on a 2-core x86 host (32 MiB in fragments to scattered places):
#: the vectorized path took 0.13x of a memmove per descriptor at 256 bytes, 0.6x at 4 KiB,
#: 0.78x at 8 KiB and broke even at 16 KiB.
VECTORIZED_MAX_BYTES = 8192
#: Bytes a vectorized batch gathers before scattering them: small enough that the gathered
#: fragments are still in the CPU's cache when they are scattered.
BATCH_BYTES = 1 << 20


def _fragment_view(low: int, high: int, size: int) -> np.ndarray:
    """Host memory ``[low, high)`` as overlapping ``size``-byte elements, one starting at every
    byte: element ``i`` is the ``size`` bytes at ``low + i`` (no copy, no ownership)."""
    buffer = (ctypes.c_uint8 * (high - low)).from_address(low)
    fragment = np.dtype((np.void, size))
    return np.ndarray((high - low - size + 1,), dtype=fragment, buffer=buffer, strides=(1,))


def copy_equal_size(src: np.ndarray, dst: np.ndarray, size: int) -> None:
    """Copy ``size`` bytes from every ``src[i]`` to ``dst[i]`` with vectorized numpy indexing.

    Each side of the copy is one view of the address range it touches whose elements are
    ``size``-byte fragments, so numpy moves a whole fragment per index (one ``memcpy``), not
    one word. Destinations must not overlap each other or the sources (true of every kvsnap
    plan).
    """
    src_low, dst_low = int(src.min()), int(dst.min())
    src_view = _fragment_view(src_low, int(src.max()) + size, size)
    dst_view = _fragment_view(dst_low, int(dst.max()) + size, size)
    per_batch = max(1, BATCH_BYTES // size)
    for start in range(0, len(src), per_batch):
        batch_src = src[start : start + per_batch] - src_low
        dst_view[dst[start : start + per_batch] - dst_low] = src_view[batch_src]


def copy_page_fragments(
    src_bases: np.ndarray,
    src_offsets: np.ndarray,
    dst_bases: np.ndarray,
    dst_offsets: np.ndarray,
    size: int,
) -> None:
    """For every page ``i`` and fragment ``j``, copy ``size`` bytes from host address
    ``src_bases[i] + src_offsets[j]`` to ``dst_bases[i] + dst_offsets[j]``.

    A page table's group copy, executed without unrolling its fragments into descriptors:
    the fragment addresses of a batch of pages are one broadcast, the copy one gather and one
    scatter of ``size``-byte elements. Destinations must not overlap each other or the sources.
    """
    if len(src_bases) == 0 or len(src_offsets) == 0:
        return
    src_low = int(src_bases.min()) + int(src_offsets.min())
    dst_low = int(dst_bases.min()) + int(dst_offsets.min())
    src_view = _fragment_view(src_low, int(src_bases.max()) + int(src_offsets.max()) + size, size)
    dst_view = _fragment_view(dst_low, int(dst_bases.max()) + int(dst_offsets.max()) + size, size)
    src_relative, dst_relative = src_offsets - src_low, dst_offsets - dst_low
    per_batch = max(1, BATCH_BYTES // (size * len(src_offsets)))
    for start in range(0, len(src_bases), per_batch):
        src_index = src_bases[start : start + per_batch, None] + src_relative
        dst_view[dst_bases[start : start + per_batch, None] + dst_relative] = src_view[src_index]


def copy_descriptors(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> None:
    """Copy ``sizes[i]`` bytes from host address ``src[i]`` to ``dst[i]`` for every ``i``."""
    if len(sizes) == 0:
        return
    small = sizes <= VECTORIZED_MAX_BYTES
    if small.any():
        small_src, small_dst, small_sizes = src[small], dst[small], sizes[small]
        for size in np.unique(small_sizes):
            same = small_sizes == size
            copy_equal_size(small_src[same], small_dst[same], int(size))
    large = np.flatnonzero(~small)
    memmove = ctypes.memmove
    for s, d, n in zip(
        src[large].tolist(), dst[large].tolist(), sizes[large].tolist(), strict=True
    ):
        memmove(d, s, n)


class CpuBackend(CopyBackend):
    """Host-to-host descriptor execution; synchronous, for caches in host memory only."""

    name = "cpu"

    @classmethod
    def probe(cls, device: torch.device) -> str | None:
        if device.type != "cpu":
            # Dereferencing device addresses from the host would crash the process.
            return f"it copies host memory only, the cache is on {device}"
        return None

    def execute(self, job: CopyJob) -> None:
        descriptors = job.descriptors
        copy_descriptors(descriptors.src, descriptors.dst, descriptors.sizes)
