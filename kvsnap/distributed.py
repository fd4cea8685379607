"""Capture and restore with one process per tensor-parallel rank, as engines and ``torchrun`` run.

``torch.distributed`` is initialised by the caller; every rank of the group calls the same
function with its own cache's layout (``layout.tp_rank`` is its rank in the group). Each rank
moves only its own heads, over its own PCIe link, into its own file: a capture writes one *part*
per distinct head group (docs/format.md, "Parted snapshots") and rank 0 publishes the index
that makes them one snapshot once every part is durable. Collectives carry a generation token,
one small status object per rank and the outcome, never KV bytes. A restore moves no data
between ranks either (each reads the parts holding its heads, whatever TP size the snapshot was
taken at); its ranks agree on the outcome, so an engine recomputes the same blocks everywhere.

Failure of any rank, or of the group itself (a rank killed, a collective timing out), leaves no
published snapshot: the index is written last, by rank 0, after every rank reported its part
durable, and the previous snapshot at ``path`` is intact until then. Surviving ranks remove the
write's parts and raise ``RankFailedError``.

A group of one rank writes a plain snapshot; so does an MLA model at any TP size (every rank
holds the whole latent, rank 0 writes it).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from kvsnap import format as fmt
from kvsnap.errors import (
    LayoutError,
    RankFailedError,
    RestoreIncompleteError,
    UnknownSequenceError,
)
from kvsnap.format.signing import KeyRing
from kvsnap.layout import CacheLayout, PageRef, PartAssignment, part_assignments
from kvsnap.parted import capture_part
from kvsnap.pipeline import (
    CaptureResult,
    Pipeline,
    ProgressCallback,
    RestoreResult,
    SequenceBlocks,
    StagingOptions,
    TransferOptions,
)
from kvsnap.snapshot import Snapshot
from kvsnap.store import TraceHook
from kvsnap.store.files.location import locate
from kvsnap.store.files.part_files import discard_parts
from kvsnap.store.files.resolve import committed_file
from kvsnap.store.write.parts_index import publish_parts_index

__all__ = ["DistributedCapture", "capture", "restore"]


@dataclass(frozen=True)
class DistributedCapture:
    """What a distributed capture published, as every rank sees it."""

    #: The snapshot (``NAME.safetensors``; a parted one is opened through it or its index).
    path: str
    #: Part files of the snapshot (0 for a plain snapshot).
    num_parts: int
    num_blocks: int
    #: KV bytes of the whole snapshot, every part together.
    num_bytes: int
    #: Wall time of this rank's call, the collectives included.
    seconds: float
    #: What this rank wrote (its part, or the plain snapshot), ``None`` if it wrote nothing.
    written: CaptureResult | None
    #: ``only_if_missing`` found a snapshot at ``path``: nothing was written.
    skipped: bool = False


def capture(
    layout: CacheLayout,
    sequences: Sequence[SequenceBlocks],
    path: str | os.PathLike[str],
    *,
    group: Any = None,
    source: fmt.SourceInfo | None = None,
    transfer: TransferOptions | None = None,
    staging: StagingOptions | None = None,
    reproducible: bool = False,
    direct_io: bool | None = None,
    progress: ProgressCallback | None = None,
    trace: TraceHook | None = None,
    after: torch.cuda.Event | None = None,
    only_if_missing: bool = False,
    keys: KeyRing | None = None,
) -> DistributedCapture:
    """Capture ``sequences`` from every rank of ``group`` into one snapshot at ``path``.

    Call it on every rank of the group with that rank's cache and the same ``sequences`` and
    ``path``. Each rank holding a distinct head group writes its part beside ``path``, in
    parallel; rank 0 publishes the index once every part is durable, and every rank returns
    only then. A group of one rank, or an MLA model, writes a plain snapshot from rank 0.

    Args:
        layout: This rank's cache layout: ``tp_rank`` is its rank in the group, ``tp_size``
            the group's size.
        sequences: The sequences to capture, the same on every rank (the ranks share one
            block table).
        path: Where the snapshot goes, on a local or shared filesystem every rank reaches.
        group: The ``torch.distributed`` process group. Default ``None``: the world.
        source: Where the KV came from. Default ``None``: unknown.
        transfer: How pages move (``TransferOptions``). Default ``None``: the fused copy.
        staging: Host staging memory (``StagingOptions``). Default ``None``: kvsnap's
            process-wide slots.
        reproducible: Record nothing time- or host-dependent. Default ``False``.
        direct_io: ``True`` requires ``O_DIRECT``, ``False`` never uses it. Default ``None``:
            where the filesystem accepts it.
        progress: ``progress(done_bytes, total_bytes)`` of this rank's bytes (called once
            with ``(0, 0)`` on a rank that writes none). Default ``None``.
        trace: ``trace(kind, started, finished, nbytes)`` per step. Default ``None``.
        after: A CUDA event the copies follow (a capture run on another thread than the one
            that computed the KV). Default ``None``: the calling thread's stream.
        only_if_missing: Rank 0 looks for a snapshot at ``path`` first and, if there is one,
            no rank writes anything (a content-addressed store's dedup, decided once for all
            ranks). Default ``False``.
        keys: Sign every rank's file with the first key of this ``KeyRing``. Default
            ``None``: unsigned.

    Returns:
        A ``DistributedCapture``, the same on every rank but for ``written`` (this rank's
        own file): the path, the number of parts, blocks and bytes, the seconds taken and
        whether ``only_if_missing`` skipped the capture.

    Raises:
        ValueError: ``torch.distributed`` is not initialised.
        LayoutError: ``layout`` is not this process's rank of the group.
        RankFailedError: On every surviving rank when any rank failed (its error is in
            ``failures``) or was lost: nothing is published, and the previous snapshot at
            ``path`` is untouched.

    Example:
        Every rank runs this; ``torchrun`` starts one process per rank (here a group of one):

        >>> import os, numpy as np, torch, torch.distributed as dist, kvsnap
        >>> from kvsnap import distributed
        >>> rendezvous = "file://" + os.path.abspath("rendezvous")
        >>> dist.init_process_group("gloo", init_method=rendezvous, rank=0, world_size=1)
        >>> rank, world = dist.get_rank(), dist.get_world_size()
        >>> kv_caches = [torch.randn(8, 2, 16, 2, 64) for _ in range(2)]
        >>> layout = kvsnap.vllm_split_layout(kv_caches, tp_rank=rank, tp_size=world)
        >>> prompt = kvsnap.SequenceBlocks("seq-0", np.arange(40), np.array([4, 1, 6]))
        >>> result = distributed.capture(layout, [prompt], "tp.safetensors")
        >>> result.num_parts, result.num_blocks, result.skipped
        (0, 3, False)
        >>> dist.destroy_process_group()
    """
    started = time.perf_counter()
    rank, world = _check_rank(layout, group)
    path = os.fspath(path)
    options = {
        "source": source,
        "transfer": transfer,
        "staging": staging,
        "reproducible": reproducible,
        "direct_io": direct_io,
        "progress": progress,
        "trace": trace,
        "after": after,
        "keys": keys,
    }
    assignments = part_assignments(layout.geometry, world) if world > 1 else []
    start = None
    if rank == 0:
        start = {"generation": fmt.new_generation(), "skip": only_if_missing and _exists(path)}
    start = _broadcast(start, group, path)
    if start["skip"]:
        _report_nothing(progress)
        return DistributedCapture(path, 0, 0, 0, time.perf_counter() - started, None, True)
    if not assignments:  # one rank, or an MLA latent every rank holds: a plain snapshot from rank 0
        return _capture_plain(layout, sequences, path, group, options, started)
    generation = start["generation"]
    return _capture_parts(layout, sequences, path, assignments, generation, group, options, started)


def restore(
    path: str | os.PathLike[str],
    target: CacheLayout | Pipeline,
    block_ids: Mapping[str, np.ndarray | Sequence[int]],
    *,
    group: Any = None,
    staging: StagingOptions | None = None,
    model_fingerprint: str | None = None,
    force: bool = False,
    trace: TraceHook | None = None,
) -> RestoreResult:
    """Restore, on every rank of ``group``, that rank's heads of the snapshot at ``path``.

    Each rank reads only the parts holding its heads (of a plain snapshot: the pages of its
    blocks), whatever TP size the snapshot was taken at. The ranks then agree on the outcome,
    so that an engine recomputes the same blocks everywhere.

    Args:
        path: The snapshot, on a filesystem every rank reaches.
        target: This rank's cache layout, or the ``Pipeline`` an engine keeps for it (warm
            across calls).
        block_ids: Per sequence id, the target's block ids, the same on every rank.
        group: The ``torch.distributed`` process group. Default ``None``: the world.
        staging: Host staging memory (``StagingOptions``). Default ``None``: kvsnap's
            process-wide slots.
        model_fingerprint: The target model's fingerprint, checked against the one recorded.
            Default ``None``: not checked.
        force: Skip the fingerprint check. Default ``False``.
        trace: ``trace(kind, started, finished, nbytes)`` per step. Default ``None``.

    Returns:
        This rank's ``RestoreResult``.

    Raises:
        ValueError: ``torch.distributed`` is not initialised.
        LayoutError: The target is not this process's rank of the group.
        UnknownSequenceError: On every rank, when every rank was asked for a sequence the
            snapshot does not hold.
        RestoreIncompleteError: On every rank, when a page failed its checksum on any rank;
            ``failed_block_ids`` is the union of the failed blocks (everything else was
            written, on every rank).
        RankFailedError: On every rank, when a rank failed otherwise (a snapshot that does
            not fit, an I/O error) or the group was lost.

    Example:
        Every rank runs this; ``torchrun`` starts one process per rank (here a group of one):

        >>> import os, torch, torch.distributed as dist, kvsnap
        >>> from kvsnap import distributed
        >>> rendezvous = "file://" + os.path.abspath("rendezvous")
        >>> dist.init_process_group("gloo", init_method=rendezvous, rank=0, world_size=1)
        >>> rank, world = dist.get_rank(), dist.get_world_size()
        >>> target = [torch.zeros(8, 2, 16, 2, 64) for _ in range(2)]
        >>> layout = kvsnap.vllm_split_layout(target, tp_rank=rank, tp_size=world)
        >>> result = distributed.restore("prefix.safetensors", layout, {"seq-0": [0, 1, 2]})
        >>> result.num_tokens
        40
        >>> dist.destroy_process_group()
    """
    pipeline = target if isinstance(target, Pipeline) else Pipeline(target)
    _, world = _check_rank(pipeline.layouts[0], group)
    result: RestoreResult | None = None
    status: dict[str, Any] = {"error": None, "failed_block_ids": [], "unknown_sequence": False}
    unknown: UnknownSequenceError | None = None
    try:
        with Snapshot.open(os.fspath(path)) as snapshot:
            result = pipeline.restore(
                snapshot,
                block_ids,
                staging=staging,
                model_fingerprint=model_fingerprint,
                force=force,
                trace=trace,
            )
    except RestoreIncompleteError as error:
        result = error.result
        status["failed_block_ids"] = [int(block) for block in error.failed_block_ids]
    except Exception as error:  # every rank learns of it
        status["error"] = _describe(error)
        if isinstance(error, UnknownSequenceError):
            unknown = error
            status["unknown_sequence"] = True
    statuses = _all_gather(status, group, os.fspath(path), None, world)
    failures = {r: s["error"] for r, s in enumerate(statuses) if s["error"] is not None}
    if unknown is not None and all(s["unknown_sequence"] for s in statuses):
        # The caller's mistake, made on every rank alike: raised as a one-process restore raises
        # it, not as a rank failure (no rank failed at anything it was asked to do).
        raise unknown
    if failures:
        raise _failed("restore", os.fspath(path), failures)
    failed = sorted({block for s in statuses for block in s["failed_block_ids"]})
    if failed:
        raise RestoreIncompleteError(
            f"{len(failed)} target blocks failed their checksums on some rank and were not "
            "(fully) restored; every other page was, on every rank",
            file=os.fspath(path),
            failed_block_ids=np.asarray(failed, dtype=np.int64),
            result=result,
        )
    assert result is not None
    return result


# --------------------------------------------------------------------------------------------


def _check_rank(layout: CacheLayout, group: Any) -> tuple[int, int]:
    """This process's rank and the group's size, checked against the layout's TP rank."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("kvsnap.distributed needs torch.distributed initialised first")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if (layout.tp_rank, layout.tp_size) != (rank, world):
        raise LayoutError(
            f"this process is rank {rank} of {world}, but its layout is TP rank "
            f"{layout.tp_rank} of {layout.tp_size}: pass the layout of this rank's own cache"
        )
    return rank, world


