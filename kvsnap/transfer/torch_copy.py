"""The ``torch`` backend: gather/scatter through two staging buffers with plain torch ops.

This is transformers' offloading approach generalized to any layout and pipelined. Each
:class:`~kvsnap.layout.PageRef`'s copy runs are folded into as few strided views of the cache
tensor's raw bytes as their regularity allows (``(num_blocks, num_runs, num_fragments,
fragment_words)``: one view for an NHD page, one for all heads of the packed layout), so a
copy costs one ``index_select`` (capture) or ``index_copy_`` (restore) per view, not per run.

A job's pages are cut into batches that fit one staging buffer (half of ``staging_bytes``,
default 64 MiB in all), and each batch's block ids go to the device in one transfer, shared by
the copies that read the same blocks. Pages of different copies share a batch, so a small job
is one gather per copy and one host copy per run of consecutive host pages; a copy's word size,
views and host runs are worked out when its first batch needs them, so a large job's first
batch is enqueued early. With more than one batch on CUDA the two buffers
alternate between the job's stream, which gathers (or scatters) at memory speed, and a side
stream, which moves the previous batch over PCIe: the device gather of batch ``i+1`` overlaps
the host copy of batch ``i``, and the copy engine stays busy.

It needs nothing but torch, so it also runs on CPU tensors (the test suite's "device").
When a rank writes only part of each canonical page (tensor-parallel head slices) the host side
of a capture is strided; torch moves such a copy through a temporary, synchronously, so
``auto`` does not pick this backend for those layouts on CUDA.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvsnap.dtypes import WORD_DTYPES
from kvsnap.layout import CacheLayout, CopyRun, PageRef
from kvsnap.transfer.base import CopyBackend, CopyJob, on_stream
from kvsnap.transfer.plan import Direction, ResolvedCopy
from kvsnap.transfer.torch_views import (
    RunGroup,
    fold_runs,
    host_bytes,
    nonnegative_runs,
    ref_word_bytes,
)

#: Default bound on the two staging buffers together, in bytes.
DEFAULT_STAGING_BYTES = 64 << 20
#: Every batch segment starts at a multiple of this in its staging buffer (the widest word).
_SEGMENT_ALIGNMENT = 8
_NO_BREAKS = np.empty(0, dtype=np.int64)
_WORD_DTYPES = WORD_DTYPES


class _PreparedCopy:
    """One copy's blocks and host page addresses (after writer election) and how to move them.

    The word size, the device views and the runs of consecutive host pages are worked out on
    first use: a large job's first batch then waits only for its own copies' preparation, and
    the rest is done while the device copies.
    """

    def __init__(
        self, resolved: ResolvedCopy, widest_word: int, run_groups: Callable[[int], list[RunGroup]]
    ) -> None:
        mapping = resolved.ref.mapping
        self.blocks = resolved.device_block_ids
        self.addresses = resolved.host_addresses
        self.page_size = mapping.canonical_page_size_bytes
        self.whole_pages = mapping.local_bytes == self.page_size
        self._widest_word = widest_word
        self._run_groups = run_groups

    @functools.cached_property
    def word(self) -> int:
        """The widest word the views allow that every host page address is aligned to."""
        if self._widest_word == 1:
            return 1
        # One page is the common small job: plain integers cost less than numpy calls there.
        if len(self.addresses) == 1:
            address_bits = int(self.addresses[0])
        else:
            address_bits = int(np.bitwise_or.reduce(self.addresses))
        return self._widest_word if address_bits % self._widest_word == 0 else 1

    @functools.cached_property
    def groups(self) -> list[RunGroup]:
        return self._run_groups(self.word)

    @functools.cached_property
    def host_breaks(self) -> np.ndarray:
        """Positions where the host pages stop following each other."""
        if len(self.addresses) == 1:
            return _NO_BREAKS
        return np.flatnonzero(np.diff(self.addresses) != self.page_size) + 1


@dataclass(frozen=True)
class _Segment:
    """Pages ``[start, stop)`` of one copy that travel in one staging batch, from ``offset``."""

    copy: _PreparedCopy
    start: int
    stop: int
    offset: int

    @property
    def num_pages(self) -> int:
        return self.stop - self.start

    @property
    def num_bytes(self) -> int:
        return self.num_pages * self.copy.page_size

    @property
    def blocks(self) -> np.ndarray:
        return self.copy.blocks[self.start : self.stop]

    @property
    def addresses(self) -> np.ndarray:
        return self.copy.addresses[self.start : self.stop]

    def pages(self, buffer: torch.Tensor) -> torch.Tensor:
        """This segment's canonical pages in ``buffer`` as ``(count, page_words)``."""
        region = buffer[self.offset : self.offset + self.num_bytes]
        return region.view(_WORD_DTYPES[self.copy.word]).view(self.num_pages, -1)

    def host_ranges(self) -> list[tuple[int, int, int]]:
        """``(first page, end page, host address)`` per run of consecutive host pages."""
        all_breaks, addresses = self.copy.host_breaks, self.copy.addresses
        if len(all_breaks):
            inside = np.searchsorted(all_breaks, [self.start + 1, self.stop])
            breaks = (all_breaks[inside[0] : inside[1]] - self.start).tolist()
        else:
            breaks = []  # the usual case: one staging slot or chunk, pages in order
        starts, ends = [0, *breaks], [*breaks, self.num_pages]
        return [
            (first, end, int(addresses[self.start + first]))
            for first, end in zip(starts, ends, strict=True)
        ]


