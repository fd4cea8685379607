"""The ``triton`` backend: a UVA copy kernel that reads and writes host memory from the GPU.

Page-locked host memory has a device-visible address equal to its host address (unified
virtual addressing), so one kernel can execute a job's descriptors directly, whatever their
direction, without the driver's per-descriptor submission cost (H200: 50.5-52.5 GB/s for
4-256 KiB copies through such a kernel, against 9 GB/s for 4 KiB DMA). Within kvsnap its rate
is bounded by the host building one descriptor per fragment (docs/benchmarks.md), and the grid
size made no difference between 16 and 264 programs; ``auto`` uses it for captures of a
tensor-parallel rank's head slice, where it writes exactly the rank's bytes of each host page.

The grid is persistent and bounded (``max_programs``, default 32): program ``p`` copies work
items ``p, p + P, p + 2P, ...``. Work items are the descriptors, with descriptors larger than
:data:`PIECE_BYTES` cut into pieces so one large copy is spread over programs. Each step of a
program moves a tile of ``ROWS`` items x ``BLOCK`` words (8 KiB), in the widest word (8/4/2/1
bytes) dividing every address and size of the job, looping until the tile's longest item is
done; ``BLOCK`` covers the median item, so many small fragments (128-byte head slices) share
a step instead of leaving lanes idle. When every address is 16-byte aligned the compiler is
told so and emits 128-bit accesses.

On CPU tensors the same kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``), which
dereferences the raw int64 addresses the kernel casts to pointers, exactly as the GPU does.
"""

from __future__ import annotations

import os
import types
from typing import Any

import numpy as np
import torch

from kvsnap.layout import CacheLayout
from kvsnap.transfer.base import CopyBackend, CopyJob
from kvsnap.transfer.plan import Direction

#: Descriptors larger than this are cut into pieces of this size (work-item balance).
PIECE_BYTES = 128 << 10
#: Bytes each program moves per loop step.
STEP_BYTES = 8 << 10
#: Default bound on the number of programs (persistent grid).
DEFAULT_MAX_PROGRAMS = 32

try:
    import triton
    import triton.language as tl

    #: Why triton cannot be imported here (``None`` when it can); the kernel modules share it.
    TRITON_IMPORT_ERROR: str | None = None
except ImportError as exc:  # pragma: no cover - triton is a dependency on Linux
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    TRITON_IMPORT_ERROR = f"triton cannot be imported ({exc})"