def _capture_parts(
    layout: CacheLayout,
    sequences: Sequence[SequenceBlocks],
    path: str,
    assignments: list[PartAssignment],
    generation: str,
    group: Any,
    options: dict[str, Any],
    started: float,
) -> DistributedCapture:
    """Write this rank's part (if the assignments give it one), exchange the statuses, and have
    rank 0 publish the index; on any failure every rank discards the write's parts and raises."""
    rank, world = layout.tp_rank, layout.tp_size
    mine = next((part for part in assignments if part.writer_rank == rank), None)
    written = None
    status: dict[str, Any] = {"error": None, "record": None, "num_bytes": 0, "num_blocks": 0}
    try:
        if mine is not None:
            written = capture_part(
                layout,
                sequences,
                path,
                part=mine,
                count=len(assignments),
                generation=generation,
                **options,
            )
            status.update(
                record=written.record,
                num_bytes=written.result.num_bytes,
                num_blocks=written.result.num_blocks,
            )
    except Exception as error:  # every rank learns of it; nothing is published
        status["error"] = _describe(error)
    if written is None:
        _report_nothing(options["progress"])
    statuses = _all_gather(status, group, path, generation, world)
    failures = {r: s["error"] for r, s in enumerate(statuses) if s["error"] is not None}
    if rank == 0 and not failures:
        try:
            publish_parts_index(path, [s["record"] for s in statuses if s["record"] is not None])
        except Exception as error:
            failures[0] = _describe(error)
    failures = _broadcast(failures if rank == 0 else None, group, path, generation)
    if failures:
        discard_parts(path, generation)
        raise _failed("capture", path, failures)
    return DistributedCapture(
        path=path,
        num_parts=len(assignments),
        num_blocks=max(s["num_blocks"] for s in statuses),
        num_bytes=sum(s["num_bytes"] for s in statuses),
        seconds=time.perf_counter() - started,
        written=None if written is None else written.result,
    )