@dataclass(frozen=True)
class _Batch:
    """What one staging buffer carries at once: segments, each with its device block ids."""

    segments: list[_Segment]
    indices: list[torch.Tensor]


class TorchBackend(CopyBackend):
    """``index_select``/``index_copy_`` over strided views, through two staging buffers.

    Options: ``staging_bytes`` (default 64 MiB), the device memory of the two staging buffers
    together; a page larger than one buffer is still staged, one page per batch.
    """

    name = "torch"
    uses_descriptors = False

    def __init__(
        self,
        layout: CacheLayout,
        direction: Direction,
        *,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        **options: Any,
    ) -> None:
        super().__init__(layout, direction, **options)
        if staging_bytes <= 0:
            raise ValueError(f"staging_bytes must be positive, got {staging_bytes}")
        self.staging_bytes = staging_bytes
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._raw: dict[int, torch.Tensor] = {}
        self._groups: dict[tuple[str, int], list[RunGroup]] = {}
        self._side_stream: torch.cuda.Stream | None = None
        self._ready: list[torch.cuda.Event] = []
        self._free: list[torch.cuda.Event] = []
        self._joined: list[torch.cuda.Event] = []
        #: Per canonical tensor, the word its device views use when host pages are aligned.
        self.words: dict[str, int] = {}
        for ref in layout.refs:
            cache = layout.tensors[ref.tensor_index]
            base = cache.data_ptr - cache.tensor.untyped_storage().data_ptr()
            runs = [split for run in ref.mapping.runs for split in nonnegative_runs(run)]
            word = ref_word_bytes(ref, runs, base, cache.block_stride_bytes)
            if cache.tensor.untyped_storage().data_ptr() % word:
                word = 1
            self.words[ref.name] = word

    @classmethod
    def probe(cls, device: torch.device) -> str | None:
        if device.type == "cuda" and not torch.cuda.is_available():
            return "CUDA is not available"
        return None

    @property
    def allocated_staging_bytes(self) -> int:
        """Device memory the staging buffers hold now (at most ``staging_bytes``, or two pages)."""
        return sum(buffer.numel() for buffer in self._buffers if buffer is not None)

    # -- views -------------------------------------------------------------------------------

    def _run_groups(self, ref: PageRef, word: int) -> list[RunGroup]:
        """``ref``'s folded runs as strided device views in ``word``-byte elements (built once)."""
        key = (ref.name, word)
        groups = self._groups.get(key)
        if groups is None:
            groups = [self._run_group(ref, runs, word) for runs in self._folded(ref)]
            self._groups[key] = groups
        return groups

    @staticmethod
    def _folded(ref: PageRef) -> list[list[CopyRun]]:
        return fold_runs([split for run in ref.mapping.runs for split in nonnegative_runs(run)])

    def _run_group(self, ref: PageRef, runs: list[CopyRun], word: int) -> RunGroup:
        cache = self.layout.tensors[ref.tensor_index]
        storage = cache.tensor.untyped_storage()
        raw = self._raw.get(ref.tensor_index)
        if raw is None:
            raw = torch.empty(0, dtype=torch.uint8, device=cache.device).set_(storage)
            self._raw[ref.tensor_index] = raw
        first = runs[0]
        run_local_step = runs[1].local_offset - first.local_offset if len(runs) > 1 else 0
        run_canonical_step = (
            runs[1].canonical_offset - first.canonical_offset if len(runs) > 1 else 0
        )
        base = cache.data_ptr - storage.data_ptr()
        as_bytes = raw.as_strided(
            (cache.num_blocks, len(runs), first.num_fragments, first.fragment_size),
            (cache.block_stride_bytes, run_local_step, first.local_stride, 1),
            base + first.local_offset,
        )
        page_size = ref.mapping.canonical_page_size_bytes
        group = RunGroup(
            as_bytes.view(_WORD_DTYPES[word]),
            first.canonical_offset // word,
            run_canonical_step // word,
            first.canonical_stride // word,
            fills_page=False,
        )
        # Whole page in canonical order: the gather can write straight into the staging pages.
        probe = group.page_view(torch.empty((1, page_size // word), device="meta"))
        fills = (
            first.canonical_offset == 0
            and len(runs) * first.num_bytes == page_size
            and probe.is_contiguous()
        )
        return dataclasses.replace(group, fills_page=fills)

    # -- planning ------------------------------------------------------------------------------

    def _prepare(self, copy: ResolvedCopy) -> _PreparedCopy | None:
        if len(copy.device_block_ids) == 0 or copy.ref.mapping.local_bytes == 0:
            return None
        ref = copy.ref
        return _PreparedCopy(copy, self.words[ref.name], functools.partial(self._run_groups, ref))

    def _segments(self, prepared: list[_PreparedCopy], capacity: int) -> list[list[_Segment]]:
        """Cut the job's pages into batches of at most ``capacity`` bytes (one page at least)."""
        batches: list[list[_Segment]] = [[]]
        used = 0
        for copy in prepared:
            start = 0
            while start < len(copy.blocks):
                offset = -(-used // _SEGMENT_ALIGNMENT) * _SEGMENT_ALIGNMENT
                fits = (capacity - offset) // copy.page_size
                if fits <= 0 and batches[-1]:
                    batches.append([])
                    used = 0
                    continue
                stop = start + min(len(copy.blocks) - start, max(fits, 1))
                batches[-1].append(_Segment(copy, start, stop, offset))
                used = offset + (stop - start) * copy.page_size
                start = stop
        return batches

    def _batch(self, segments: list[_Segment]) -> _Batch:
        """``segments`` with their block ids on the cache's device, in one copy.

        Segments reading the same block ids (every layer of the same blocks, the usual job)
        share one uploaded range. The ids come from pageable memory: such a copy returns once
        the driver has staged them, so the numpy array may go away at once.
        """
        ranges: dict[tuple[int, int, int], int] = {}
        parts: list[np.ndarray] = []
        positions = []
        uploaded = 0
        for segment in segments:
            key = (id(segment.copy.blocks), segment.start, segment.stop)
            first = ranges.get(key)
            if first is None:
                first = ranges[key] = uploaded
                parts.append(segment.blocks)
                uploaded += segment.num_pages
            positions.append(first)
        index = torch.from_numpy(parts[0] if len(parts) == 1 else np.concatenate(parts))
        if self.device.type == "cuda":
            index = index.to(self.device, non_blocking=True)
        if uploaded == segments[0].num_pages:
            return _Batch(segments, [index] * len(segments))
        return _Batch(
            segments,
            [
                index[first : first + segment.num_pages]
                for first, segment in zip(positions, segments, strict=True)
            ],
        )

    def _buffer(self, which: int, num_bytes: int) -> torch.Tensor:
        """Staging buffer ``which`` with at least ``num_bytes``; grows, never shrinks."""
        buffer = self._buffers[which]
        if buffer is None or buffer.numel() < num_bytes:
            if buffer is not None and buffer.is_cuda:
                # Earlier jobs may still read or write the old buffer on other streams; growth
                # happens a handful of times per backend, so a device sync is the simple guard.
                torch.cuda.synchronize(self.device)
            buffer = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
            self._buffers[which] = buffer
        return buffer

    # -- execution -----------------------------------------------------------------------------

    def execute(self, job: CopyJob) -> None:
        prepared = [copy for copy in map(self._prepare, job.copies) if copy is not None]
        if not prepared:
            return
        largest_page = max(copy.page_size for copy in prepared)
        capacity = max(largest_page, self.staging_bytes // 2)
        batches = self._segments(prepared, capacity)
        sizes = [segments[-1].offset + segments[-1].num_bytes for segments in batches]
        buffers = [self._buffer(0, max(sizes[0::2]))]
        if len(batches) > 1:
            buffers.append(self._buffer(1, max(sizes[1::2])))
        if len(batches) == 1 or self.device.type != "cuda":
            for number, segments in enumerate(batches):
                self._run_batch(self._batch(segments), buffers[number % len(buffers)])
        else:
            self._run_pipelined(batches, buffers)

    def _run_batch(self, batch: _Batch, buffer: torch.Tensor) -> None:
        """One batch on the current stream: gather then host copies, or the reverse."""
        if self.direction is Direction.DEVICE_TO_HOST:
            self._gather(batch, buffer)
            self._to_host(batch, buffer)
        else:
            self._from_host(batch, buffer)
            self._scatter(batch, buffer)

    def _run_pipelined(self, batches: list[list[_Segment]], buffers: list[torch.Tensor]) -> None:
        """Alternate two buffers between the job stream (device side) and a side stream (PCIe).

        Each batch is planned and its block ids uploaded just before it is enqueued, so the
        device starts on the first batch while the host plans the rest.
        """
        job_stream = torch.cuda.current_stream(self.device)
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
            self._ready = [torch.cuda.Event(), torch.cuda.Event()]
            self._free = [torch.cuda.Event(), torch.cuda.Event()]
            self._joined = [torch.cuda.Event(), torch.cuda.Event()]
        side = self._side_stream
        # The side stream must not touch a buffer before the earlier jobs, ordered before this
        # job's stream, are done with it. (Recorded events, not wait_stream: that creates an
        # event per call.)
        started, side_done = self._joined
        started.record(job_stream)
        side.wait_event(started)
        to_host = self.direction is Direction.DEVICE_TO_HOST
        for number, segments in enumerate(batches):
            which = number % 2
            buffer, ready, free = buffers[which], self._ready[which], self._free[which]
            # Block ids go up on the job stream, which gathers (capture) or scatters (restore).
            batch = self._batch(segments)
            if to_host:
                if number >= 2:
                    job_stream.wait_event(free)
                self._gather(batch, buffer)
                ready.record(job_stream)
                side.wait_event(ready)
                with on_stream(side):
                    self._to_host(batch, buffer)
                free.record(side)
            else:
                if number >= 2:
                    side.wait_event(free)
                with on_stream(side):
                    self._from_host(batch, buffer)
                ready.record(side)
                job_stream.wait_event(ready)
                self._scatter(batch, buffer)
                free.record(job_stream)
        # The job ends on its own stream: the handler's end event must follow every copy.
        side_done.record(side)
        job_stream.wait_event(side_done)

    def _gather(self, batch: _Batch, buffer: torch.Tensor) -> None:
        for segment, index in zip(batch.segments, batch.indices, strict=True):
            pages = segment.pages(buffer)
            for group in segment.copy.groups:
                target = group.page_view(pages)
                if group.fills_page:
                    torch.index_select(group.device_view, 0, index, out=target)
                else:
                    target.copy_(group.device_view.index_select(0, index))

    def _scatter(self, batch: _Batch, buffer: torch.Tensor) -> None:
        for segment, index in zip(batch.segments, batch.indices, strict=True):
            pages = segment.pages(buffer)
            for group in segment.copy.groups:
                group.device_view.index_copy_(0, index, group.page_view(pages))

    def _to_host(self, batch: _Batch, buffer: torch.Tensor) -> None:
        whole = [segment for segment in batch.segments if segment.copy.whole_pages]
        for offset, address, size in _contiguous_ranges(whole):
            host_bytes(address, size).copy_(buffer[offset : offset + size], non_blocking=True)
        for segment in batch.segments:
            if not segment.copy.whole_pages:
                self._to_partial_host_pages(segment, buffer)

    def _to_partial_host_pages(self, segment: _Segment, buffer: torch.Tensor) -> None:
        """Only this rank's bytes of each page: other ranks write the rest of those pages."""
        pages = segment.pages(buffer)
        page_size, dtype = segment.copy.page_size, _WORD_DTYPES[segment.copy.word]
        for first, end, address in segment.host_ranges():
            host = host_bytes(address, (end - first) * page_size).view(dtype).view(end - first, -1)
            for group in segment.copy.groups:
                group.page_view(host).copy_(group.page_view(pages[first:end]), non_blocking=True)

    def _from_host(self, batch: _Batch, buffer: torch.Tensor) -> None:
        # Whole canonical pages come in even for a rank that keeps only some of their bytes.
        for offset, address, size in _contiguous_ranges(batch.segments):
            buffer[offset : offset + size].copy_(host_bytes(address, size), non_blocking=True)

    def close(self) -> None:
        self._buffers = [None, None]
        self._groups.clear()
        self._raw.clear()
        self._side_stream = None


def _contiguous_ranges(segments: list[_Segment]) -> list[tuple[int, int, int]]:
    """``(buffer offset, host address, bytes)`` per run of pages consecutive on both sides."""
    ranges: list[list[int]] = []
    for segment in segments:
        page_size = segment.copy.page_size
        for first, end, address in segment.host_ranges():
            offset, size = segment.offset + first * page_size, (end - first) * page_size
            if ranges and ranges[-1][0] + ranges[-1][2] == offset:
                previous = ranges[-1]
                if previous[1] + previous[2] == address:
                    previous[2] += size
                    continue
            ranges.append([offset, address, size])
    return [(offset, address, size) for offset, address, size in ranges]
