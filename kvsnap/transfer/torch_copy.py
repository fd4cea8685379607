"""The ``torch`` backend: gather/scatter through a bounded staging buffer with plain torch ops.

This is transformers' offloading approach generalized to any layout. Each copy run of a
:class:`~kvsnap.layout.PageRef` is viewed, over the cache tensor's raw bytes, as a strided
``(num_blocks, num_fragments, fragment_size)`` tensor; one ``index_select`` per run gathers a
batch of blocks into canonical pages in a staging buffer on the cache's device, and consecutive
host pages are then moved with one slice copy each. Restore runs backwards: slice copies into
staging, then one ``index_copy_`` per run. Batches are bounded by the staging size (default
64 MiB), so memory use does not grow with the job.

It needs nothing but torch, so it also runs on CPU tensors (the test suite's "device").
When a rank writes only part of each canonical page (tensor-parallel head slices) the host side
of a capture is strided; torch moves such a copy through a temporary, synchronously, so
``auto`` does not pick this backend for those layouts on CUDA.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvsnap.layout import CacheLayout, CopyRun, PageRef
from kvsnap.plan import Direction, PageCopy, host_page_addresses
from kvsnap.transfer.base import CopyBackend, CopyJob, register_backend

#: Default bound on the staging buffer, in bytes.
DEFAULT_STAGING_BYTES = 64 << 20


def host_bytes(address: int, num_bytes: int) -> torch.Tensor:
    """A uint8 CPU tensor over ``num_bytes`` of host memory at ``address`` (no copy, not owned)."""
    return torch.frombuffer((ctypes.c_uint8 * num_bytes).from_address(address), dtype=torch.uint8)


def _nonnegative_runs(run: CopyRun) -> list[CopyRun]:
    """``run`` rewritten with non-negative strides (``as_strided`` rejects negative ones).

    A single fragment takes any stride; a run with both strides negative is walked backwards;
    a run whose strides have opposite signs is split into single fragments.
    """
    if run.num_fragments == 1:
        return [
            CopyRun(
                run.local_offset,
                run.fragment_size,
                run.canonical_offset,
                run.fragment_size,
                run.fragment_size,
                1,
            )
        ]
    if run.local_stride >= 0 and run.canonical_stride >= 0:
        return [run]
    last = run.num_fragments - 1
    if run.local_stride <= 0 and run.canonical_stride <= 0:
        return [
            CopyRun(
                run.local_offset + last * run.local_stride,
                -run.local_stride,
                run.canonical_offset + last * run.canonical_stride,
                -run.canonical_stride,
                run.fragment_size,
                run.num_fragments,
            )
        ]
    return [
        CopyRun(
            run.local_offset + i * run.local_stride,
            run.fragment_size,
            run.canonical_offset + i * run.canonical_stride,
            run.fragment_size,
            run.fragment_size,
            1,
        )
        for i in range(run.num_fragments)
    ]


_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def ref_word_bytes(ref: PageRef, runs: list[CopyRun], base_offset: int, block_stride: int) -> int:
    """The widest word (8/4/2/1 bytes) dividing every offset, stride and size of ``ref``'s runs.

    ``base_offset`` is the cache tensor's start within its storage. Moving words instead of
    bytes makes the device-side gathers run at memory speed rather than a byte per thread.
    """
    values = [base_offset, block_stride, ref.mapping.canonical_page_size_bytes]
    for run in runs:
        values += [run.local_offset, run.local_stride, run.canonical_offset]
        values += [run.canonical_stride, run.fragment_size]
    combined = 0
    for value in values:
        combined |= value
    lowest_bit = combined & -combined if combined else 8
    return min(lowest_bit, 8)


@dataclass(frozen=True)
class _RunView:
    """One copy run as a strided device view ``(num_blocks, num_fragments, fragment_words)``.

    All views and offsets are in words of ``word`` bytes; the run itself stays in bytes.
    """

    device_view: torch.Tensor
    run: CopyRun
    word: int

    def page_view(self, pages: torch.Tensor) -> torch.Tensor:
        """The run's words inside ``pages``: canonical pages as a ``(count, page_words)`` tensor."""
        word = self.word
        return pages.as_strided(
            (pages.shape[0], self.run.num_fragments, self.run.fragment_size // word),
            (pages.stride(0), self.run.canonical_stride // word, 1),
            pages.storage_offset() + self.run.canonical_offset // word,
        )

    def fills(self, page_size: int) -> bool:
        """Whether the run is the whole page, in order (its page view is then contiguous)."""
        run = self.run
        in_order = run.num_fragments == 1 or run.canonical_stride == run.fragment_size
        whole = run.canonical_offset == 0 and run.num_bytes == page_size
        return in_order and whole


@register_backend
class TorchBackend(CopyBackend):
    """``index_select``/``index_copy_`` over strided views, through a bounded staging buffer.

    Options: ``staging_bytes`` (default 64 MiB), the most bytes of canonical pages staged at once;
    a page larger than that is still staged one at a time.
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
        self._staging: torch.Tensor | None = None
        self._raw: dict[int, torch.Tensor] = {}
        self._runs: dict[tuple[str, int], list[_RunView]] = {}
        #: Per canonical tensor, the word its device views use when host pages are aligned.
        self.words: dict[str, int] = {}
        for ref in layout.refs:
            cache = layout.tensors[ref.tensor_index]
            base = cache.data_ptr - cache.tensor.untyped_storage().data_ptr()
            runs = [split for run in ref.mapping.runs for split in _nonnegative_runs(run)]
            word = ref_word_bytes(ref, runs, base, cache.block_stride_bytes)
            if cache.tensor.untyped_storage().data_ptr() % word:
                word = 1
            self.words[ref.name] = word

    def _views(self, ref: PageRef, word: int) -> list[_RunView]:
        """``ref``'s runs as strided device views in ``word``-byte elements (built once)."""
        key = (ref.name, word)
        views = self._runs.get(key)
        if views is None:
            cache = self.layout.tensors[ref.tensor_index]
            storage = cache.tensor.untyped_storage()
            raw = self._raw.get(ref.tensor_index)
            if raw is None:
                raw = torch.empty(0, dtype=torch.uint8, device=cache.device).set_(storage)
                self._raw[ref.tensor_index] = raw
            base = cache.data_ptr - storage.data_ptr()
            views = []
            for run in (
                split for original in ref.mapping.runs for split in _nonnegative_runs(original)
            ):
                as_bytes = raw.as_strided(
                    (cache.num_blocks, run.num_fragments, run.fragment_size),
                    (cache.block_stride_bytes, run.local_stride, 1),
                    base + run.local_offset,
                )
                views.append(_RunView(as_bytes.view(_WORD_DTYPES[word]), run, word))
            self._runs[key] = views
        return views

    @classmethod
    def probe(cls, device: torch.device) -> str | None:
        if device.type == "cuda" and not torch.cuda.is_available():
            return "CUDA is not available"
        return None

    def _staging_for(self, page_size: int, num_blocks: int) -> tuple[torch.Tensor, int]:
        """The staging buffer as ``(blocks, page_size)`` and how many blocks one batch holds.

        It is sized for the job at hand (at least one page, at most ``staging_bytes`` unless one
        page is larger) and grows, never shrinks, across jobs.
        """
        wanted = max(page_size, min(self.staging_bytes, num_blocks * page_size))
        if self._staging is None or self._staging.numel() < wanted:
            current = 0 if self._staging is None else self._staging.numel()
            size = max(wanted, min(2 * current, max(self.staging_bytes, page_size)))
            self._staging = torch.empty(size, dtype=torch.uint8, device=self.device)
        if self._staging.is_cuda:
            # Jobs run on pooled streams: keep the allocator from reusing this memory (after a
            # regrowth frees it) before every stream that used it has finished with it.
            self._staging.record_stream(torch.cuda.current_stream(self.device))
        per_batch = self._staging.numel() // page_size
        return self._staging[: per_batch * page_size].view(per_batch, page_size), per_batch

    def execute(self, job: CopyJob) -> None:
        for copy in job.copies:
            self._execute_copy(copy)

    def _blocks_and_pages(self, copy: PageCopy, ref: PageRef) -> tuple[np.ndarray, np.ndarray]:
        blocks = np.asarray(copy.device_block_ids, dtype=np.int64)
        addresses, page_numbers = host_page_addresses(
            copy.host, copy.host_chunk_ids, copy.skip, len(blocks)
        )
        if self.direction is Direction.DEVICE_TO_HOST and ref.mapping.num_writers > 1:
            snapshot_blocks = (
                page_numbers
                if copy.snapshot_block_ids is None
                else np.asarray(copy.snapshot_block_ids)
            )
            writes = ref.mapping.is_writer(snapshot_blocks)
            blocks, addresses = blocks[writes], addresses[writes]
        return blocks, addresses

    def _execute_copy(self, copy: PageCopy) -> None:
        ref = self.layout.ref(copy.name)
        page_size = ref.mapping.canonical_page_size_bytes
        blocks, addresses = self._blocks_and_pages(copy, ref)
        if len(blocks) == 0 or ref.mapping.local_bytes == 0:
            return
        word = self.words[copy.name]
        if word > 1 and (addresses % word).any():
            word = 1  # host pages not word-aligned: move bytes
        dtype = _WORD_DTYPES[word]
        runs = self._views(ref, word)
        whole_pages = ref.mapping.local_bytes == page_size
        to_host = self.direction is Direction.DEVICE_TO_HOST
        staging, per_batch = self._staging_for(page_size, len(blocks))
        for start in range(0, len(blocks), per_batch):
            batch_blocks = blocks[start : start + per_batch]
            batch_addresses = addresses[start : start + per_batch]
            count = len(batch_blocks)
            pages = staging[:count].view(dtype)
            index = torch.from_numpy(batch_blocks).to(self.device, non_blocking=True)
            # Consecutive host pages form one slice copy each.
            breaks = np.flatnonzero(np.diff(batch_addresses) != page_size) + 1
            groups = list(zip([0, *breaks.tolist()], [*breaks.tolist(), count], strict=True))
            hosts = [
                host_bytes(int(batch_addresses[first]), (end - first) * page_size)
                .view(dtype)
                .view(end - first, -1)
                for first, end in groups
            ]
            if to_host:
                for run_view in runs:
                    target = run_view.page_view(pages)
                    if run_view.fills(page_size):
                        # The whole page in order: gather straight into the staging pages.
                        torch.index_select(run_view.device_view, 0, index, out=target)
                    else:
                        target.copy_(run_view.device_view.index_select(0, index))
                for (first, end), host in zip(groups, hosts, strict=True):
                    if whole_pages:
                        host.copy_(pages[first:end], non_blocking=True)
                    else:
                        # Only this rank's bytes: other ranks write the rest of these pages.
                        for run_view in runs:
                            run_view.page_view(host).copy_(
                                run_view.page_view(pages[first:end]), non_blocking=True
                            )
            else:
                for (first, end), host in zip(groups, hosts, strict=True):
                    pages[first:end].copy_(host, non_blocking=True)
                for run_view in runs:
                    run_view.device_view.index_copy_(0, index, run_view.page_view(pages))

    def close(self) -> None:
        self._staging = None
        self._runs.clear()
        self._raw.clear()