def _capture_plain(
    layout: CacheLayout,
    sequences: Sequence[SequenceBlocks],
    path: str,
    group: Any,
    options: dict[str, Any],
    started: float,
) -> DistributedCapture:
    """Rank 0 writes the whole snapshot (published atomically by itself); the others wait."""
    rank = layout.tp_rank
    written: CaptureResult | None = None
    outcome: dict[str, Any] = {"failures": {}, "num_blocks": 0, "num_bytes": 0}
    if rank == 0:
        try:
            written = Pipeline(_sole_writer(layout), transfer=options["transfer"]).capture(
                sequences, path, **{k: v for k, v in options.items() if k != "transfer"}
            )
            outcome.update(num_blocks=written.num_blocks, num_bytes=written.num_bytes)
        except Exception as error:
            outcome["failures"] = {0: _describe(error)}
    else:
        _report_nothing(options["progress"])
    outcome = _broadcast(outcome if rank == 0 else None, group, path)
    if outcome["failures"]:
        raise _failed("capture", path, outcome["failures"])
    return DistributedCapture(
        path=path,
        num_parts=0,
        num_blocks=outcome["num_blocks"],
        num_bytes=outcome["num_bytes"],
        seconds=time.perf_counter() - started,
        written=written,
    )


def _exists(path: str) -> bool:
    """Whether a snapshot is published at ``path``: the single file, or the index of a sharded
    or parted one."""
    return committed_file(locate(path, None)) is not None


