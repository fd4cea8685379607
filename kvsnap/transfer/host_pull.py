"""A small pinned host array onto the device by a kernel's loads, beside the copy engines.

A restore queues hundreds of MiB of pages on a copy engine, which serves host-to-device copies
in the order they came: a few MiB of tables copied after them arrive after the last page, and
copied before them hold the first page back until the host has built them. A kernel reads
pinned host memory directly (its device address is its host address under unified virtual
addressing) and its loads cross PCIe beside the engine's copies, so the tables can be built
while the pages are already moving and still reach the device long before the last page.
"""

from __future__ import annotations

from typing import Any

import torch

from kvsnap.transfer.triton_copy import kernel_for, tl, triton

#: int64 words each program moves.
BLOCK_WORDS = 1024

if triton is not None:

    def _pull_kernel(source, target, num_words, BLOCK: tl.constexpr):
        """``target[i] = source[i]`` for ``i < num_words``, ``BLOCK`` words per program."""
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < num_words
        tl.store(target + offsets, tl.load(source + offsets, mask=inside), mask=inside)


def _kernel() -> Any:
    return kernel_for(_pull_kernel)


def pull_to_device(pinned: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of the pinned host tensor ``pinned`` (contiguous, a whole number of 8-byte words)
    on ``device``, made by a kernel on its current stream. ``pinned`` must stay untouched until
    that stream has passed the kernel: torch's pinned allocator does not see a kernel read it
    (the caller synchronizes before dropping it). Under Triton's interpreter (CPU tensors), the
    same kernel copies host memory."""
    if not pinned.is_contiguous() or pinned.numel() * pinned.element_size() % 8:
        raise ValueError("pull_to_device takes a contiguous tensor of whole 8-byte words")
    if pinned.numel() == 0:
        return torch.empty(pinned.shape, dtype=pinned.dtype, device=device)
    words = pinned.view(torch.int64).reshape(-1)
    target = torch.empty(words.numel(), dtype=torch.int64, device=device)
    grid = (triton.cdiv(words.numel(), BLOCK_WORDS),)
    _kernel()[grid](words, target, words.numel(), BLOCK=BLOCK_WORDS)
    return target.view(pinned.dtype).reshape(pinned.shape)
