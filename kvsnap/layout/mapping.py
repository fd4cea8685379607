"""How local page bytes map onto the canonical page: copy runs, writer election, tiling.

:class:`CopyRun` is a group of equally spaced fragments; a :class:`CanonicalPageMapping` is one
rank's runs for one (layer, part) plus its writer election. :func:`strided_page_runs` derives
the runs from a tensor view's strides (every layout constructor goes through it),
:func:`head_shard` assigns KV heads to tensor-parallel ranks, and :func:`check_tiling` proves
that the elected writers of all ranks cover every canonical byte exactly once.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from dataclasses import dataclass

import numpy as np

from kvsnap.caches import register_cache_clear
from kvsnap.errors import LayoutError


@dataclass(frozen=True)
class CopyRun:
    """``num_fragments`` equal fragments from a local page onto the canonical page.

    Fragment ``i`` covers ``[local_offset + i*local_stride, +fragment_size)`` of the local page
    (offsets from the block's start in its :class:`CacheTensor`) and lands at
    ``[canonical_offset + i*canonical_stride, +fragment_size)`` of the canonical page.
    """

    local_offset: int
    local_stride: int
    canonical_offset: int
    canonical_stride: int
    fragment_size: int
    num_fragments: int

    @property
    def num_bytes(self) -> int:
        return self.fragment_size * self.num_fragments


@dataclass(frozen=True)
class CanonicalPageMapping:
    """How one rank's local page bytes tile (part of) the canonical page.

    When several ranks hold identical bytes (GQA with more TP ranks than KV heads, or an MLA
    latent replicated on every rank), only one of them writes each block at capture:
    block ``b`` is written by the rank whose ``writer_index == b % num_writers``.
    """

    canonical_page_size_bytes: int
    runs: tuple[CopyRun, ...]
    num_writers: int = 1
    writer_index: int = 0

    @functools.cached_property
    def local_bytes(self) -> int:
        """Bytes of the canonical page this rank holds (computed once: the planner's hot path)."""
        return sum(run.num_bytes for run in self.runs)

    @functools.cached_property
    def digest(self) -> bytes:
        """A 16-byte digest of everything the mapping says, computed once: the warm pipeline
        keys its page tables on it instead of hashing every run on every call."""
        fields = [self.canonical_page_size_bytes, self.num_writers, self.writer_index]
        for run in self.runs:
            fields += [run.local_offset, run.local_stride, run.canonical_offset]
            fields += [run.canonical_stride, run.fragment_size, run.num_fragments]
        return hashlib.blake2b(struct.pack(f"<{len(fields)}q", *fields), digest_size=16).digest()

    def is_writer(self, canonical_block_ids: np.ndarray) -> np.ndarray:
        """Boolean mask: which of these snapshot blocks this rank writes at capture."""
        return np.asarray(canonical_block_ids) % self.num_writers == self.writer_index

    def fragments(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Unrolled ``(local_offsets, canonical_offsets, sizes)``, one entry per fragment."""
        local, canonical, sizes = [], [], []
        for run in self.runs:
            steps = np.arange(run.num_fragments, dtype=np.int64)
            local.append(run.local_offset + steps * run.local_stride)
            canonical.append(run.canonical_offset + steps * run.canonical_stride)
            sizes.append(np.full(run.num_fragments, run.fragment_size, dtype=np.int64))
        if not sizes:
            empty = np.empty(0, dtype=np.int64)
            return empty, empty, empty
        return np.concatenate(local), np.concatenate(canonical), np.concatenate(sizes)


def coverage(mapping: CanonicalPageMapping) -> np.ndarray:
    """How many times each canonical byte is written by ``mapping`` (int16 per byte)."""
    counts = np.zeros(mapping.canonical_page_size_bytes + 1, dtype=np.int32)
    _, canonical, sizes = mapping.fragments()
    np.add.at(counts, canonical, 1)
    np.add.at(counts, canonical + sizes, -1)
    return np.cumsum(counts[:-1])


# --------------------------------------------------------------------------------------------
# Deriving copy runs from strides


# Every layer of a cache usually has the same page shape and strides: the runs are derived once.
@functools.lru_cache(maxsize=256)
def strided_page_runs(
    *,
    element_size: int,
    offset_bytes: int,
    token_stride: int,
    head_stride: int,
    dim_stride: int,
    block_size: int,
    num_local_heads: int,
    head_dim: int,
    num_total_heads: int,
    first_head: int,
) -> tuple[CopyRun, ...]:
    """Copy runs from a strided local page onto the canonical token-major page.

    The local page holds ``num_local_heads`` heads starting at global head ``first_head``; its
    element ``(token, head, dim)`` sits ``offset_bytes + token*token_stride + head*head_stride``
    bytes from the block start (strides in elements, except ``offset_bytes``). The canonical
    page holds all ``num_total_heads`` heads contiguously, token-major. Fragments adjacent on
    both sides are merged, and equally spaced fragments are folded into one run, so an NHD
    TP=1 page becomes a single run and an HND page one run per head.
    """
    if dim_stride != 1:
        raise LayoutError("the head dimension must be contiguous (stride 1) in the engine cache")
    fragment = head_dim * element_size
    tokens = np.arange(block_size, dtype=np.int64)[:, None]
    heads = np.arange(num_local_heads, dtype=np.int64)[None, :]
    local = offset_bytes + (tokens * token_stride + heads * head_stride) * element_size
    canonical = (tokens * num_total_heads + first_head + heads) * fragment
    return fold_fragments(local.ravel(), canonical.ravel(), fragment)


register_cache_clear(strided_page_runs.cache_clear)


def fold_fragments(
    local: np.ndarray, canonical: np.ndarray, fragment_size: int
) -> tuple[CopyRun, ...]:
    """Compress equal-size fragments into as few :class:`CopyRun` as possible.

    Fragments contiguous on both sides are first merged into larger ones (when they all group
    evenly), then arithmetic progressions become runs; both the canonical and the local order
    are tried and the shorter result is kept. The bytes described never change.
    """
    by_canonical = _fold_in_order(
        local, canonical, fragment_size, np.argsort(canonical, kind="stable")
    )
    by_local = _fold_in_order(local, canonical, fragment_size, np.argsort(local, kind="stable"))
    return by_canonical if len(by_canonical) <= len(by_local) else by_local


def _fold_in_order(
    local: np.ndarray, canonical: np.ndarray, size: int, order: np.ndarray
) -> tuple[CopyRun, ...]:
    local, canonical = local[order], canonical[order]
    if len(local) > 1:
        adjacent = (np.diff(local) == size) & (np.diff(canonical) == size)
        group = _uniform_group_length(adjacent)
        local, canonical, size = local[::group], canonical[::group], size * group
    runs: list[CopyRun] = []
    start, count = 0, len(local)
    while start < count:
        end = start + 1
        local_step = canonical_step = size
        if end < count:
            local_step = int(local[end] - local[start])
            canonical_step = int(canonical[end] - canonical[start])
            end += 1
            while (
                end < count
                and local[end] - local[end - 1] == local_step
                and canonical[end] - canonical[end - 1] == canonical_step
            ):
                end += 1
        runs.append(
            CopyRun(
                int(local[start]),
                local_step,
                int(canonical[start]),
                canonical_step,
                size,
                end - start,
            )
        )
        start = end
    return tuple(runs)


def _uniform_group_length(adjacent: np.ndarray) -> int:
    """Largest g such that fragments form consecutive groups of g that are internally contiguous."""
    count = len(adjacent) + 1
    breaks = np.flatnonzero(~adjacent) + 1  # indices where a new group starts
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [count])))
    group = int(np.gcd.reduce(lengths))
    return max(group, 1)


# --------------------------------------------------------------------------------------------
# Tensor-parallel head assignment


@dataclass(frozen=True)
class HeadShard:
    """Which global KV heads one TP rank holds, and whether it is an elected writer."""

    first_head: int
    num_local_heads: int
    num_writers: int
    writer_index: int


def head_shard(num_kv_heads: int, tp_rank: int, tp_size: int) -> HeadShard:
    """The KV heads a TP rank holds, the way vLLM and Megatron shard them.

    With ``tp_size <= num_kv_heads`` each rank holds a contiguous slice; with more ranks than
    heads, ``tp_size / num_kv_heads`` consecutive ranks replicate one head and take turns writing.
    """
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise LayoutError(f"{num_kv_heads} KV heads do not split evenly over TP {tp_size}")
        per_rank = num_kv_heads // tp_size
        return HeadShard(tp_rank * per_rank, per_rank, 1, 0)
    if tp_size % num_kv_heads:
        raise LayoutError(f"TP {tp_size} is not a multiple of {num_kv_heads} KV heads")
    replication = tp_size // num_kv_heads
    return HeadShard(tp_rank // replication, 1, replication, tp_rank % replication)
