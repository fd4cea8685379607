"""The tables of an fp8 device restore, and its per-piece checks and dequantizing scatter.

For the pages a restore moves (:mod:`kvsnap.encoded.device_restore`), the host works out each
page's place in the staged values, its scales, where the dequantizing kernel writes it
(:func:`~kvsnap.transfer.page_dequant.dequant_copies`) and its stored check, and sends them to
the device in one pinned buffer; :class:`Scatter` then enqueues, piece by piece, the checks of
the pages that have arrived (xxh3-64, or with keys their signed BLAKE3-256) and the scatter
that writes only the pages that passed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvsnap.encoded.fp8_open import OpenFp8File
from kvsnap.format import encoded as enc
from kvsnap.format.hashing import block_digests, page_digests
from kvsnap.pipeline.page_checks import hash_constants
from kvsnap.transfer import page_blake3, page_dequant, page_hash
from kvsnap.transfer.host_pull import pull_to_device
from kvsnap.transfer.page_copy import kernel_table
from kvsnap.transfer.page_table import PageTable


def checks_on_device(encoded: OpenFp8File, page_bytes: int, device: torch.device) -> bool:
    """Whether pages are checked on the device (CUDA, and a page size the kernels take);
    otherwise on the host, before the copy (host memory: the tests under the interpreter)."""
    kernel = page_blake3 if encoded.signed_pages else page_hash
    return device.type == "cuda" and kernel.supports(page_bytes)


def _stored_checks(encoded: OpenFp8File, names: list[str], blocks: np.ndarray) -> np.ndarray:
    """Each page's stored check, tensor then ``blocks``: its xxh3-64 (``uint64``) or, opened
    with keys, its signed BLAKE3-256 (``uint8 (pages, 32)``)."""
    if encoded.signed_pages:
        rows = [encoded.tensor(name + enc.DIGESTS_SUFFIX).reshape(-1, 32) for name in names]
    else:
        rows = [encoded.tensor(name + enc.PAGES_SUFFIX).view("<u8") for name in names]
    return np.concatenate([row[blocks] for row in rows])


def host_checks(
    encoded: OpenFp8File, host: np.ndarray, starts: np.ndarray, stored: np.ndarray, page_bytes: int
) -> np.ndarray:
    """1 per page of ``host`` (at ``starts``) that equals its ``stored`` check, else 0."""
    ok = np.empty(len(starts), dtype=np.int64)
    for index, at in enumerate(starts.tolist()):
        page = host[at : at + page_bytes]
        if encoded.signed_pages:
            ok[index] = bool((page_digests(page, page_bytes)[0] == stored[index]).all())
        else:
            ok[index] = block_digests(page, page_bytes)[0] == stored[index]
    return ok


def _launch_checks(
    encoded: OpenFp8File,
    values: torch.Tensor,
    words: torch.Tensor,
    page_bytes: int,
    expected: torch.Tensor,
    page_ok: torch.Tensor,
) -> None:
    """Enqueue the device checks of the pages at ``words`` (8-byte words of ``values``)."""
    if encoded.signed_pages:
        page_blake3.launch_page_blake3_checks_at_words(values, words, page_bytes, expected, page_ok)
        return
    constants = hash_constants(values.device, page_bytes)
    page_hash.launch_page_checks_at_words(values, words, page_bytes, constants, expected, page_ok)


@dataclass
class Staged:
    """A restore's per-page arrays on the device: each page's first byte in the staged values
    and its scales (what the scatter reads), the checks' verdicts (``page_ok``), and for checks
    on the device each page's offset in words and its stored check."""

    starts: torch.Tensor
    scales: torch.Tensor
    page_ok: torch.Tensor
    stored: np.ndarray
    host_starts: np.ndarray
    words: torch.Tensor | None = None
    expected: torch.Tensor | None = None