def _report_nothing(progress: ProgressCallback | None) -> None:
    """Tell ``progress`` that this rank has nothing to move (its copies are all done)."""
    if progress is not None:
        progress(0, 0)


def _sole_writer(layout: CacheLayout) -> CacheLayout:
    """``layout`` electing itself the writer of every block (its bytes are every rank's)."""
    if all(ref.mapping.num_writers == 1 for ref in layout.refs):
        return layout
    refs = [
        PageRef(
            ref.tensor_index,
            ref.layer,
            ref.part,
            dataclasses.replace(ref.mapping, num_writers=1, writer_index=0),
        )
        for ref in layout.refs
    ]
    return dataclasses.replace(layout, refs=refs, tp_rank=0, tp_size=1)


def _broadcast(value: Any, group: Any, path: str, generation: str | None = None) -> Any:
    """Rank 0's ``value`` on every rank (a small picklable object)."""
    box = [value]
    _collective(
        lambda: dist.broadcast_object_list(box, src=_first_rank(group), group=group),
        path,
        generation,
    )
    return box[0]


def _all_gather(value: Any, group: Any, path: str, generation: str | None, world: int) -> list[Any]:
    """Every rank's ``value`` (small picklable objects), in rank order."""
    gathered: list[Any] = [None] * world
    _collective(lambda: dist.all_gather_object(gathered, value, group=group), path, generation)
    return gathered


def _first_rank(group: Any) -> int:
    """The global rank of the group's rank 0 (what ``broadcast_object_list`` takes)."""
    return 0 if group is None else dist.get_global_rank(group, 0)


def _collective(run: Any, path: str, generation: str | None) -> None:
    """Run one collective; a lost peer or a timeout becomes ``RankFailedError`` after this
    rank removed the write's parts (``generation``), so nothing it wrote survives."""
    try:
        run()
    except RuntimeError as error:  # gloo and NCCL report lost peers and timeouts so
        if generation is not None:
            discard_parts(path, generation)
        raise RankFailedError(
            f"the process group failed (a rank was lost or timed out): {error}", file=path
        ) from error


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _failed(action: str, path: str, failures: dict[int, str]) -> RankFailedError:
    listed = "; ".join(f"rank {rank}: {message}" for rank, message in sorted(failures.items()))
    published = ", nothing was published" if action == "capture" else ""
    return RankFailedError(
        f"distributed {action} failed{published}: {listed}", file=path, failures=failures
    )
