"""The capture loop: engine cache -> staging slots -> the snapshot writer; and the metadata a
capture writes.

Every slot is enqueued as soon as one is free, and handed to the writer (which hashes and
writes it on its own threads) as soon as its copy completes, oldest first: the copies of later
slots overlap the wait for earlier ones, and nothing waits per tensor.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvsnap import format as fmt
from kvsnap._version import __version__
from kvsnap.layout import CacheLayout
from kvsnap.pipeline.jobs import SequenceBlocks, block_id_array
from kvsnap.pipeline.movers import SlotMover
from kvsnap.pipeline.slots import SlotLoad
from kvsnap.pipeline.staging import StagingRing
from kvsnap.store import SnapshotWriter, TraceHook, traced
from kvsnap.transfer.pinned import Slot


@dataclass
class _InFlight:
    load: SlotLoad
    slot: Slot
    ticket: Any


def capture_slots(
    mover: SlotMover,
    ring: StagingRing,
    writer: SnapshotWriter,
    loads: Iterable[SlotLoad],
    device_blocks: np.ndarray,
    progress: Callable[[int], None],
    trace: TraceHook | None,
) -> None:
    """Copy every slot of ``loads`` from the cache and feed it to ``writer`` in order.

    Page ``i`` of a load is block ``device_blocks[load.page_positions[i]]`` of tensor
    ``load.page_tensors[i]``; its snapshot block is its position. Slots the writer still holds
    return to ``ring`` when their writes complete; on an error every slot this call holds is
    given back once no copy uses it.
    """
    page_bytes = writer.page_size_bytes
    names = writer.tensor_order()
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
                    ticket = mover.submit(load, slot, device_blocks[positions], positions)
            except BaseException:
                ring.release(slot)
                raise
            inflight.append(_InFlight(load, slot, ticket))
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
            written.append(writer.write_slot(segments, mover.digests(item.ticket)))
    finally:
        _release_when_done(ring, item.slot, written)


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
