"""Parted snapshots in the facade: every TP rank writes its own heads.

* :func:`capture_part` is what one rank runs: it writes part ``i`` of ``k`` (its heads, through
  :func:`kvsnap.layout.part_layout`) under the write's new name and returns the
  :class:`~kvsnap.format.PartRecord` the index needs. Once every part is durable one process
  calls :func:`kvsnap.store.write.parts_index.publish_parts_index` (the commit point); a failed
  write's parts go with :func:`kvsnap.store.files.part_files.discard_parts`.
  ``kvsnap.distributed`` runs that protocol over ``torch.distributed``.
* :func:`capture_parts` does all of it in one process holding every rank (``kvsnap.capture(...,
  per_rank_parts=True)``).

Reading is :meth:`kvsnap.Snapshot.open`'s: a parted snapshot opens as one snapshot of all
heads, one part per file (:attr:`kvsnap.Snapshot.parts`), and restores at any TP size read only
the parts holding each target rank's heads.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvsnap import format as fmt
from kvsnap.errors import LayoutError
from kvsnap.format.signing import KeyRing
from kvsnap.layout import CacheLayout, PartAssignment, head_range, part_layout
from kvsnap.pipeline import (
    CaptureResult,
    Pipeline,
    ProgressCallback,
    SequenceBlocks,
    StagingOptions,
    TransferOptions,
)
from kvsnap.pipeline.options import staging_options
from kvsnap.store import TraceHook
from kvsnap.store.files.part_files import discard_parts, part_path
from kvsnap.store.write.parts_index import publish_parts_index
from kvsnap.transfer.pinned import PinnedPool

if TYPE_CHECKING:
    import torch

__all__ = ["PartCapture", "capture_part", "capture_parts"]


@dataclass(frozen=True)
class PartCapture:
    """What :func:`capture_part` wrote: the capture's result (``result.path`` is the part
    file) and the index's record of the part (file name, heads, trailer digest)."""

    result: CaptureResult
    record: fmt.PartRecord


def capture_part(
    layout: CacheLayout,
    sequences: Sequence[SequenceBlocks],
    path: str | os.PathLike[str],
    *,
    part: PartAssignment,
    count: int,
    generation: str,
    source: fmt.SourceInfo | None = None,
    transfer: TransferOptions | None = None,
    staging: StagingOptions | PinnedPool | None = None,
    reproducible: bool = False,
    direct_io: bool | None = None,
    progress: ProgressCallback | None = None,
    trace: TraceHook | None = None,
    after: torch.cuda.Event | None = None,
    keys: KeyRing | None = None,
) -> PartCapture:
    """Write part ``part.index`` of ``count`` of the parted snapshot ``path``
    (``NAME.safetensors``): global heads ``[part.first_head, +part.num_heads)`` of the
    ``sequences``, taken from this rank's cache ``layout``, into
    ``{stem}-{generation}-part-{i:05d}-of-{k:05d}.safetensors`` beside ``path``.

    The file is a complete single-file snapshot of those heads (format version 2, metadata key
    ``part``), published atomically under its new name; nothing else at ``path`` changes
    until :func:`~kvsnap.store.write.parts_index.publish_parts_index` publishes the index.
    Every rank of
    one write passes the same ``generation`` (:func:`kvsnap.format.new_generation`, made once
    and shared), ``count`` (``len(part_assignments(...))``) and ``sequences``. ``part`` comes from
    :func:`kvsnap.layout.part_assignments`; ``layout`` must hold those heads (a superset is fine).
    Warm across calls: the part layout is cached per layout object, the page table per
    process. ``progress`` and ``after`` are :meth:`kvsnap.pipeline.Pipeline.capture`'s (the
    part's bytes; a CUDA event the copies follow). ``LayoutError`` when the rank holds none of
    the heads. ``keys`` signs the part file (:class:`~kvsnap.format.KeyRing`).
    """
    geometry = layout.geometry
    moved = part_layout(layout, part.first_head, part.num_heads)
    if moved is None:
        raise LayoutError(
            f"this rank (TP rank {layout.tp_rank}) holds none of heads {part.first_head}.."
            f"{part.first_head + part.num_heads}"
        )
    target = part_path(path, part.index, count, generation)
    result = Pipeline(moved, transfer=transfer).capture(
        sequences,
        target,
        source=source,
        staging=staging_options(staging),
        reproducible=reproducible,
        direct_io=direct_io,
        progress=progress,
        trace=trace,
        after=after,
        part=fmt.PartInfo(part.index, count, part.first_head, geometry.num_kv_heads),
        keys=keys,
    )
    assert result.trailer_digest is not None  # a part is always one file
    record = fmt.PartRecord(
        os.path.basename(result.path), part.first_head, part.num_heads, result.trailer_digest
    )
    return PartCapture(result, record)


def capture_parts(
    layouts: Sequence[CacheLayout],
    sequences: Sequence[SequenceBlocks],
    path: str | os.PathLike[str],
    *,
    source: fmt.SourceInfo | None = None,
    transfer: TransferOptions | None = None,
    staging: StagingOptions | PinnedPool | None = None,
    reproducible: bool = False,
    direct_io: bool | None = None,
    trace: TraceHook | None = None,
    keys: KeyRing | None = None,
) -> CaptureResult:
    """A parted snapshot at ``path`` from the caches of every TP rank, held by this process:
    one part per distinct head range of ``layouts`` (written from the first rank holding it,
    signed with ``keys`` when given), then the index. On any error the parts written are
    discarded and the previous snapshot at ``path`` is untouched. The result's ``path`` is
    the index."""
    if layouts and layouts[0].geometry.is_mla:
        raise LayoutError(
            "MLA (latent) snapshots are never parted (every rank holds the whole latent): "
            "capture without per_rank_parts"
        )
    groups: dict[tuple[int, int], CacheLayout] = {}
    for layout in sorted(layouts, key=lambda layout: layout.tp_rank):
        groups.setdefault(head_range(layout), layout)
    ranges = sorted(groups)
    generation = fmt.new_generation()
    options = {"source": source, "transfer": transfer, "staging": staging, "trace": trace}
    options.update(reproducible=reproducible, direct_io=direct_io, generation=generation)
    options["keys"] = keys
    written: list[PartCapture] = []
    try:
        for number, (first, end) in enumerate(ranges, start=1):
            part = PartAssignment(number, first, end - first, groups[(first, end)].tp_rank)
            written.append(
                capture_part(
                    groups[(first, end)], sequences, path, part=part, count=len(ranges), **options
                )
            )
        index = publish_parts_index(path, [part.record for part in written])
    except BaseException:
        discard_parts(path, generation)
        raise
    results = [part.result for part in written]
    return dataclasses.replace(
        results[0],
        path=index,
        num_bytes=sum(result.num_bytes for result in results),
        seconds=sum(result.seconds for result in results),
        trailer_digest=None,
    )
