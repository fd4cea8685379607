"""The pages of one open snapshot as a restore takes them: a staging slot's pages read in one
call, or, from files the hot tier holds, uploaded straight out of their registered mappings in
as few spans as the files allow.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from kvsnap.pipeline.slots import SlotLoad
from kvsnap.store import SnapshotReader, TraceHook
from kvsnap.store.hot import HotFile, hot_tier
from kvsnap.store.slot_reads import PageRuns


class SnapshotPages:
    """The pages of one open snapshot as a restore reads them: a slot's pages in one call.

    ``hot``: the snapshot's files held by the hot tier (one per file, leased by the caller):
    then nothing is read, and each slot's pages go to the device straight from the files'
    registered mappings (:meth:`uploads`).
    """

    def __init__(self, reader: SnapshotReader, hot: Sequence[HotFile] | None = None) -> None:
        self.reader = reader
        self.names = reader.tensor_names()
        self.page_size_bytes = reader.metadata.geometry.canonical_page_size_bytes
        self.hot = hot

    def uploads(
        self, load: SlotLoad, page_blocks: np.ndarray, room: int
    ) -> tuple[SlotLoad, list[tuple[Any, int]]]:
        """``load``'s pages (page ``i`` is snapshot block ``page_blocks[i]``) as host→device
        copies out of the hot files' mappings: per span of the files, the mapped bytes and
        their offset in the slot, with ``load`` as the slot then holds it.

        A span is a run of pages consecutive in a file and in the slot (one per slot when the
        slot's pages follow each other in the file), or several such runs apart in one file by
        no more than a page of padding, when the slot's bytes padding included stay within
        ``room``: the pages then lie in the slot as in the file. A one-block prefix of a model
        whose page is no multiple of the files' alignment (MLA's 18 KiB pages) is otherwise
        one run per layer, and each run costs the host a copy call (61 of them per slot).
        """
        assert self.hot is not None
        runs = self.reader.page_runs(load.page_tensors, page_blocks, load.page_offsets)
        load, spans = hot_spans(load, runs, self.page_size_bytes, room)
        uploads = []
        for file, begin, length, slot_offset in spans:
            host = self.hot[file].host
            assert host is not None  # leased entries stay mapped
            uploads.append((host[begin : begin + length], slot_offset))
        return load, uploads

    def read_async(
        self,
        load: SlotLoad,
        snapshot_blocks: np.ndarray,
        out: np.ndarray,
        trace: TraceHook | None,
        *,
        verify: bool = True,
        inline: bool = False,
    ) -> Future[np.ndarray]:
        """Read (and, with ``verify``, check) ``load``'s pages into ``out``; the future gives
        the pages that failed their checksum. ``inline``: a small slot may be read on this
        thread (:meth:`SnapshotReader.read_slot_async`)."""
        return self.reader.read_slot_async(
            load.page_tensors,
            snapshot_blocks[load.page_positions],
            load.page_offsets,
            out,
            verify=verify,
            trace=trace,
            inline=inline,
        )

    def stored(self, load: SlotLoad, page_blocks: np.ndarray) -> np.ndarray:
        """What ``load``'s pages (page ``i`` is snapshot block ``page_blocks[i]``) are checked
        against: their stored xxh3-64 (uint64), or, for a reader opened with keys of a file
        signed with BLAKE3 page digests, their signed digests (``(pages, 32)`` uint8)."""
        table = self.reader.page_digest_table
        if table is not None:
            return table[load.page_tensors, page_blocks]
        return self.reader.stored_checksums(load.page_tensors, page_blocks)


def hot_spans(
    load: SlotLoad, runs: PageRuns, page_size_bytes: int, room: int
) -> tuple[SlotLoad, list[tuple[int, int, int, int]]]:
    """``load`` and its spans (file, first byte there, length, offset in the slot): runs of one
    file apart by at most a page of padding joined, where the slot's bytes fit ``room`` and
    every page stays as aligned in the slot as when the pages are packed."""
    lengths = (runs.stops - runs.starts) * page_size_bytes
    rows = list(
        zip(
            *(a.tolist() for a in (runs.files, runs.file_offsets, lengths, runs.slot_offsets)),
            strict=True,
        )
    )
    if len(lengths) < 2:
        return load, rows
    run_ends = runs.file_offsets + lengths
    gaps = runs.file_offsets[1:] - run_ends[:-1]
    # Pages packed from 0 lie at multiples of the page size; a gap of a multiple of the page
    # size's largest power of two keeps every page (and its 8-byte words) as aligned.
    alignment = page_size_bytes & -page_size_bytes
    joins = (
        (runs.files[1:] == runs.files[:-1])
        & (gaps >= 0)
        & (gaps <= page_size_bytes)
        & (gaps % alignment == 0)
    )
    in_order = (
        runs.starts[0] == 0
        and runs.stops[-1] == load.num_pages
        and np.array_equal(runs.starts[1:], runs.stops[:-1])
    )
    if not joins.any() or not in_order:
        return load, rows
    firsts = np.flatnonzero(np.concatenate(([True], ~joins)))  # each span's first run
    span_of_run = np.cumsum(np.concatenate(([False], ~joins)))
    span_begins = runs.file_offsets[firsts]
    span_lengths = np.maximum.reduceat(run_ends, firsts) - span_begins
    if int(span_lengths.sum()) > room:
        return load, rows
    span_slot_offsets = np.concatenate(([0], np.cumsum(span_lengths)[:-1]))
    run_slot_offsets = span_slot_offsets[span_of_run] + runs.file_offsets - span_begins[span_of_run]
    run_of_page = np.repeat(np.arange(len(lengths)), runs.stops - runs.starts)
    page_offsets = (
        run_slot_offsets[run_of_page]
        + (np.arange(load.num_pages) - runs.starts[run_of_page]) * page_size_bytes
    )
    spans = zip(
        *(a.tolist() for a in (runs.files[firsts], span_begins, span_lengths, span_slot_offsets)),
        strict=True,
    )
    return SlotLoad(load.page_tensors, load.page_positions, page_offsets), list(spans)


def lease_hot_files(reader: SnapshotReader, *, admit: bool) -> list[HotFile] | None:
    """Every file of ``reader``'s snapshot from the process-wide hot tier, leased (give each
    back with :meth:`~kvsnap.store.hot.HotTier.release`), or ``None``: a file is not local or
    not (yet) held (all or nothing; each lookup counts a hit). ``admit``: register the files
    now (the caller's word) rather than on the tier's ``register_after``-th hit."""
    tier = hot_tier()
    files = reader.local_files() if tier.enabled else None
    if files is None:
        return None
    leases: list[HotFile] = []
    for path, fd, status in files:
        entry = tier.lookup(path, fd, status, admit=admit)
        if entry is None:
            for leased in leases:
                tier.release(leased)
            return None
        leases.append(entry)
    return leases