@dataclass
class Scatter:
    """The dequantizing scatter of a restore's staged pages, piece by piece."""

    table: PageTable
    copies: list[Any]
    arrays: torch.Tensor
    values: torch.Tensor
    staged: Staged
    exact: bool
    #: The pinned host buffer the tables came from (kept until the restore has synchronized).
    pinned: torch.Tensor | None = None

    def piece(self, encoded: OpenFp8File, first: int, stop: int, page_bytes: int) -> None:
        """Enqueue the checks (on the device) and the scatter of staged pages ``first`` to
        ``stop`` (exclusive)."""
        staged = self.staged
        if staged.words is not None and staged.expected is not None:
            _launch_checks(
                encoded,
                self.values,
                staged.words[first:stop],
                page_bytes,
                staged.expected[first:stop],
                staged.page_ok[first:stop],
            )
        page_dequant.launch_dequant(
            self.copies,
            self.arrays,
            self.table,
            self.values,
            staged.starts,
            staged.scales,
            page_ok=staged.page_ok,
            slot_pages=(first, stop),
            exact=self.exact,
        )


def prepare_scatter(
    encoded: OpenFp8File,
    table: PageTable,
    pairs: tuple[np.ndarray, np.ndarray],
    starts: np.ndarray,
    scales: np.ndarray,
    values: torch.Tensor,
    on_device: bool,
    pull: bool = False,
) -> Scatter:
    """The scatter of stored blocks ``pairs[0]`` into target blocks ``pairs[1]``: its tables
    built on the host in one pinned buffer and moved to the device at once, by a kernel
    (``pull``: the pages' copies are queued already) or by a copy."""
    blocks, target_blocks = pairs
    names = list(table.names)
    stored = _stored_checks(encoded, names, blocks)
    copies = page_dequant.dequant_copies(
        table, np.repeat(np.arange(len(names)), len(blocks)), np.tile(target_blocks, len(names))
    )
    arrays = [starts, scales, kernel_table(copies)]
    if on_device:
        raw = stored.view("<i4").reshape(-1, 8) if encoded.signed_pages else stored.view("<i8")
        arrays += [starts // 8, raw]
    uploaded, pinned = _upload_together(arrays, values.device, pull)
    page_ok = torch.zeros(len(starts), dtype=torch.int64, device=values.device)
    staged = Staged(uploaded[0], uploaded[1], page_ok, stored, starts, *uploaded[3:])
    exact = page_dequant.needs_exact(scales)
    return Scatter(table, copies, uploaded[2], values, staged, exact, pinned)


def _upload_together(
    arrays: list[np.ndarray], device: torch.device, pull: bool
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """``arrays`` on ``device`` at once, each a view of its own 16-byte-aligned bytes of one
    buffer, in its dtype and shape, and the pinned host buffer they came from. The buffer is
    pinned: a copy out of pageable memory holds the host until the driver has staged every
    byte. With ``pull`` a kernel moves it (:func:`~kvsnap.transfer.host_pull.pull_to_device`),
    else a copy (torch's pinned allocator hands the buffer out again once it has completed)."""
    sizes = [-(-array.nbytes // 16) * 16 for array in arrays]
    offsets = np.concatenate(([0], np.cumsum(sizes)))
    pinned = device.type == "cuda"
    buffer = torch.empty(int(offsets[-1]), dtype=torch.uint8, pin_memory=pinned)
    joined = buffer.numpy()
    for array, offset in zip(arrays, offsets.tolist(), strict=False):
        joined[offset : offset + array.nbytes] = np.ascontiguousarray(array).view(np.uint8).ravel()
    if pull:
        on_device = pull_to_device(buffer, device)
    else:
        on_device = buffer.to(device, non_blocking=True)
    views = []
    for array, offset in zip(arrays, offsets.tolist(), strict=False):
        dtype = _TORCH_TYPES[np.dtype(array.dtype).newbyteorder("=")]
        piece = on_device[offset : offset + array.nbytes].view(dtype)
        views.append(piece.reshape(array.shape))
    return views, buffer if pinned else None


#: torch dtypes of the table arrays a restore uploads.
_TORCH_TYPES = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.uint64): torch.int64,
}
