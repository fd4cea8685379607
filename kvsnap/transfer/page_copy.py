"""The fused page copy: every page of a staging slot, whatever its layer or rank, in one launch.

:class:`~kvsnap.transfer.page_table.PageTable` turns a slot's pages into :class:`GroupCopy`
arrays: per fragment group, a base address per page on each side, plus the group's fragment
offsets. :func:`launch_kernel` and :func:`run_on_cpu` execute them:

* on CUDA, one Triton kernel launch per group (a layout has one or two groups, whatever its
  number of layers and TP ranks held) copies between the cache and a device staging buffer;
  the DMA between that buffer and pinned host memory is one contiguous copy per slot, at the
  PCIe ceiling. The kernel computes every fragment's two addresses from the page bases and the
  group's offsets, so the host never builds per-fragment descriptors;
* on CPU (caches in host memory: CPU engines, the test suite), a group whose page is a
  transpose of the canonical page (a dim-major key block, a head-major cache: the table found
  its :class:`~kvsnap.transfer.strided.StridedPattern`) is copied as strided numpy views of
  whole pages (:func:`~kvsnap.transfer.strided.copy_strided_pages`); another group of small
  fragments (a TP rank's head slice) from the same arrays in vectorized batches of pages (one
  gather and one scatter of fragment-sized elements,
  :func:`~kvsnap.transfer.cpu.copy_page_fragments`); whole pages become descriptors, merged
  where consecutive blocks continue each other.

The kernel is compiled once per process and fragment shape (Triton caches it); tiles are
``ROWS`` fragments x ``BLOCK`` words, so 256-byte head slices share a step while a whole
32 KiB page is moved ``BLOCK`` words at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvsnap.transfer.cpu import VECTORIZED_MAX_BYTES, copy_descriptors, copy_page_fragments
from kvsnap.transfer.plan import Descriptors, Direction, merge_adjacent
from kvsnap.transfer.strided import copy_strided_pages
from kvsnap.transfer.triton_copy import TRITON_IMPORT_ERROR, kernel_for, tl, triton

if TYPE_CHECKING:
    from kvsnap.transfer.page_table import GroupCopy


#: Bytes one program moves per step (ROWS x BLOCK words).
STEP_BYTES = 8 << 10
#: Programs per streaming multiprocessor of a launch without an SM budget.
PROGRAMS_PER_SM = 4

if triton is not None:

    def _page_copy_kernel(
        src_bases,
        dst_bases,
        src_offsets,
        dst_offsets,
        slot_pages,
        page_ok,
        num_items,
        num_fragments,
        WORD: tl.constexpr,
        FRAGMENT_WORDS: tl.constexpr,
        BLOCK: tl.constexpr,
        ROWS: tl.constexpr,
        ALIGNED_16: tl.constexpr,
        CHECKED: tl.constexpr,
    ):
        """Item ``i`` is fragment ``i % num_fragments`` of page ``i // num_fragments``: copy
        ``FRAGMENT_WORDS`` words from ``src_bases[page] + src_offsets[fragment]`` to
        ``dst_bases[page] + dst_offsets[fragment]`` (byte addresses), ``ROWS`` items a step.
        With ``CHECKED``, a page whose slot page has ``page_ok`` 0 is not copied at all."""
        program = tl.program_id(0)
        num_programs = tl.num_programs(0)
        rows = tl.arange(0, ROWS)
        columns = tl.arange(0, BLOCK)
        for first in range(program * ROWS, num_items, num_programs * ROWS):
            items = first + rows
            live = items < num_items
            page = items // num_fragments
            fragment = items - page * num_fragments
            if CHECKED:
                slot_page = tl.load(slot_pages + page, mask=live, other=0)
                live = live & (tl.load(page_ok + slot_page, mask=live, other=0) != 0)
            src = tl.load(src_bases + page, mask=live, other=0)
            src += tl.load(src_offsets + fragment, mask=live, other=0)
            dst = tl.load(dst_bases + page, mask=live, other=0)
            dst += tl.load(dst_offsets + fragment, mask=live, other=0)
            src_words = src.to(tl.pointer_type(WORD))
            dst_words = dst.to(tl.pointer_type(WORD))
            if ALIGNED_16:
                # Every address is 16-byte aligned: the compiler may emit 128-bit accesses.
                src_words = tl.multiple_of(src_words, 16)
                dst_words = tl.multiple_of(dst_words, 16)
            for start in range(0, FRAGMENT_WORDS, BLOCK):
                offsets = start + columns
                mask = live[:, None] & (offsets[None, :] < FRAGMENT_WORDS)
                values = tl.load(src_words[:, None] + offsets[None, :], mask=mask)
                tl.store(dst_words[:, None] + offsets[None, :], values, mask=mask)


def unavailable_reason(device: torch.device) -> str | None:
    """Why the fused copy cannot run on ``device`` (``None`` when it can)."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"the fused page copy runs on CUDA or CPU, not {device.type}"
    if TRITON_IMPORT_ERROR is not None:
        return TRITON_IMPORT_ERROR
    return None if torch.cuda.is_available() else "CUDA is not available"


def word_bytes(copy: GroupCopy) -> tuple[int, bool]:
    """The widest word (8/4/2/1 bytes) dividing every address, offset and the fragment size of
    ``copy``, and whether all of them are 16-byte aligned."""
    combined = copy.address_bits
    if combined is None:
        combined = copy.group.fragment_bytes
        for values in (copy.src_bases, copy.dst_bases, copy.src_offsets, copy.dst_offsets):
            if len(values):
                combined |= int(np.bitwise_or.reduce(values))
    lowest_bit = combined & -combined if combined else 16
    return min(lowest_bit, 8), lowest_bit >= 16


