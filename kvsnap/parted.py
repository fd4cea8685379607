"""Parted snapshots in the facade: every TP rank writes its own heads; read back as one snapshot.

* :func:`capture_part` is what one rank runs: it writes part ``i`` of ``k`` (its heads, through
  :func:`kvsnap.layout.part_layout`) under the write's new name and returns the
  :class:`~kvsnap.format.PartRecord` the index needs. Once every part is durable one process
  calls :func:`kvsnap.store.parts.publish_parts_index` (the commit point); a failed write's
  parts go with :func:`kvsnap.store.parts.discard_parts`. ``kvsnap.distributed`` runs that
  protocol over ``torch.distributed``.
* :func:`capture_parts` does all of it in one process holding every rank (``kvsnap.capture(...,
  per_rank_parts=True)``).
* :class:`PartedSnapshot` is what :meth:`kvsnap.Snapshot.open` returns for a parted snapshot:
  the whole model's metadata, full-head tensors, ``verify()`` over every part, and restores at
  any TP size that read only the parts holding each target rank's heads.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvsnap import format as fmt
from kvsnap.errors import LayoutError, RestoreIncompleteError, SignatureError
from kvsnap.format.signing import KeyRing
from kvsnap.layout import CacheLayout, PartAssignment, head_range, part_layout
from kvsnap.pipeline import (
    CaptureResult,
    Pipeline,
    RestoreResult,
    SequenceBlocks,
    StagingOptions,
    TransferOptions,
)
from kvsnap.snapshot import Snapshot, staging_options
from kvsnap.store import SnapshotReader, TraceHook
from kvsnap.store.parts import (
    OpenedParts,
    discard_parts,
    open_parts,
    part_path,
    publish_parts_index,
    whole_metadata,
)
from kvsnap.transfer.pinned import PinnedPool

__all__ = [
    "PartCapture",
    "PartedSnapshot",
    "capture_part",
    "capture_parts",
    "open_parted",
    "restore_parted",
]


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
    progress: Callable[[int, int], None] | None = None,
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
    until :func:`~kvsnap.store.parts.publish_parts_index` publishes the index. Every rank of
    one write passes the same ``generation`` (:func:`kvsnap.format.new_generation`, made once
    and shared), ``count`` (``len(part_plan(...))``) and ``sequences``. ``part`` comes from
    :func:`kvsnap.layout.part_plan`; ``layout`` must hold those heads (a superset is fine).
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


ProgressCallback = Callable[[int, int], None]


class PartedSnapshot(Snapshot):
    """A parted snapshot opened as one: the whole model's metadata and geometry, full-head
    tensors (the parts' heads concatenated), ``verify()`` over every part, and restores that
    read each part only into the target ranks holding some of its heads.

    :attr:`parts` holds each part opened as what it is (a snapshot of its heads).
    """

    def __init__(self, opened: OpenedParts, path: str) -> None:
        self.path = path
        self.index = opened.index
        self.parts = [Snapshot(reader, reader.url) for reader in opened.readers]
        self._metadata = whole_metadata(opened.index, opened.readers[0])

    @property
    def metadata(self) -> fmt.SnapshotMetadata:
        return self._metadata

    @property
    def format_version(self) -> int:
        return self.index.metadata.format_version

    @property
    def reader(self) -> SnapshotReader:
        """Refused: a parted snapshot has one reader per part (``parts[i].reader``)."""
        raise TypeError(
            f"{self.path} is a parted snapshot: each part has its own reader "
            "(PartedSnapshot.parts[i].reader)"
        )

    def verify(self, progress: ProgressCallback | None = None) -> list[fmt.Problem]:
        """Check every part fully (structure, every checksum; each problem names the part
        file); the index's checks (heads tiling, trailer digests, parts agreeing on sequences
        and geometry) passed when the snapshot was opened. ``[]`` means intact."""
        total = self.kv_bytes
        problems: list[fmt.Problem] = []
        done = 0
        for part in self.parts:
            offset = done
            callback = None if progress is None else (lambda n, o=offset: progress(o + n, total))
            problems += part.reader.verify(progress=callback)
            done += part.kv_bytes
        return problems

    def signature_problems(self, keys: KeyRing) -> list[SignatureError]:
        """:meth:`Snapshot.signature_problems` of every part file."""
        return [problem for part in self.parts for problem in part.signature_problems(keys)]

    def signing_key_ids(self) -> list[str | None]:
        """:meth:`Snapshot.signing_key_ids` of every part file, in head order."""
        return [key_id for part in self.parts for key_id in part.signing_key_ids()]

    def read_tensor(self, name: str) -> torch.Tensor:
        """A whole canonical tensor, ``(num_blocks, block_size, num_kv_heads, head_dim)``, the
        parts' heads concatenated; checksums verified."""
        return torch.cat([part.read_tensor(name) for part in self.parts], dim=2)

    def sequence_kv(self, sequence_id: str, name: str) -> torch.Tensor:
        """One sequence's KV of tensor ``name``, ``(num_tokens, num_kv_heads, head_dim)``."""
        return torch.cat([part.sequence_kv(sequence_id, name) for part in self.parts], dim=1)

    def part_files(self) -> list[str]:
        """The part files, in head order."""
        return [part.path for part in self.parts]

    def close(self) -> None:
        for part in self.parts:
            part.close()