def interpreting() -> bool:
    """Whether Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


if triton is not None:

    def _uva_copy_kernel(
        src_ptrs,
        dst_ptrs,
        sizes,
        tile_words,
        num_items,
        WORD: tl.constexpr,
        WORD_BYTES: tl.constexpr,
        BLOCK: tl.constexpr,
        ROWS: tl.constexpr,
        ALIGNED_16: tl.constexpr,
    ):
        """Copy ``sizes[i]`` bytes from address ``src_ptrs[i]`` to ``dst_ptrs[i]``, every item.

        Each step takes ``ROWS`` items as a ``(ROWS, BLOCK)`` tile of words and loops until the
        longest of them (``tile_words``, per tile, from the host) is copied, so small fragments
        fill the lanes together and a long item is moved ``BLOCK`` words at a time.
        """
        program = tl.program_id(0)
        num_programs = tl.num_programs(0)
        rows = tl.arange(0, ROWS)
        columns = tl.arange(0, BLOCK)
        for first in range(program * ROWS, num_items, num_programs * ROWS):
            items = first + rows
            live = items < num_items
            src = tl.load(src_ptrs + items, mask=live, other=0).to(tl.pointer_type(WORD))
            dst = tl.load(dst_ptrs + items, mask=live, other=0).to(tl.pointer_type(WORD))
            words = tl.load(sizes + items, mask=live, other=0) // WORD_BYTES
            if ALIGNED_16:
                # Addresses and sizes are multiples of 16 bytes: telling the compiler lets it
                # emit 128-bit accesses (the mask changes only at 16-byte boundaries).
                src = tl.multiple_of(src, 16)
                dst = tl.multiple_of(dst, 16)
                words = tl.multiple_of(words, 16 // WORD_BYTES)
            longest = tl.load(tile_words + first // ROWS)
            for start in range(0, longest, BLOCK):
                offsets = start + columns
                mask = offsets[None, :] < words[:, None]
                values = tl.load(src[:, None] + offsets[None, :], mask=mask)
                tl.store(dst[:, None] + offsets[None, :], values, mask=mask)


_KERNELS: dict[tuple[Any, bool], Any] = {}


def rebound(function: Any, scope: dict[str, Any]) -> Any:
    """``function`` with ``scope`` as its globals, and everything else of it kept.

    ``types.FunctionType`` takes only the code: the copy would lose the parameters'
    annotations, and Triton's JIT finds a kernel's ``tl.constexpr`` parameters by them (an
    unannotated ``BLOCK`` is compiled as a runtime integer, which ``tl.arange`` refuses); the
    interpreter never looks, so only a compiled launch showed it (H100, 2026-12-06)."""
    copy = types.FunctionType(
        function.__code__, scope, function.__name__, function.__defaults__, function.__closure__
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__annotations__ = dict(function.__annotations__)
    copy.__qualname__ = function.__qualname__
    copy.__module__ = function.__module__
    copy.__doc__ = function.__doc__
    return copy


def kernel_for(function: Any, helpers: tuple[Any, ...] = ()) -> Any:
    """``function`` as a Triton kernel: JIT-compiled for the GPU, or interpreted on host memory
    under ``TRITON_INTERPRET=1`` (how the CPU test suite runs the GPU kernels); made once each.

    ``helpers`` are plain functions the kernel calls: JIT-compiled with it, or called as they
    are by the interpreter (a ``@triton.jit`` function cannot be called by a kernel that the
    interpreter runs when the variable was set after it was decorated, as tests set it)."""
    interpret = interpreting()
    kernel = _KERNELS.get((function, interpret))
    if kernel is None:
        target = function
        if helpers:
            # One scope for the kernel and its helpers, so a helper calling another finds it
            # compiled as well.
            scope = dict(function.__globals__)
            for helper in helpers:
                copy = rebound(helper, scope)
                scope[helper.__name__] = copy if interpret else triton.jit(copy)
            target = rebound(function, scope)
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction

            kernel = InterpretedFunction(target)
        else:
            kernel = triton.jit(target)
        _KERNELS[(function, interpret)] = kernel
    return kernel


def uva_copy_kernel() -> Any:
    """The copy kernel (see :func:`kernel_for`)."""
    return kernel_for(_uva_copy_kernel)


def word_bytes(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> tuple[int, bool]:
    """The copy word (8, 4, 2 or 1 bytes) for these descriptors, and whether all are 16-aligned."""
    if len(sizes) == 0:
        return 8, True
    combined = int(np.bitwise_or.reduce(src | dst | sizes))
    if combined == 0:
        return 8, True
    lowest_bit = combined & -combined
    return min(lowest_bit, 8), lowest_bit >= 16


def split_pieces(
    src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, piece: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut descriptors larger than ``piece`` bytes into consecutive pieces of at most ``piece``."""
    counts = np.maximum((sizes + piece - 1) // piece, 1)
    owner = np.repeat(np.arange(len(sizes)), counts)
    first_piece = np.repeat(np.cumsum(counts) - counts, counts)
    offsets = (np.arange(len(owner), dtype=np.int64) - first_piece) * piece
    return src[owner] + offsets, dst[owner] + offsets, np.minimum(sizes[owner] - offsets, piece)


def tile_shape(sizes: np.ndarray, word: int) -> tuple[int, int]:
    """``(BLOCK, ROWS)``: rows of ``BLOCK`` words, ``ROWS`` items per step of ``STEP_BYTES``.

    ``BLOCK`` is the power of two covering the median item (so lanes are seldom idle when
    items have similar sizes); longer items loop, shorter ones share a step with others.
    """
    step_words = STEP_BYTES // word
    sample = sizes[:: max(1, len(sizes) // 1024)]  # the median of a sample: cheap on any job
    median_words = max(int(np.median(sample)) // word, 1)
    block = min(1 << (median_words - 1).bit_length(), step_words)
    return block, step_words // block


def tile_longest(sizes: np.ndarray, rows: int, word: int) -> np.ndarray:
    """Words of the longest item in each tile of ``rows`` consecutive items."""
    padded = np.zeros(-(-len(sizes) // rows) * rows, dtype=np.int64)
    padded[: len(sizes)] = sizes
    return padded.reshape(-1, rows).max(axis=1) // word


class TritonBackend(CopyBackend):
    """The UVA copy kernel; options: ``max_programs`` (default 32), ``piece_bytes`` (128 KiB)."""

    name = "triton"

    def __init__(
        self,
        layout: CacheLayout,
        direction: Direction,
        *,
        max_programs: int = DEFAULT_MAX_PROGRAMS,
        piece_bytes: int = PIECE_BYTES,
        **options: Any,
    ) -> None:
        super().__init__(layout, direction, **options)
        if max_programs <= 0 or piece_bytes <= 0:
            raise ValueError(
                f"max_programs and piece_bytes must be positive ({max_programs}, {piece_bytes})"
            )
        self.max_programs = max_programs
        self.piece_bytes = piece_bytes
        self._kernel = uva_copy_kernel()

    @classmethod
    def probe(cls, device: torch.device) -> str | None:
        if TRITON_IMPORT_ERROR is not None:
            return TRITON_IMPORT_ERROR
        if device.type == "cuda":
            return None if torch.cuda.is_available() else "CUDA is not available"
        if device.type == "cpu" and interpreting():
            return None
        return f"the kernel needs CUDA (or TRITON_INTERPRET=1 on CPU); the cache is on {device}"

    def execute(self, job: CopyJob) -> None:
        descriptors = job.descriptors
        src, dst, sizes = descriptors.src, descriptors.dst, descriptors.sizes
        if len(sizes) == 0:
            return
        pinned = job.pinned
        if int(sizes.max()) > self.piece_bytes:
            src, dst, sizes = split_pieces(src, dst, sizes, self.piece_bytes)
            pinned = None
        word, aligned_16 = word_bytes(src, dst, sizes)
        num_items = len(sizes)
        block, rows = tile_shape(sizes, word)
        longest = tile_longest(sizes, rows, word)
        # One int64 table: src, dst and sizes (num_items each), then each tile's longest item.
        if self.device.type == "cuda":
            # The kernel reads its work items from device memory. The table is allocated on
            # this job's stream, which orders its reuse after the kernel; the handler's pinned
            # descriptor buffers stay untouched until the job completes, so they copy async.
            table = torch.empty(3 * num_items + len(longest), dtype=torch.int64, device=self.device)
            if pinned is not None:
                for index, values in enumerate(pinned):
                    table[index * num_items : (index + 1) * num_items].copy_(
                        values, non_blocking=True
                    )
                table[3 * num_items :].copy_(torch.from_numpy(longest), non_blocking=True)
            else:
                host = torch.from_numpy(np.concatenate((src, dst, sizes, longest)))
                table.copy_(host, non_blocking=True)
        else:
            table = torch.from_numpy(np.concatenate((src, dst, sizes, longest)))
        grid = (min(len(longest), self.max_programs),)
        dtype = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}[word]
        self._kernel[grid](
            table[:num_items],
            table[num_items : 2 * num_items],
            table[2 * num_items : 3 * num_items],
            table[3 * num_items :],
            num_items,
            WORD=dtype,
            WORD_BYTES=word,
            BLOCK=block,
            ROWS=rows,
            ALIGNED_16=aligned_16,
        )