def tile_shape(fragment_words: int, word: int) -> tuple[int, int]:
    """``(BLOCK, ROWS)``: ``BLOCK`` words per fragment row (a power of two covering the
    fragment, at most one step), ``ROWS`` fragments per step."""
    step_words = STEP_BYTES // word
    block = min(1 << max(fragment_words - 1, 0).bit_length(), step_words)
    return block, max(1, step_words // block)


def run_on_cpu(copies: Sequence[GroupCopy]) -> None:
    """Execute ``copies`` between host addresses, synchronously."""
    for copy in copies:
        group = copy.group
        small = group.num_fragments > 1 and group.fragment_bytes <= VECTORIZED_MAX_BYTES
        if small and group.strided is not None:
            # A transpose of the canonical page (a dim-major key block): whole pages as
            # strided arrays, no index per fragment.
            local_is_src = copy.direction is Direction.DEVICE_TO_HOST
            copy_strided_pages(group.strided, copy.src_bases, copy.dst_bases, local_is_src)
            continue
        if small:
            # Many small fragments a page (a rank's head slice of each token): copied in
            # vectorized batches of pages, never unrolled into one descriptor per fragment.
            copy_page_fragments(
                copy.src_bases,
                copy.src_offsets,
                copy.dst_bases,
                copy.dst_offsets,
                group.fragment_bytes,
            )
            continue
        src = (copy.src_bases[:, None] + copy.src_offsets[None, :]).reshape(-1)
        dst = (copy.dst_bases[:, None] + copy.dst_offsets[None, :]).reshape(-1)
        sizes = np.full(len(src), group.fragment_bytes, dtype=np.int64)
        descriptors = Descriptors(src, dst, sizes)
        if group.num_fragments == 1:
            # Whole pages of consecutive blocks continue each other: one memmove per run.
            descriptors = merge_adjacent(descriptors)
        copy_descriptors(descriptors.src, descriptors.dst, descriptors.sizes)


def _arrays(copy: GroupCopy) -> tuple[np.ndarray, ...]:
    return copy.src_bases, copy.dst_bases, copy.src_offsets, copy.dst_offsets, copy.slot_pages


#: Which of :func:`_arrays` hold a value per page (the others one per fragment).
_PER_PAGE = (0, 1, 4)


def kernel_arrays(copies: Sequence[GroupCopy]) -> list[np.ndarray]:
    """Every group's page bases, fragment offsets and slot pages, in the order
    :func:`launch_kernel` reads them from its table (for callers that write the table in
    place)."""
    return [array for copy in copies for array in _arrays(copy)]


def kernel_table(copies: Sequence[GroupCopy]) -> np.ndarray:
    """:func:`kernel_arrays` concatenated: what :func:`launch_kernel` reads from device
    memory (uploaded by the caller on its stream)."""
    arrays = kernel_arrays(copies)
    return np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64)


def launch_kernel(
    copies: Sequence[GroupCopy],
    table: torch.Tensor,
    device: torch.device,
    max_programs: int | None = None,
    page_ok: torch.Tensor | None = None,
    slot_pages: tuple[int, int] | None = None,
) -> None:
    """Enqueue ``copies`` on the current stream of ``device``, one kernel launch per group;
    ``table`` holds :func:`kernel_table` on the device (or on the host under the interpreter).
    ``max_programs`` bounds each launch's grid. With ``page_ok`` (one flag per slot page, on
    the device) the pages whose flag is 0 are left untouched. With ``slot_pages`` =
    ``(first, stop)`` only the slot's pages ``first`` to ``stop`` (exclusive) are copied."""
    if max_programs is None:
        max_programs = PROGRAMS_PER_SM * _multiprocessors(device)
    position = 0
    for copy in copies:
        views = []
        for values in _arrays(copy):
            views.append(table[position : position + len(values)])
            position += len(values)
        if slot_pages is not None:
            # A group's pages are in slot order: the slot's pages [first, stop) are one run.
            low, high = np.searchsorted(copy.slot_pages, slot_pages).tolist()
            if low == high:
                continue
            for index in _PER_PAGE:
                views[index] = views[index][low:high]
        _launch(copy, views, max_programs, page_ok)


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    count = _SM_COUNTS.get(device.index)
    if count is None:
        count = _SM_COUNTS[device.index] = torch.cuda.get_device_properties(
            device
        ).multi_processor_count
    return count


_SM_COUNTS: dict[int | None, int] = {}


def _launch(
    copy: GroupCopy, views: list[torch.Tensor], max_programs: int, page_ok: torch.Tensor | None
) -> None:
    word, aligned_16 = word_bytes(copy)
    fragment_words = copy.group.fragment_bytes // word
    block, rows = tile_shape(fragment_words, word)
    num_items = len(views[0]) * copy.group.num_fragments
    grid = (max(1, min(-(-num_items // rows), max_programs)),)
    dtype: Any = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}[word]
    kernel_for(_page_copy_kernel)[grid](
        *views,
        views[4] if page_ok is None else page_ok,
        num_items,
        copy.group.num_fragments,
        WORD=dtype,
        FRAGMENT_WORDS=fragment_words,
        BLOCK=block,
        ROWS=rows,
        ALIGNED_16=aligned_16,
        CHECKED=page_ok is not None,
    )
