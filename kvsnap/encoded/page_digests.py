"""The xxh3-64 and BLAKE3-256 of equal pages lying back to back in one buffer, computed where
the buffer lies: on a CUDA device by the kernels restores check pages with
(:mod:`kvsnap.transfer.page_hash`, :mod:`kvsnap.transfer.page_blake3`) where they take the
page size, else on the host (:mod:`kvsnap.format.hashing`); bit for bit the same digests.

A capture straight to an encoded file hashes its pages here twice: the ordinary file's pages
(its block checksums, which its trailer stands for) and the stored fp8 pages (their ``.pages``
and, signed, ``.digests``). The results stay where they were computed until :func:`to_host`,
so a caller hashing many tensors waits for the device once.
"""

from __future__ import annotations

import numpy as np
import torch

from kvsnap.format.constants import PAGE_DIGEST_BYTES
from kvsnap.format.hashing import block_digests, page_digests
from kvsnap.pipeline.page_checks import hash_constants
from kvsnap.transfer import page_blake3, page_hash
from kvsnap.transfer.triton_copy import interpreting


def _on_device(buffer: torch.Tensor) -> bool:
    # Triton's interpreter runs kernels on host memory only.
    return buffer.device.type == "cuda" and not interpreting()


def _host_bytes(buffer: torch.Tensor) -> np.ndarray:
    return buffer.detach().cpu().numpy().reshape(-1).view(np.uint8)


def _page_words(count: int, page_bytes: int, device: torch.device) -> torch.Tensor:
    """Each page's offset in 8-byte words, made on the device (nothing to upload)."""
    return torch.arange(count, dtype=torch.int64, device=device) * (page_bytes // 8)


def xxh3_pages(buffer: torch.Tensor, page_bytes: int) -> torch.Tensor:
    """The xxh3-64 of every ``page_bytes`` page of ``buffer`` (uint8, contiguous, a whole
    number of pages) as int64 bit patterns: on the buffer's CUDA device where
    :func:`~kvsnap.transfer.page_hash.supports` the page size, else on the host."""
    count = buffer.numel() // page_bytes
    if _on_device(buffer) and page_hash.supports(page_bytes) and count:
        digests = torch.empty(count, dtype=torch.int64, device=buffer.device)
        words = _page_words(count, page_bytes, buffer.device)
        constants = hash_constants(buffer.device, page_bytes)
        page_hash.launch_page_digests_at_words(buffer, words, page_bytes, constants, digests)
        return digests
    host = block_digests(_host_bytes(buffer), page_bytes) if count else np.empty(0, np.uint64)
    return torch.from_numpy(host.view(np.int64))


def blake3_pages(buffer: torch.Tensor, page_bytes: int) -> torch.Tensor:
    """The BLAKE3-256 of every ``page_bytes`` page of ``buffer`` as int32 ``(pages, 8)`` (each
    row the digest's bytes): on the buffer's CUDA device where
    :func:`~kvsnap.transfer.page_blake3.supports` the page size and the pages start on whole
    8-byte words, else on the host."""
    count = buffer.numel() // page_bytes
    device_ok = page_blake3.supports(page_bytes) and page_bytes % 8 == 0
    if _on_device(buffer) and device_ok and count:
        digests = torch.empty((count, 8), dtype=torch.int32, device=buffer.device)
        words = _page_words(count, page_bytes, buffer.device)
        page_blake3.launch_page_blake3_at_words(buffer, words, page_bytes, digests)
        return digests
    if not count:
        return torch.empty((0, 8), dtype=torch.int32)
    host = page_digests(_host_bytes(buffer), page_bytes)
    return torch.from_numpy(np.ascontiguousarray(host).view(np.int32).reshape(count, 8))


def to_host(digests: list[torch.Tensor], kind: str) -> np.ndarray:
    """Digests from :func:`xxh3_pages` (``kind`` ``"xxh3"``: a ``(len(digests), pages)``
    uint64 array) or :func:`blake3_pages` (``"blake3"``: ``(len(digests), pages, 32)`` uint8),
    brought to the host, one row per tensor."""
    rows = [digest.cpu().numpy() for digest in digests]
    if kind == "xxh3":
        return np.stack(rows).view(np.uint64) if rows else np.empty((0, 0), np.uint64)
    if not rows:
        return np.empty((0, 0, PAGE_DIGEST_BYTES), np.uint8)
    stacked = np.ascontiguousarray(np.stack(rows))
    return stacked.view(np.uint8).reshape(len(rows), -1, PAGE_DIGEST_BYTES)
