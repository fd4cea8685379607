"""Pages for the device BLAKE3 tests (``tests/transfer/test_page_blake3*.py``): random pages at
scattered offsets of one buffer, and their digests by the ``blake3`` package in the kernel's
layout."""

from __future__ import annotations

import blake3
import numpy as np
import torch


def scattered_pages(
    page_bytes: int, count: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, list[bytes]]:
    """``count`` random pages in one buffer, in shuffled order with gaps of 0-3 words between
    them: the buffer (uint8, on the host), each page's offset in 8-byte words, and the pages'
    bytes."""
    rng = np.random.default_rng(seed)
    slot_words = -(-page_bytes // 8)
    gaps = rng.integers(0, 4, count)
    starts = np.cumsum(gaps + slot_words) - slot_words  # each slot after its gap
    words = starts[rng.permutation(count)]  # page i in a shuffled slot
    data = rng.integers(0, 256, int(starts[-1] + slot_words + 2) * 8, dtype=np.uint8)
    pages = [data[8 * int(w) : 8 * int(w) + page_bytes].tobytes() for w in words]
    return torch.from_numpy(data), torch.from_numpy(words.astype(np.int64)), pages


def host_digests(pages: list[bytes]) -> np.ndarray:
    """The ``blake3`` package's digests as the kernel writes them: per page 8 little-endian
    32-bit words (int32)."""
    return np.stack(
        [np.frombuffer(blake3.blake3(page).digest(), dtype="<u4").view(np.int32) for page in pages]
    )
