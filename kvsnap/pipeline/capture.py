"""A capture: engine cache -> staging slots -> the snapshot writer -> a published file; and the
metadata a capture writes.

:func:`capture_snapshot` is :meth:`Pipeline.capture <kvsnap.pipeline.Pipeline.capture>`'s
work, in its steps: the sequences checked and their metadata made, staging and the writer set
up, every slot copied out of the cache and written (:func:`capture_slots`), the file published,
the staging given back.

Every slot is enqueued as soon as one is free, and handed to the writer (which hashes and
writes it on its own threads) as soon as its copy completes, oldest first: the copies of later
slots overlap the wait for earlier ones, and nothing waits per tensor. When the writer mapped
its files for the device (a memory-backed target, :meth:`SnapshotWriter.map_for_device`), the
device copies each slot's runs of pages straight to their final offsets in the files instead
of into the slot, and the writer is told which pages are in place, with their digests.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvsnap import format as fmt
from kvsnap._version import __version__
from kvsnap.format.signing import KeyRing
from kvsnap.layout import CacheLayout
from kvsnap.pipeline.jobs import (
    CaptureResult,
    SequenceBlocks,
    block_id_array,
    validate_sequences,
)
from kvsnap.pipeline.movers import SlotMover
from kvsnap.pipeline.options import ProgressCallback, ProgressCounter, StagingOptions
from kvsnap.pipeline.slots import SlotLoad, slot_loads
from kvsnap.pipeline.staging import StagingRing, staging_ring
from kvsnap.store import SnapshotInfo, SnapshotWriter, TraceHook, traced
from kvsnap.transfer.pinned import Slot


@dataclass
class _InFlight:
    load: SlotLoad
    slot: Slot
    ticket: Any
    #: Whether the copy put the pages in the writer's mapped files (else in ``slot``).
    placed: bool = False


def capture_snapshot(
    layouts: Sequence[CacheLayout],
    make_mover: Callable[[], SlotMover],
    sequences: Sequence[SequenceBlocks],
    path: str | Path,
    *,
    source: fmt.SourceInfo | None,
    part: fmt.PartInfo | None,
    staging: StagingOptions | None,
    reproducible: bool,
    max_shard_bytes: int | None,
    direct_io: bool | None,
    progress: ProgressCallback | None,
    trace: TraceHook | None,
    after: torch.cuda.Event | None,
    keys: KeyRing | None,
) -> CaptureResult:
    """Write the KV of ``sequences`` from the caches ``layouts`` describe (one geometry, as a
    :class:`~kvsnap.pipeline.Pipeline` checked) to a snapshot at ``path``, its pages moved by
    the mover ``make_mover`` returns (asked once the staging is set up); the arguments and
    errors are :meth:`Pipeline.capture <kvsnap.pipeline.Pipeline.capture>`'s.

    The writer is aborted (its temporary files removed) if anything fails before its
    publish; the mover and the staging are given back either way.
    """
    started = time.perf_counter()
    geometry = layouts[0].geometry
    capacity = min(layout.num_blocks for layout in layouts)
    validate_sequences(geometry.block_size, sequences, capacity)
    metadata, device_blocks = capture_metadata(
        layouts, sequences, source or fmt.SourceInfo(), reproducible, part
    )
    page_bytes = geometry.canonical_page_size_bytes
    num_tensors = len(geometry.tensor_names())
    total_bytes = page_bytes * len(device_blocks) * num_tensors
    with traced(trace, "setup.staging"):
        ring = staging_ring(staging or StagingOptions(), page_bytes, total_bytes)
    mover = make_mover()
    done = ProgressCounter(progress, total_bytes)
    options: dict[str, Any] = {
        "direct_io": direct_io,
        "max_shard_bytes": max_shard_bytes,
        "trace": trace,
        "keys": keys,
    }
    try:
        with traced(trace, "setup.writer"):
            writer = SnapshotWriter(path, metadata, **options)
        info, dma_refused = _write_and_publish(
            mover, ring, writer, device_blocks, num_tensors, done.add, trace, after
        )
    finally:
        _give_back(mover, ring, trace)
    return CaptureResult(
        path=str(info.path),
        num_sequences=len(sequences),
        num_tokens=sum(len(sequence.token_ids) for sequence in sequences),
        num_blocks=len(device_blocks),
        num_bytes=info.num_bytes,
        seconds=time.perf_counter() - started,
        backend=mover.backend_name,
        direct_io_fallback=writer.fallback_reason,
        trailer_digest=info.trailers[0] if len(info.trailers) == 1 else None,
        data_path="dma" if info.mapped else "write",
        dma_refused=dma_refused,
    )


def _write_and_publish(
    mover: SlotMover,
    ring: StagingRing,
    writer: SnapshotWriter,
    device_blocks: np.ndarray,
    num_tensors: int,
    progress: Callable[[int], None],
    trace: TraceHook | None,
    after: torch.cuda.Event | None,
) -> tuple[SnapshotInfo, str | None]:
    """Copy every page of ``device_blocks`` (of each of ``num_tensors`` tensors) out of the
    cache, once ``after`` has passed, into ``writer``'s mapped files where it maps them for the
    device, else through ``ring``'s slots; publish the file. Returns what was published and
    why the pages were not placed straight in the files (``None`` when they were). On any
    failure the writer is aborted and the error raised."""
    try:
        mapped, dma_refused = map_for_device(mover, writer)
        mover.begin(after)
        page_bytes = writer.page_size_bytes
        loads = slot_loads(num_tensors, len(device_blocks), page_bytes, ring.slot_bytes)
        capture_slots(mover, ring, writer, loads, device_blocks, progress, trace, mapped)
        # The last views of the mappings: they are released after the publish.
        mapped = None
        return writer.commit(), dma_refused
    except BaseException:
        writer.abort()
        raise


def _give_back(mover: SlotMover, ring: StagingRing, trace: TraceHook | None) -> None:
    """End ``mover``'s job and return ``ring``'s slots, whatever happened before."""
    with traced(trace, "teardown"):
        try:
            mover.end()
        finally:
            ring.finish()


def map_for_device(
    mover: SlotMover, writer: SnapshotWriter
) -> tuple[list[torch.Tensor] | None, str | None]:
    """The writer's files mapped and registered for ``mover``'s copies, as uint8 tensors over
    whole files, when this capture can place its pages straight in them (a mover that copies
    and hashes on a CUDA device, a target the writer maps: see
    :meth:`SnapshotWriter.map_for_device`); else ``None`` and why not."""
    if not mover.takes_downloads:
        return None, "the pages are not copied and hashed on a CUDA device"
    if writer.wants_page_digests and not mover.checks_page_digests:
        # A signed snapshot binds every page by its BLAKE3 digest: the host would have to read
        # the mapping back to compute them.
        return None, "the pages' BLAKE3 digests are not computed on the device"
    reason = writer.map_for_device()
    if reason is not None:
        return None, reason
    return [torch.from_numpy(array) for array in writer.mapped_files()], None


def capture_slots(
    mover: SlotMover,
    ring: StagingRing,
    writer: SnapshotWriter,
    loads: Iterable[SlotLoad],
    device_blocks: np.ndarray,
    progress: Callable[[int], None],
    trace: TraceHook | None,
    mapped_files: Sequence[torch.Tensor] | None = None,
) -> None:
    """Copy every slot of ``loads`` from the cache and feed it to ``writer`` in order.

    Page ``i`` of a load is block ``device_blocks[load.page_positions[i]]`` of tensor
    ``load.page_tensors[i]``; its snapshot block is its position. Slots the writer still holds
    return to ``ring`` when their writes complete; on an error every slot this call holds is
    given back once no copy uses it (so no copy into ``mapped_files`` is running either).
    ``mapped_files``: the writer's files, mapped and registered (the mover
    ``takes_downloads``): the pages go there, not through the slots.
    """
    page_bytes = writer.page_size_bytes
    names = writer.tensor_order()
    # A signed capture's BLAKE3 digests, computed beside the xxh3-64 where the mover can.
    page_digests = writer.wants_page_digests and mover.checks_page_digests
    inflight: deque[_InFlight] = deque()
    try:
        for load in loads:
            slot = ring.try_acquire()
            while slot is None:
                if inflight:
                    item = inflight.popleft()
                    _hand_over(mover, ring, writer, item, names, page_bytes, trace)
                    progress(item.load.num_bytes(page_bytes))
                    slot = ring.try_acquire()
                else:
                    with traced(trace, "staging.wait"):
                        slot = ring.acquire()
            try:
                with traced(trace, "transfer.submit", load.num_bytes(page_bytes)):
                    positions = load.page_positions
                    downloads = (
                        None
                        if mapped_files is None
                        else _file_runs(writer, names, load, mapped_files, page_bytes)
                    )
                    ticket = mover.submit(
                        load,
                        slot,
                        device_blocks[positions],
                        positions,
                        downloads=downloads,
                        page_digests=page_digests,
                    )
            except BaseException:
                ring.release(slot)
                raise
            inflight.append(_InFlight(load, slot, ticket, downloads is not None))
        while inflight:
            item = inflight.popleft()
            _hand_over(mover, ring, writer, item, names, page_bytes, trace)
            progress(item.load.num_bytes(page_bytes))
    finally:
        for item in inflight:
            # Not handed over: give the slot back once its copy is done with it.
            try:
                mover.wait(item.ticket)
            finally:
                ring.release(item.slot)


def _hand_over(
    mover: SlotMover,
    ring: StagingRing,
    writer: SnapshotWriter,
    item: _InFlight,
    names: Sequence[str],
    page_bytes: int,
    trace: TraceHook | None,
) -> None:
    """Wait for ``item``'s copy and queue its pages on the writer; the slot goes back to the
    ring once every write of it has completed."""
    try:
        with traced(trace, "transfer.wait", item.load.num_bytes(page_bytes)):
            mover.wait(item.ticket)
    except BaseException:
        ring.release(item.slot)
        raise
    if item.placed:
        # The pages are in the files already: only their digests go to the writer.
        ring.release(item.slot)
        digests = mover.digests(item.ticket)
        assert digests is not None  # a mover that takes downloads hashes pages
        placed = [(names[segment.tensor], segment.num_pages) for segment in item.load.segments]
        with traced(trace, "writer.placed", item.load.num_bytes(page_bytes)):
            writer.placed_slot(placed, digests, mover.page_digests(item.ticket))
        return
    data = item.slot.as_numpy()
    segments = [
        (
            names[segment.tensor],
            data[segment.offset : segment.offset + segment.num_pages * page_bytes],
        )
        for segment in item.load.segments
    ]
    written: list[Future[None]] = []
    try:
        with traced(trace, "writer.enqueue", item.load.num_bytes(page_bytes)):
            digests = mover.digests(item.ticket)
            written.append(writer.write_slot(segments, digests, mover.page_digests(item.ticket)))
    finally:
        _release_when_done(ring, item.slot, written)


def _file_runs(
    writer: SnapshotWriter,
    names: Sequence[str],
    load: SlotLoad,
    mapped_files: Sequence[torch.Tensor],
    page_bytes: int,
) -> list[tuple[torch.Tensor, int]]:
    """Where ``load``'s pages go in the mapped files: per run of pages that follow each other
    in the slot and in one file (a slot of whole tensors, back to back, is one run), the file
    range it fills and its offset in the slot."""
    runs: list[tuple[int, int, int, int]] = []  # file, file offset, slot offset, bytes
    for segment in load.segments:
        shard, offset = writer.page_placement(names[segment.tensor], segment.start)
        nbytes = segment.num_pages * page_bytes
        if runs:
            last_shard, last_offset, last_slot, last_bytes = runs[-1]
            if (
                last_shard == shard
                and last_offset + last_bytes == offset
                and last_slot + last_bytes == segment.offset
            ):
                runs[-1] = (shard, last_offset, last_slot, last_bytes + nbytes)
                continue
        runs.append((shard, offset, segment.offset, nbytes))
    return [
        (mapped_files[shard][offset : offset + nbytes], slot_offset)
        for shard, offset, slot_offset, nbytes in runs
    ]


def _release_when_done(ring: StagingRing, slot: Slot, futures: Sequence[Future[None]]) -> None:
    """Give ``slot`` back to ``ring`` once every future is done (at once if there are none)."""
    remaining = [len(futures)]
    lock = threading.Lock()
    if not futures:
        ring.release(slot)
        return

    def one_done(_future: Future[None]) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            ring.release(slot)

    for future in futures:
        future.add_done_callback(one_done)


def capture_metadata(
    layouts: Sequence[CacheLayout],
    sequences: Sequence[SequenceBlocks],
    source: fmt.SourceInfo,
    reproducible: bool,
    part: fmt.PartInfo | None = None,
) -> tuple[fmt.SnapshotMetadata, np.ndarray]:
    """The snapshot's metadata (of part ``part`` of a parted snapshot, if given), and the
    device block holding each unique snapshot block.

    Blocks whose prefix hash chains coincide are stored once (their first owner's block).
    """
    geometry = layouts[0].geometry
    token_lists = [np.asarray(sequence.token_ids, dtype=np.int64) for sequence in sequences]
    block_lists = [block_id_array(sequence.block_ids, "block ids") for sequence in sequences]
    chains = [fmt.prefix_hash_chain(tokens, geometry.block_size) for tokens in token_lists]
    dedupe = fmt.dedupe_blocks(chains)
    device_blocks = np.array(
        [int(block_lists[index][position]) for index, position in dedupe.owners], dtype=np.int64
    )
    records = [
        fmt.SequenceRecord(
            id=sequence.id,
            token_ids=tokens,
            block_ids=np.asarray(block_ids, dtype=np.int64),
            prefix_hashes=tuple(chain),
        )
        for sequence, tokens, chain, block_ids in zip(
            sequences, token_lists, chains, dedupe.sequence_block_ids, strict=True
        )
    ]
    metadata = fmt.SnapshotMetadata(
        geometry=geometry,
        source=source,
        sequences=records,
        num_blocks=len(device_blocks),
        capture_encoding=layouts[0].encoding,
        tp_size=layouts[0].tp_size,
        # A reproducible snapshot must not change bytes with each patch release.
        kvsnap_version=".".join(__version__.split(".")[:2]) if reproducible else __version__,
        created=None if reproducible else fmt.utc_now(),
        part=part,
    )
    return metadata, device_blocks
