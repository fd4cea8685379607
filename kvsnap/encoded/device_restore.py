"""An fp8 snapshot restored into CUDA caches: its e4m3 bytes cross PCIe (half the bytes of
bf16), each page is checked on the device against its stored digest and dequantized where it
lands by the fused dequantizing scatter (:mod:`kvsnap.transfer.page_dequant`), bit for bit what
the host decode gives.

The file was opened without reading a page (:mod:`kvsnap.encoded.fp8_open`): its header,
scales and page checks were checked then. Each layer tensor's range of stored blocks is one
copy into one device buffer, out of the hot tier's registered mapping of the file (the same
tier, admission and bounds as ordinary snapshots: ``kvsnap.store.hot.tier``) or, before the
tier holds the file, read from its descriptor on threads. The tensors go in :data:`PIECES`
pieces: each piece's pages are checked on the device once it has arrived (xxh3-64, or with
keys their signed BLAKE3-256: the kernels of the ordinary restore) and scattered while the
next piece arrives, the scatter writing only the pages that passed; any other page is named in
a ``RestoreIncompleteError`` with the target blocks to recompute, as an ordinary restore does.
Out of the hot tier, every piece's copies are queued first (the driver's ``cuMemcpyAsync``,
microseconds a call), so the bus is busy while the host builds the checks' and the scatter's
tables (:mod:`kvsnap.encoded.device_scatter`); a kernel pulls those out of pinned memory, since
a copy engine serves its copies in the order they came and a copy of the tables would arrive
after the last page.
``Snapshot.restore`` takes this path (:func:`restore_fp8`), and the vLLM worker's load of an
fp8 chunk (:func:`restore_fp8_blocks`).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from kvsnap.encoded.device_scatter import Staged, checks_on_device, host_checks, prepare_scatter
from kvsnap.encoded.fp8_open import OpenFp8File
from kvsnap.errors import RestoreIncompleteError
from kvsnap.format.fit import check_fits
from kvsnap.layout import CacheLayout
from kvsnap.pipeline.jobs import RestoreResult, block_pairs, restore_pairs
from kvsnap.store.hot.tier import HotFile, hot_tier
from kvsnap.transfer.cuda_batch import resolve_driver
from kvsnap.transfer.page_table import PageTable


def fp8_restorable(encoded: Any, layouts: Sequence[CacheLayout]) -> bool:
    """Whether a restore of ``encoded`` into ``layouts`` takes this path: an fp8 snapshot
    opened by :func:`~kvsnap.encoded.fp8_open.open_fp8_file`, into CUDA caches."""
    if not isinstance(encoded, OpenFp8File):
        return False
    return all(layout.device.type == "cuda" for layout in layouts)


#: Pieces a device restore is cut into (by tensors): a piece is copied while the one before
#: it is checked and scattered.
PIECES = 8
#: Threads reading a file the hot tier does not hold.
READ_THREADS = 4


def _lease(encoded: OpenFp8File) -> HotFile | None:
    """The file from the hot tier, leased, or ``None`` (not held yet, or no CUDA)."""
    tier = hot_tier()
    if not tier.enabled:
        return None
    return tier.lookup(encoded.path, encoded.fd, encoded.status)


def _read_values(
    encoded: OpenFp8File, names: list[str], low: int, span: int
) -> tuple[np.ndarray, list[Future[None]]]:
    """The stored blocks from ``low`` (``span`` bytes) of each tensor, back to back in host
    memory, read from the descriptor on :data:`READ_THREADS` threads: the buffer and one
    future per tensor (a cold file is read at the disk's pace while pieces already read move
    on)."""
    host = np.empty(len(names) * span, dtype=np.uint8)
    first_byte = low * _page_bytes(encoded, names[0])

    def read(index: int) -> None:
        begin = encoded.layout.by_name[names[index]].begin + first_byte
        host[index * span : (index + 1) * span] = encoded.read(begin, span)

    pool = _read_pool()
    return host, [pool.submit(read, index) for index in range(len(names))]


def _page_bytes(encoded: OpenFp8File, name: str) -> int:
    stored = encoded.layout.by_name[name]
    return stored.nbytes // max(stored.shape[0], 1)


_POOL: list[ThreadPoolExecutor] = []
_POOL_LOCK = threading.Lock()


def _read_pool() -> ThreadPoolExecutor:
    """The process's read threads (made on the first read: most processes never read)."""
    with _POOL_LOCK:
        if not _POOL:
            _POOL.append(ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kvsnap-fp8-read"))
        return _POOL[0]


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream a device restore copies pieces on (one per device, made once)."""
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device)
    return stream


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _pieces(count: int) -> list[tuple[int, int]]:
    """``[first, last)`` tensor ranges of about :data:`PIECES` equal pieces."""
    bounds = np.linspace(0, count, min(PIECES, count) + 1).round().astype(int).tolist()
    return list(itertools.pairwise(bounds))


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


def restore_fp8_blocks(
    snapshot: Any,
    layouts: Sequence[CacheLayout],
    snapshot_blocks: np.ndarray | Sequence[int],
    target_blocks: np.ndarray | Sequence[int],
) -> RestoreResult:
    """``Pipeline.restore_blocks`` of the open fp8 ``snapshot`` (checked as
    :func:`restore_fp8_on_device` checks it, fingerprint apart: the caller's) into the CUDA
    caches of ``layouts``: stored blocks ``snapshot_blocks`` into ``target_blocks``. What an
    engine's worker calls for a chunk it loads."""
    started = time.perf_counter()
    encoded: OpenFp8File = snapshot.encoded
    check_fits(snapshot.metadata, layouts[0].geometry, path=snapshot.path, force=True)
    capacity = min(layout.num_blocks for layout in layouts)
    sources, targets = block_pairs(
        snapshot_blocks, target_blocks, snapshot.metadata.num_blocks, capacity
    )
    table = PageTable(list(layouts))
    result = RestoreResult(0, 0, len(sources), 0, 0.0, "fp8-dequant")
    if len(sources):
        passed, moved_bytes = _move_and_scatter(encoded, table, sources, targets)
        result = RestoreResult(
            0, 0, len(sources), moved_bytes, time.perf_counter() - started, "fp8-dequant"
        )
        if not passed.all():
            raise _incomplete(passed, list(table.names), targets, encoded, result)
    return result


def _move_and_scatter(
    encoded: OpenFp8File, table: PageTable, blocks: np.ndarray, target_blocks: np.ndarray
) -> tuple[np.ndarray, int]:
    """Stage, check and scatter the pages of stored ``blocks`` into ``target_blocks`` of
    ``table``'s caches, piece by piece: per page (tensor, then block) whether it passed its
    check, and the bytes moved to the device."""
    names = list(table.names)
    device = table.device
    page_bytes = _page_bytes(encoded, names[0])
    low, high = int(blocks.min()), int(blocks.max()) + 1
    span = (high - low) * page_bytes
    starts = (np.arange(len(names))[:, None] * span + (blocks - low)[None, :] * page_bytes).ravel()
    scales = np.concatenate([encoded.scales[name][blocks] for name in names])
    on_device = checks_on_device(encoded, page_bytes, device)
    lease = _lease(encoded) if on_device else None
    pieces = _pieces(len(names))
    synchronized = False
    try:
        values = torch.empty(len(names) * span, dtype=torch.uint8, device=device)
        arrived = []
        if lease is not None:
            # Every piece's copies go first, so the bus is busy from the start; the tables are
            # built meanwhile and pulled to the device by a kernel, which a copy engine busy
            # with the pages does not hold back (:mod:`kvsnap.transfer.host_pull`).
            arrived = _copy_pieces(encoded, names, low, span, values, pieces, lease)
        reads = None if lease is not None else _read_values(encoded, names, low, span)
        scatter = prepare_scatter(
            encoded,
            table,
            (blocks, target_blocks),
            starts,
            scales,
            values,
            on_device,
            pull=lease is not None,
        )
        staged = scatter.staged
        for index, (first, last) in enumerate(pieces):
            if arrived:
                torch.cuda.current_stream(device).wait_event(arrived[index])
            elif reads is not None:
                _copy_read(reads, first, last, span, values, staged, encoded, page_bytes)
            scatter.piece(encoded, first * len(blocks), last * len(blocks), page_bytes)
        passed = staged.page_ok.cpu().numpy()  # waits for the scatter: its last step reads it
        synchronized = True
    finally:
        if not synchronized and device.type == "cuda":
            # Copies and kernels may still read the tables' pinned buffer and write the staged
            # values: wait for them before either is freed.
            torch.cuda.synchronize(device)
        if lease is not None:
            event = torch.cuda.Event()
            event.record()
            hot_tier().release(lease, event)
    return passed, len(names) * span + scales.nbytes


def _copy_pieces(
    encoded: OpenFp8File,
    names: list[str],
    low: int,
    span: int,
    values: torch.Tensor,
    pieces: list[tuple[int, int]],
    lease: HotFile,
) -> list[torch.cuda.Event]:
    """Enqueue on the side stream the copy of every tensor's stored blocks from ``low``
    (``span`` bytes) out of the registered mapping into ``values``: an event per piece,
    recorded once its tensors have arrived."""
    assert lease.host is not None
    side = _copy_stream(values.device)
    side.wait_stream(torch.cuda.current_stream(values.device))  # the buffer's allocation
    first_byte = low * _page_bytes(encoded, names[0])
    driver, _ = resolve_driver()
    arrived = []
    with torch.cuda.stream(side):
        for first, last in pieces:
            for index in range(first, last):
                begin = encoded.layout.by_name[names[index]].begin + first_byte
                if driver is None:
                    values[index * span : (index + 1) * span].copy_(
                        lease.host[begin : begin + span], non_blocking=True
                    )
                    continue
                # The driver's call takes microseconds where torch's copy takes tens: 64 of
                # them are queued before the tables are built.
                code = driver.memcpy_async(
                    values.data_ptr() + index * span,
                    lease.host.data_ptr() + begin,
                    span,
                    side.cuda_stream,
                )
                if code != 0:
                    raise RuntimeError(f"cuMemcpyAsync failed: {driver.describe_error(code)}")
            event = torch.cuda.Event()
            event.record(side)
            arrived.append(event)
    return arrived


def _copy_read(
    reads: tuple[np.ndarray, list[Future[None]]],
    first: int,
    last: int,
    span: int,
    values: torch.Tensor,
    staged: Staged,
    encoded: OpenFp8File,
    page_bytes: int,
) -> None:
    """Wait for a piece's reads and copy it to the device; pages checked on the host are
    checked here."""
    host, futures = reads
    for future in futures[first:last]:
        future.result()
    piece = slice(first * span, last * span)
    if staged.words is None:
        inside = (staged.host_starts >= piece.start) & (staged.host_starts < piece.stop)
        ok = host_checks(
            encoded, host, staged.host_starts[inside], staged.stored[inside], page_bytes
        )
        staged.page_ok[torch.from_numpy(np.flatnonzero(inside)).to(values.device)] = (
            torch.from_numpy(ok).to(values.device)
        )
    values[piece].copy_(torch.from_numpy(host[piece]), non_blocking=True)


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
