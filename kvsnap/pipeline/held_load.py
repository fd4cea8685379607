"""Restores of snapshot files held whole in memory into a cache in host memory.

The vLLM connector's scheduler reads a checked chunk whole as it opens
(``read_whole_max_bytes``) and hands it to the worker open; a restore of such a file into a
cache in host memory needs no staging slot, no read and no per-slot bookkeeping: its pages are
checked against their stored xxh3-64 where they lie and copied from there into the cache. That
is the only way such a file is restored (:meth:`Pipeline._move_in
<kvsnap.pipeline.Pipeline._move_in>` sends every held part here), and it is built so that a
chunk costs the same hundred-odd Python calls whatever its layers:

* per cache (:class:`HeldLoader`, kept by the pipeline for its mover's page table): per
  fragment group of the page table, the cache's whole address range as one numpy view whose
  first axis steps a word at a time (the page as a strided array behind it:
  :class:`~kvsnap.transfer.strided.StridedPattern`), and per row where block 0 lies on that
  axis and how far one block moves it;
* per chunk shape (the layer tensors' offsets in the file, bounded cache keyed by their bytes):
  per group, where each row's canonical page starts in the file and whether those starts are
  evenly spaced;
* per chunk: the stored checksums of the pages loaded (one fancy index), their xxh3-64 (one
  call per run of pages that follow each other in the file: one per chunk as captures lay them
  out; for a reader opened with keys of a file signed with BLAKE3 page digests, their BLAKE3
  digests against the signed ones instead), and per group one numpy assignment: a strided
  view of the held bytes (every page of every row, when nothing failed and the blocks follow
  each other) scattered into the cache view at the target blocks. A page that fails its
  check is not copied and is reported, as a slot's are
  (:class:`~kvsnap.pipeline.restore.FailedPages`).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvsnap.errors import SnapshotCorruptError, TransferFailedError
from kvsnap.pipeline.restore import FailedPages
from kvsnap.store import SnapshotReader, TraceHook, traced
from kvsnap.store.slot_reads import held_page_failures
from kvsnap.transfer.cpu import copy_page_fragments
from kvsnap.transfer.page_table import GroupRows, PageTable
from kvsnap.transfer.strided import StridedPattern, fragment_dtype, pages_view

#: Chunk shapes (layer tensor offsets) a loader keeps the source side of: the chunks of one
#: model share one or two.
SHAPES_KEPT = 16


@dataclass(frozen=True)
class _CacheGroup:
    """One fragment group of the cache: its page pattern (``None``: fragments that are no
    strided array, copied by :func:`copy_page_fragments`), and per row of the group (its
    ``tensors``, in tensor order) where the page of block 0 starts in ``view`` (``first``,
    in the view's first-axis steps) and how many steps a block is (``step``)."""

    rows: GroupRows
    pattern: StridedPattern | None
    tensors: np.ndarray
    row_ids: np.ndarray
    view: np.ndarray | None
    first: np.ndarray
    step: np.ndarray


@dataclass(frozen=True)
class _SourceGroup:
    """One group's source side for one chunk shape: where each row's first fragment of block 0
    lies in the file (``origins``), and the spacing of those origins when it is even
    (``spacing``; ``None`` when it is not)."""

    origins: np.ndarray
    spacing: int | None


class HeldLoader:
    """Restores of held snapshot files into the host-memory cache of ``table`` (blocks below
    ``capacity``): see the module docstring."""

    def __init__(self, table: PageTable, capacity: int) -> None:
        self.table = table
        self.page_bytes = table.page_size_bytes
        self.names = table.names
        self._groups = [_cache_group(rows, capacity) for rows in table.group_rows]
        self._shapes: collections.OrderedDict[bytes, list[_SourceGroup]] = collections.OrderedDict()

    def restore(
        self,
        reader: SnapshotReader,
        blocks: tuple[np.ndarray, np.ndarray],
        progress: Callable[[int], None],
        trace: TraceHook | None,
    ) -> FailedPages:
        """Check and copy the pages of blocks ``blocks = (snapshot_blocks, target_blocks)``
        (checked and sorted by snapshot block, :func:`~kvsnap.pipeline.jobs.block_pairs`) of
        every layer tensor out of ``reader``'s held file into the cache; the pages that failed
        their check, which were not written."""
        whole = reader.held_file()
        assert whole is not None, "a held restore of a file not read whole"
        snapshot_blocks, target_blocks = blocks
        begin = reader.extents().begin
        count, page = len(snapshot_blocks), self.page_bytes
        nbytes = len(begin) * count * page
        with traced(trace, "verify", nbytes):
            offsets = begin[:, None] + snapshot_blocks * page
            table = reader.page_digest_table
            if table is None:
                stored = reader.stored_checksums(_column(len(begin)), snapshot_blocks).ravel()
            else:  # opened with keys: every page against its signed BLAKE3 digest
                stored = table[:, snapshot_blocks].reshape(-1, table.shape[-1])
            bad = held_page_failures(whole, offsets.ravel(), page, stored)
        failed = _failed_pages(reader, self.names, snapshot_blocks, bad, count, table is None)
        keep = None
        if len(bad):
            keep = np.ones(len(begin) * count, dtype=bool)
            keep[bad] = False
            keep = keep.reshape(len(begin), count)
        with traced(trace, "transfer.submit", nbytes):
            self.copy_pages(whole, begin, snapshot_blocks, target_blocks, keep)
        progress(nbytes)
        return failed

    def copy_pages(
        self,
        whole: np.ndarray,
        begin: np.ndarray,
        snapshot_blocks: np.ndarray,
        target_blocks: np.ndarray,
        keep: np.ndarray | None = None,
    ) -> None:
        """Copy blocks ``snapshot_blocks`` of every layer tensor out of ``whole`` (tensor
        ``t``'s block ``b`` at ``begin[t] + b * page_bytes``; blocks sorted and distinct) into
        blocks ``target_blocks`` of the cache, nothing checked; ``keep`` (tensors x blocks,
        default all): the pages to copy. :class:`TransferFailedError` if numpy refuses."""
        try:
            for group, source in zip(self._groups, self._sources(begin), strict=True):
                self._copy(group, source, whole, snapshot_blocks, target_blocks, keep)
        except (RuntimeError, OSError, ValueError) as error:
            raise TransferFailedError(f"the held page copy failed: {error}") from error

    def _sources(self, begin: np.ndarray) -> list[_SourceGroup]:
        """The source side of every group for chunks whose layer tensors start at ``begin``,
        worked out once per distinct ``begin``."""
        key = begin.tobytes()
        sources = self._shapes.get(key)
        if sources is None:
            sources = [_source_group(group, begin) for group in self._groups]
            self._shapes[key] = sources
            while len(self._shapes) > SHAPES_KEPT:
                self._shapes.popitem(last=False)
        return sources

    def _copy(
        self,
        group: _CacheGroup,
        source: _SourceGroup,
        whole: np.ndarray,
        snapshot_blocks: np.ndarray,
        target_blocks: np.ndarray,
        keep: np.ndarray | None,
    ) -> None:
        """Copy one group's fragments of the pages ``keep`` allows (all: ``None``)."""
        if not len(group.tensors) or not len(snapshot_blocks):
            return
        page = self.page_bytes
        src = source.origins[:, None] + snapshot_blocks * page  # (rows, blocks), in the file
        rows_keep = None if keep is None else keep[group.tensors]
        if group.pattern is None:
            _copy_fragments(group, whole, src, target_blocks, rows_keep)
            return
        dst = group.first[:, None] + target_blocks * group.step[:, None]
        pattern = group.pattern
        assert group.view is not None
        following = int(snapshot_blocks[-1] - snapshot_blocks[0]) == len(snapshot_blocks) - 1
        if rows_keep is None and following and source.spacing is not None:
            # Every row's pages follow each other and the rows are evenly spaced: the source is
            # one strided view of the held bytes, scattered without an index or a gather.
            pages = np.ndarray(
                (len(group.tensors), len(snapshot_blocks), *pattern.shape),
                dtype=fragment_dtype(pattern.fragment_bytes),
                buffer=whole,
                offset=int(src[0, 0]),
                strides=(source.spacing, page, *pattern.canonical_strides),
            )
            group.view[dst] = pages
            return
        if rows_keep is not None:
            src, dst = src[rows_keep], dst[rows_keep]
        word = _lowest_bit(_or_all(src - src.min()), 8)
        origins = whole.ctypes.data + src.ravel()
        view, index = pages_view(pattern, origins, pattern.canonical_strides, word)
        group.view[dst.ravel()] = view[index]


def _cache_group(rows: GroupRows, capacity: int) -> _CacheGroup:
    """:class:`_CacheGroup` of ``rows``: every (tensor, rank) row of the group, by tensor then
    rank; ``capacity`` bounds the blocks the cache view spans (a target block past it is an
    index numpy refuses, never an address outside the caches)."""
    group = rows.group
    tensors, ranks = np.nonzero(rows.row_of >= 0)
    row_ids = rows.row_of[tensors, ranks]
    pattern = group.strided
    if pattern is None and group.num_fragments == 1:
        size = group.fragment_bytes
        pattern = StridedPattern(size, (1,), (size,), (size,), 0, 0)
    bases, strides = rows.local_base[row_ids], rows.block_stride[row_ids]
    if pattern is None or not len(row_ids):
        empty = np.empty(0, dtype=np.int64)
        return _CacheGroup(rows, None, tensors, row_ids, None, empty, empty)
    origins = bases + pattern.local_origin
    last = origins + (capacity - 1) * strides
    low, high = int(np.minimum(origins, last).min()), int(np.maximum(origins, last).max())
    # The view's first axis steps by a word that divides every row's distance from the
    # lowest origin and every block stride, so each page's origin is an index on it.
    word = _lowest_bit(_or_all(origins - low) | _or_all(strides), 8)
    view, _ = pages_view(pattern, np.array([low, high]), pattern.local_strides, word)
    return _CacheGroup(
        rows, pattern, tensors, row_ids, view, (origins - low) // word, strides // word
    )


def _source_group(group: _CacheGroup, begin: np.ndarray) -> _SourceGroup:
    """:class:`_SourceGroup` of ``group`` for layer tensors starting at ``begin`` in the file:
    a row's origin is its tensor's block 0, plus where the row's share of the canonical page
    starts, plus (for a strided pattern) its first fragment's offset there."""
    inner = group.pattern.canonical_origin if group.pattern is not None else 0
    origins = begin[group.tensors] + group.rows.canonical_base[group.row_ids] + inner
    steps = np.diff(origins)
    spacing = None
    if len(origins) == 1:
        spacing = 0
    elif len(steps) and bool((steps == steps[0]).all()):
        spacing = int(steps[0])
    return _SourceGroup(origins, spacing)


def _copy_fragments(
    group: _CacheGroup,
    whole: np.ndarray,
    src: np.ndarray,
    target_blocks: np.ndarray,
    rows_keep: np.ndarray | None,
) -> None:
    """A group whose fragments form no strided array: every page's fragments by address
    (:func:`copy_page_fragments`), ``src`` the rows' pages' offsets in ``whole``."""
    rows = group.rows
    dst = (
        rows.local_base[group.row_ids][:, None]
        + target_blocks * rows.block_stride[group.row_ids][:, None]
    )
    if rows_keep is not None:
        src, dst = src[rows_keep], dst[rows_keep]
    copy_page_fragments(
        whole.ctypes.data + src.ravel(),
        rows.group.canonical_offsets,
        dst.ravel(),
        rows.group.local_offsets,
        rows.group.fragment_bytes,
    )


def _failed_pages(
    reader: SnapshotReader,
    names: Sequence[str],
    snapshot_blocks: np.ndarray,
    bad: np.ndarray,
    count: int,
    by_checksum: bool = True,
) -> FailedPages:
    """The pages ``bad`` (indices into the ``(tensor, position)`` pages, ``count`` positions a
    tensor) as :class:`FailedPages`, with the first one's error; ``by_checksum``: they failed
    their xxh3-64, else their signed BLAKE3 digest."""
    tensors, positions = np.divmod(bad, count) if len(bad) else (bad, bad)
    error = None
    if len(bad):
        error = SnapshotCorruptError(
            "xxh3-64 does not match the stored checksum" if by_checksum else _BLAKE3_FAILED,
            file=reader.url,
            tensor=names[int(tensors[0])],
            block=int(snapshot_blocks[positions[0]]),
        )
    return FailedPages(tensors, positions, error)


_BLAKE3_FAILED = "BLAKE3 digest does not match the signed page digest (changed after signing)"


def _column(length: int) -> np.ndarray:
    """``0 .. length-1`` as a column: with a row of blocks, every (tensor, block) pair."""
    return np.arange(length)[:, None]


def _or_all(values: np.ndarray) -> int:
    return int(np.bitwise_or.reduce(values, axis=None)) if values.size else 0


def _lowest_bit(value: int, cap: int) -> int:
    """The lowest set bit of ``value`` (``cap`` when it is 0), at most ``cap``."""
    return min(value & -value, cap) if value else cap
