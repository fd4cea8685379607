"""Slots of hot files: a restore's loads from files the hot tier holds, packed several to a
slot while they fit (nothing is read into such a slot: it only orders the device's work), moved
with one submit, and the device's verdicts on every slot of a job collected in one copy.

An engine's prefix is several chunk files, one snapshot each, and a slot's host work is paid
per slot: a 2k prefix of eight 32 MiB chunks is four 64 MiB slots, not eight
(docs/architecture.md, "Hot chunks share slots").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from kvsnap.pipeline.movers import SlotMover
from kvsnap.pipeline.slots import SlotLoad
from kvsnap.store import traced
from kvsnap.transfer.pinned import Slot

if TYPE_CHECKING:
    from kvsnap.pipeline.restore import RestoreRun

#: One slot's work: the loads it carries, each with its restore (several only when packed).
Group = list[tuple["RestoreRun", SlotLoad]]
#: A slot the device checks: its ticket, and per load carried its restore, the load and the
#: load's first page in the slot.
Checked = tuple[Any, list[tuple["RestoreRun", SlotLoad, int]]]


def packed_groups(pairs: Iterator[tuple[RestoreRun, SlotLoad]], slot_bytes: int) -> Iterator[Group]:
    """The loads in order, one slot's worth each: consecutive loads of hot files checked on the
    device share a slot while their bytes fit in it (nothing is read into it: the slot only
    orders the device's work); every other load has a slot of its own."""
    group: Group = []
    group_bytes = 0
    for run, load in pairs:
        load_bytes = load.num_bytes(run.pages.page_size_bytes)
        # A slot's pages are checked one way: against xxh3-64, or against BLAKE3 digests.
        if group and (
            not run.packs or group_bytes + load_bytes > slot_bytes or run.bound != group[0][0].bound
        ):
            yield group
            group, group_bytes = [], 0
        group.append((run, load))
        group_bytes += load_bytes
        if not run.packs:
            yield group
            group, group_bytes = [], 0
    if group:
        yield group


def move_packed(group: Group, slot: Slot, checked: list[Checked]) -> None:
    """Move the loads of ``group`` (hot files, checked on the device; one run of pages each,
    back to back) out of one slot with one submit, and give the slot back with its event."""
    first_run = group[0][0]
    event = None
    try:
        if all(run.error is None for run, _ in group):
            event = _submit_packed(group, slot, checked)
    except BaseException as error:
        first_run.error = error
    first_run.ring.release(slot, after=event)


def _submit_packed(group: Group, slot: Slot, checked: list[Checked]) -> Any:
    """The one submit of a packed slot: each load's pages follow the previous load's, with its
    files' bytes, blocks and stored digests; returns the copy's event."""
    tensors, offsets, targets, blocks, expected = [], [], [], [], []
    uploads: list[tuple[Any, int]] = []
    parts: list[tuple[RestoreRun, SlotLoad, int]] = []
    first_page = first_byte = 0
    trace = group[0][0].trace
    with traced(trace, "transfer.prepare"):
        for run, load in group:
            page_bytes = run.pages.page_size_bytes
            page_blocks = run.snapshot_blocks[load.page_positions]
            tensors.append(load.page_tensors)
            offsets.append(load.page_offsets + first_byte)
            targets.append(run.target_blocks[load.page_positions])
            blocks.append(page_blocks)
            expected.append(run.pages.stored(load, page_blocks))
            # No padding in a packed slot: its loads' bytes were counted without any.
            room = load.num_bytes(page_bytes)
            _, spans = run.pages.uploads(load, page_blocks, room)
            uploads.extend((host, at + first_byte) for host, at in spans)
            parts.append((run, load, first_page))
            first_page += load.num_pages
            first_byte += load.num_bytes(page_bytes)
        positions = np.arange(first_page, dtype=np.int64)  # not read: the mover needs none
        packed = SlotLoad(np.concatenate(tensors), positions, np.concatenate(offsets))
    mover = group[0][0].mover
    with traced(trace, "transfer.submit", first_byte):
        ticket = mover.submit(
            packed,
            slot,
            np.concatenate(targets),
            np.concatenate(blocks),
            np.concatenate(expected),
            uploads=uploads,
        )
    checked.append((ticket, parts))
    for run, load, _ in parts:
        run.progress(load.num_bytes(run.pages.page_size_bytes))
    return mover.event(ticket)


def collect_device_checks(mover: SlotMover, checked: list[Checked]) -> None:
    """Wait for the device-checked slots (their flags in one copy) and note, per restore, the
    pages their kernels refused."""
    failed = mover.failed_pages_of([ticket for ticket, _ in checked])
    for (_, parts), bad in zip(checked, failed, strict=True):
        for run, load, first_page in parts:
            mine = bad[(bad >= first_page) & (bad < first_page + load.num_pages)] - first_page
            if len(mine):
                run.fail(load, mine, f"{run.mismatch} (device)")
