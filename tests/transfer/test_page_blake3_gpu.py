"""BLAKE3 of pages compiled on the GPU (skipped without CUDA): thousands of pages at scattered
offsets of one device buffer, bit-identical with the ``blake3`` package, for sizes of every
lane count and tiled sizes up to a MiB; other kernel shapes giving the same digests; the
check launch flagging exactly the pages altered anywhere, and those whose stored digest
differs in one word.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsnap.transfer import page_blake3
from kvsnap.transfer.page_blake3 import KernelShape
from tests.support.blake3_pages import host_digests, scattered_pages

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
#: A size for each lane count (1, 2, 4, 8, 16, 32 chunks side by side), whole and partial last
#: chunks, MLA's 18 KiB, then pages of more than 32 chunks (tiles of 32): 34 chunks with a
#: partial last one, a MiB less a word, a MiB. Each size is a compile (a few seconds); the
#: interpreter test takes the rest of the sizes.
SIZES = [
    *(4, 68, 1020, 1028, 3 * 1024, 5 * 1024 + 12, 16 << 10, 18 << 10, 32 << 10),
    *(33 * 1024 + 4, (1 << 20) - 4, 1 << 20),
]


def device_digests(
    page_bytes: int, count: int, seed: int, shape: KernelShape | None = None
) -> tuple[np.ndarray, list[bytes]]:
    buffer, words, pages = scattered_pages(page_bytes, count, seed)
    digests = torch.full((count, 8), 7, dtype=torch.int32, device=DEVICE)
    page_blake3.launch_page_blake3_at_words(
        buffer.to(DEVICE), words.to(DEVICE), page_bytes, digests, shape
    )
    return digests.cpu().numpy(), pages


@pytest.mark.parametrize(("page_bytes", "count"), [(32 << 10, 4096), (18 << 10, 2048)])
def test_thousands_of_pages_are_blake3s(page_bytes: int, count: int) -> None:
    got, pages = device_digests(page_bytes, count, seed=1)
    assert np.array_equal(got, host_digests(pages))


@pytest.mark.parametrize("page_bytes", SIZES)
def test_every_size_is_blake3s(page_bytes: int) -> None:
    count = 24 if page_bytes > 64 << 10 else 200
    got, pages = device_digests(page_bytes, count, seed=page_bytes)
    assert np.array_equal(got, host_digests(pages))


@pytest.mark.parametrize(
    "shape",
    [
        KernelShape(32, 1, 1, True),  # a page a warp
        KernelShape(8, 16, 8, True),  # tiles of 8 chunks for 32 KiB pages
        KernelShape(32, 4, 2, False),  # word loads
    ],
)
@pytest.mark.parametrize("page_bytes", [5 * 1024 + 12, 32 << 10])
def test_other_shapes_give_the_same_digests(page_bytes: int, shape: KernelShape) -> None:
    got, pages = device_digests(page_bytes, 301, seed=7, shape=shape)
    assert np.array_equal(got, host_digests(pages))


def test_check_flags_exactly_the_altered_pages() -> None:
    page_bytes, count = 18 << 10, 2048
    buffer, words, pages = scattered_pages(page_bytes, count, seed=11)
    stored = host_digests(pages)
    rng = np.random.default_rng(11)
    altered = rng.choice(count, 300, replace=False)
    flipped, changed = altered[:200], altered[200:]
    data = buffer.numpy()
    for page, position in zip(flipped, rng.integers(0, page_bytes, 200), strict=True):
        data[8 * int(words[page]) + int(position)] ^= 1 << int(rng.integers(0, 8))
    bits = np.left_shift(np.uint32(1), rng.integers(0, 32, 100).astype(np.uint32))
    stored[changed, rng.integers(0, 8, 100)] ^= bits.view(np.int32)
    page_ok = torch.full((count,), 7, dtype=torch.int64, device=DEVICE)
    page_blake3.launch_page_blake3_checks_at_words(
        buffer.to(DEVICE),
        words.to(DEVICE),
        page_bytes,
        torch.from_numpy(stored).to(DEVICE),
        page_ok,
    )
    want = np.ones(count, dtype=np.int64)
    want[altered] = 0
    assert np.array_equal(page_ok.cpu().numpy(), want)
