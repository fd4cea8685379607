"""An fp8 snapshot restored into CUDA caches: its e4m3 bytes cross PCIe (half the bytes of
bf16), each page is checked on the device against its stored digest and dequantized where it
lands by the fused dequantizing scatter (:mod:`kvsnap.transfer.page_dequant`), bit for bit what
the host decode gives.

The file was opened without reading a page (:mod:`kvsnap.encoded.fp8_open`): its header,
scales and page checks were checked then. Each layer tensor's range of stored blocks is one
copy into one device buffer, out of the hot tier's registered mapping of the file (the same
tier, admission and bounds as ordinary snapshots: ``kvsnap.store.hot.tier``) or, before the
tier holds the file, read from its descriptor. One launch per tensor group checks every page
(xxh3-64, or with keys its signed BLAKE3-256: the kernels of the ordinary restore), and the
scatter writes only the pages that passed; any other page is named in a
``RestoreIncompleteError`` with the target blocks to recompute, as an ordinary restore does.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvsnap.encoded.fp8_open import OpenFp8File
from kvsnap.errors import RestoreIncompleteError
from kvsnap.format import encoded as enc
from kvsnap.format.fit import check_fits
from kvsnap.format.hashing import block_digests, page_digests
from kvsnap.layout import CacheLayout
from kvsnap.pipeline.jobs import RestoreResult, restore_pairs
from kvsnap.pipeline.page_checks import hash_constants
from kvsnap.store.hot.tier import HotFile, hot_tier
from kvsnap.transfer import page_blake3, page_dequant, page_hash
from kvsnap.transfer.page_copy import kernel_table
from kvsnap.transfer.page_table import PageTable


def fp8_restorable(encoded: Any, layouts: Sequence[CacheLayout]) -> bool:
    """Whether a restore of ``encoded`` into ``layouts`` takes this path: an fp8 snapshot
    opened by :func:`~kvsnap.encoded.fp8_open.open_fp8_file`, into CUDA caches."""
    if not isinstance(encoded, OpenFp8File):
        return False
    return all(layout.device.type == "cuda" for layout in layouts)


def _checks_on_device(encoded: OpenFp8File, page_bytes: int, device: torch.device) -> bool:
    """Whether pages are checked on the device (CUDA, and a page size the kernels take);
    otherwise on the host, before the copy (host memory: the tests under the interpreter)."""
    kernel = page_blake3 if encoded.signed_pages else page_hash
    return device.type == "cuda" and kernel.supports(page_bytes)


def _lease(encoded: OpenFp8File) -> HotFile | None:
    """The file from the hot tier, leased, or ``None`` (not held yet, or no CUDA)."""
    tier = hot_tier()
    if not tier.enabled:
        return None
    return tier.lookup(encoded.path, encoded.fd, encoded.status)


def _stage_values(
    encoded: OpenFp8File,
    names: list[str],
    low: int,
    high: int,
    lease: HotFile | None,
    device: torch.device,
) -> tuple[torch.Tensor, np.ndarray | None]:
    """The stored blocks ``low .. high`` of each tensor, back to back on ``device``; also on
    the host when read from the descriptor (``None`` when copied out of the mapping)."""
    page = encoded.layout.by_name[names[0]].nbytes // encoded.layout.by_name[names[0]].shape[0]
    span = (high - low) * page
    values = torch.empty(len(names) * span, dtype=torch.uint8, device=device)
    if lease is not None:
        assert lease.host is not None
        for index, name in enumerate(names):
            begin = encoded.layout.by_name[name].begin + low * page
            target = values[index * span : (index + 1) * span]
            target.copy_(lease.host[begin : begin + span], non_blocking=True)
        return values, None
    host = np.empty(len(names) * span, dtype=np.uint8)
    for index, name in enumerate(names):
        begin = encoded.layout.by_name[name].begin + low * page
        host[index * span : (index + 1) * span] = encoded.read(begin, span)
    values.copy_(torch.from_numpy(host))
    return values, host


def _page_checks(
    encoded: OpenFp8File,
    names: list[str],
    blocks: np.ndarray,
    values: torch.Tensor,
    host: np.ndarray | None,
    starts: np.ndarray,
    page_bytes: int,
) -> torch.Tensor:
    """Per staged page (tensor, then ``blocks``), 1 when it equals its stored digest, else
    0 (``int64``, on the values' device): checked there, or on the host where the kernels do
    not take pages of ``page_bytes``."""
    suffix = enc.DIGESTS_SUFFIX if encoded.signed_pages else enc.PAGES_SUFFIX
    rows = [encoded.tensor(name + suffix) for name in names]
    if encoded.signed_pages:
        stored = np.concatenate([row.reshape(-1, 32)[blocks] for row in rows])
    else:
        stored = np.concatenate([row.view("<u8")[blocks] for row in rows])
    device = values.device
    if not _checks_on_device(encoded, page_bytes, device):
        assert host is not None
        ok = np.array(
            [
                _host_page_ok(host, int(at), page_bytes, row, encoded.signed_pages)
                for at, row in zip(starts, stored, strict=True)
            ],
            dtype=np.int64,
        )
        return torch.from_numpy(ok).to(device)
    page_ok = torch.zeros(len(starts), dtype=torch.int64, device=device)
    words = torch.from_numpy(starts // 8).to(device, non_blocking=True)
    if encoded.signed_pages:
        expected = torch.from_numpy(stored.view("<i4").reshape(-1, 8).copy()).to(device)
        page_blake3.launch_page_blake3_checks_at_words(values, words, page_bytes, expected, page_ok)
    else:
        expected = torch.from_numpy(stored.view(np.int64).copy()).to(device)
        constants = hash_constants(device, page_bytes)
        page_hash.launch_page_checks_at_words(
            values, words, page_bytes, constants, expected, page_ok
        )
    return page_ok


def _host_page_ok(host: np.ndarray, at: int, page_bytes: int, row: Any, signed: bool) -> int:
    page = host[at : at + page_bytes]
    if signed:
        return int(bool((page_digests(page, page_bytes)[0] == row).all()))
    return int(block_digests(page, page_bytes)[0] == row)


def restore_fp8(
    snapshot: Any,
    layout: CacheLayout | Sequence[CacheLayout],
    block_ids: Mapping[str, np.ndarray | Sequence[int]],
    model_fingerprint: str | None,
    force: bool,
) -> RestoreResult | None:
    """``Snapshot.restore`` of an encoded ``snapshot`` into ``layout`` (one layout or one per
    TP rank) on the device when :func:`fp8_restorable` says it takes this path; ``None`` when
    it does not (the pipeline restores the decoded file then)."""
    layouts = [layout] if isinstance(layout, CacheLayout) else list(layout)
    if not fp8_restorable(snapshot.encoded, layouts):
        return None
    return restore_fp8_on_device(
        snapshot, layouts, block_ids, model_fingerprint=model_fingerprint, force=force
    )


def restore_fp8_on_device(
    snapshot: Any,
    layouts: Sequence[CacheLayout],
    block_ids: Mapping[str, np.ndarray | Sequence[int]],
    *,
    model_fingerprint: str | None = None,
    force: bool = False,
) -> RestoreResult:
    """Restore the sequences of ``block_ids`` from the open fp8 ``snapshot`` (a
    ``kvsnap.Snapshot`` whose ``encoded`` is an :class:`OpenFp8File`) into the CUDA caches of
    ``layouts``; ``RestoreIncompleteError`` when a page failed its check (every other page is
    written)."""
    started = time.perf_counter()
    encoded: OpenFp8File = snapshot.encoded
    check_fits(
        snapshot.metadata,
        layouts[0].geometry,
        path=snapshot.path,
        model_fingerprint=model_fingerprint,
        force=force,
    )
    capacity = min(layout.num_blocks for layout in layouts)
    blocks, target_blocks, num_tokens = restore_pairs(
        snapshot.metadata.sequences, block_ids, capacity, snapshot.path
    )
    table = PageTable(list(layouts))
    passed, moved_bytes = _move_and_scatter(encoded, table, blocks, target_blocks)
    result = RestoreResult(
        num_sequences=len(block_ids),
        num_tokens=num_tokens,
        num_blocks=len(blocks),
        num_bytes=moved_bytes,
        seconds=time.perf_counter() - started,
        backend="fp8-dequant",
    )
    if not passed.all():
        raise _incomplete(passed, list(table.names), target_blocks, encoded, result)
    return result


def _move_and_scatter(
    encoded: OpenFp8File, table: PageTable, blocks: np.ndarray, target_blocks: np.ndarray
) -> tuple[np.ndarray, int]:
    """Stage, check and scatter the pages of stored ``blocks`` into ``target_blocks`` of
    ``table``'s caches: per page (tensor, then block) whether it passed its check, and the
    bytes moved to the device."""
    names = list(table.names)
    device = table.device
    shape = encoded.layout.by_name[names[0]].shape
    page_bytes = int(np.prod(shape[1:]))
    low, high = int(blocks.min()), int(blocks.max()) + 1
    lease = _lease(encoded) if _checks_on_device(encoded, page_bytes, device) else None
    try:
        values, host = _stage_values(encoded, names, low, high, lease, device)
        span = (high - low) * page_bytes
        starts = np.arange(len(names))[:, None] * span + (blocks - low)[None, :] * page_bytes
        starts = starts.reshape(-1)
        page_ok = _page_checks(encoded, names, blocks, values, host, starts, page_bytes)
        scales = np.concatenate([encoded.scales[name][blocks] for name in names])
        copies = page_dequant.dequant_copies(
            table, np.repeat(np.arange(len(names)), len(blocks)), np.tile(target_blocks, len(names))
        )
        page_dequant.launch_dequant(
            copies,
            torch.from_numpy(kernel_table(copies)).to(device, non_blocking=True),
            table,
            values,
            torch.from_numpy(starts).to(device, non_blocking=True),
            torch.from_numpy(scales).to(device, non_blocking=True),
            page_ok=page_ok,
        )
        passed = page_ok.cpu().numpy()  # waits for the scatter: its last step reads page_ok
    finally:
        if lease is not None:
            event = torch.cuda.Event()
            event.record()
            hot_tier().release(lease, event)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return passed, values.numel() + scales.nbytes


def _incomplete(
    passed: np.ndarray,
    names: list[str],
    target_blocks: np.ndarray,
    encoded: OpenFp8File,
    result: RestoreResult,
) -> RestoreIncompleteError:
    failed = np.flatnonzero(passed == 0)
    tensors, positions = np.divmod(failed, len(target_blocks))
    check = "signed digest" if encoded.signed_pages else "checksum"
    blocks = np.unique(target_blocks[positions])
    return RestoreIncompleteError(
        f"{len(failed)} page(s) failed their {check} and were not restored ({len(blocks)} "
        f"target block(s), first: {names[int(tensors[0])]}, target block "
        f"{int(target_blocks[positions[0]])})",
        file=encoded.file,
        failed_block_ids=blocks,
        result=result,
    )