def open_parted(
    path: str | os.PathLike[str], *, verify: bool = True, keys: KeyRing | None = None
) -> PartedSnapshot | None:
    """The parted snapshot at ``path`` opened (every part signed by one of ``keys``, when
    given), or ``None`` when ``path`` is no parted snapshot (see
    :func:`kvsnap.store.parts.parted_index`)."""
    from kvsnap.store.parts import parted_index

    index = parted_index(path)
    if index is None:
        return None
    return PartedSnapshot(open_parts(index, verify=verify, keys=keys), str(path))


def restore_parted(
    pipeline: Pipeline,
    snapshot: PartedSnapshot,
    pairs: tuple[np.ndarray, np.ndarray],
    staging: StagingOptions | None,
    progress: ProgressCallback | None,
    trace: TraceHook | None,
) -> RestoreResult:
    """What :class:`~kvsnap.pipeline.Pipeline` runs to move checked ``(snapshot blocks, target
    blocks)`` of a parted snapshot: each part into the ranks of ``pipeline`` holding some of
    its heads, through the pipeline's kept per-part pipelines (a part no rank holds is never
    read). A part's failed pages do not stop the other parts; the target blocks any part
    failed are reported together in one :class:`~kvsnap.errors.RestoreIncompleteError`."""
    jobs = [
        (part, moving)
        for part, record in zip(snapshot.parts, snapshot.index.parts, strict=True)
        # Pipeline and this function are one mechanism split over two modules.
        if (moving := pipeline._part_pipeline(record.first_head, record.num_heads))
    ]
    names = len(pipeline.geometry.tensor_names())
    total = sum(p.geometry.canonical_page_size_bytes for _, p in jobs) * len(pairs[0]) * names
    done = 0
    moved: list[RestoreResult] = []
    failures: list[RestoreIncompleteError] = []
    for part, moving in jobs:
        report = None
        if progress is not None:
            report = lambda n, _t, base=done: progress(base + n, total)  # noqa: E731
        try:
            moved.append(moving._restore_pairs(part, pairs, staging, report, trace))
        except RestoreIncompleteError as error:
            failures.append(error)
            moved.append(error.result)
        done += moved[-1].num_bytes
    result = RestoreResult(0, 0, len(pairs[0]), done, 0.0, moved[0].backend if moved else "none")
    if failures:
        raise RestoreIncompleteError(
            "; ".join(str(error) for error in failures),
            file=snapshot.path,
            failed_block_ids=np.unique(
                np.concatenate([error.failed_block_ids for error in failures])
            ),
            result=result,
        ) from failures[0]
    return result
