"""Capture a cache into a snapshot; the :class:`Snapshot`: open, verify, compare, restore.

This module wires the pipeline together and owns no mechanism of its own:

* capture: sequences' block ids → prefix-hash dedupe (:mod:`kvsnap.format`) → per canonical
  tensor, chunks of blocks → :class:`~kvsnap.transfer.TransferHandler` (device → pinned staging
  slot) → :class:`~kvsnap.store.SnapshotWriter` (checksum, write) → atomic publish.
* restore: :class:`~kvsnap.store.SnapshotReader` (file → staging slot, checksums verified) →
  transfer handler (slot → the target cache's blocks).

Transfers of chunk ``k+1`` overlap the writing of chunk ``k`` (and reads overlap scatters on
restore); host memory is bounded by the staging pool whatever the snapshot size.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvsnap import analysis
from kvsnap import format as fmt
from kvsnap._version import __version__
from kvsnap.errors import IncompatibleSnapshotError, TransferFailedError
from kvsnap.layout import CacheLayout, KVGeometry, torch_dtype
from kvsnap.pinned import PinnedPool, Slot
from kvsnap.plan import Direction, HostPages, PageCopy
from kvsnap.store import SnapshotReader, SnapshotWriter, TraceHook, traced
from kvsnap.transfer import TransferHandler

#: Host staging memory used by one capture or restore, split into ``DEFAULT_STAGING_SLOTS`` slots.
DEFAULT_STAGING_BYTES = 256 << 20
DEFAULT_STAGING_SLOTS = 4

ProgressCallback = Callable[[int, int], None]
"""``progress(done_bytes, total_bytes)``, called as data moves."""


@dataclass(frozen=True)
class SequenceBlocks:
    """One sequence in an engine cache: its tokens and the device blocks holding their KV.

    ``block_ids[i]`` holds tokens ``i*block_size .. (i+1)*block_size``; the last block may be
    partial. The ids are the same on every TP rank (engines share one block table).
    """

    id: str
    token_ids: np.ndarray
    block_ids: np.ndarray


@dataclass(frozen=True)
class CaptureResult:
    """What :func:`capture` wrote."""

    path: str
    num_sequences: int
    num_tokens: int
    num_blocks: int
    num_bytes: int
    seconds: float
    backend: str
    direct_io_fallback: str | None


@dataclass(frozen=True)
class RestoreResult:
    """What :meth:`Snapshot.restore` wrote into the target cache."""

    num_sequences: int
    num_tokens: int
    num_blocks: int
    num_bytes: int
    seconds: float
    backend: str


def _validate_sequences(geometry: KVGeometry, sequences: Sequence[SequenceBlocks]) -> None:
    if not sequences:
        raise ValueError("capture needs at least one sequence")
    seen: set[str] = set()
    for sequence in sequences:
        if sequence.id in seen:
            raise ValueError(f"sequence id {sequence.id!r} appears twice")
        seen.add(sequence.id)
        needed = math.ceil(len(sequence.token_ids) / geometry.block_size)
        if len(sequence.token_ids) == 0:
            raise ValueError(f"sequence {sequence.id!r} has no tokens")
        if len(sequence.block_ids) != needed:
            raise ValueError(
                f"sequence {sequence.id!r}: {len(sequence.token_ids)} tokens need {needed} blocks "
                f"of {geometry.block_size}, got {len(sequence.block_ids)} block ids"
            )


def _check_same_geometry(layouts: Sequence[CacheLayout]) -> KVGeometry:
    if not layouts:
        raise ValueError("need at least one cache layout")
    geometry = layouts[0].geometry
    for layout in layouts[1:]:
        if layout.geometry != geometry:
            raise IncompatibleSnapshotError(
                f"TP ranks disagree on the KV geometry: {geometry.describe()} vs "
                f"{layout.geometry.describe()}"
            )
    return geometry


def _as_layouts(layout: CacheLayout | Sequence[CacheLayout]) -> list[CacheLayout]:
    return [layout] if isinstance(layout, CacheLayout) else list(layout)


def _handlers(
    layouts: Sequence[CacheLayout], direction: Direction, backend: str, sm_budget: int | None
) -> list[TransferHandler]:
    """One transfer handler per rank; an SM budget runs the copies on the Triton kernel with at
    most ``sm_budget`` programs, so the copy never occupies more SMs than that."""
    if sm_budget is None:
        return [TransferHandler(rank, direction, backend=backend) for rank in layouts]
    if sm_budget < 1:
        raise ValueError(f"sm_budget must be at least 1, got {sm_budget}")
    if backend not in ("auto", "triton"):
        raise ValueError(f"sm_budget runs the triton backend; backend={backend!r} contradicts it")
    options = {"triton": {"max_programs": sm_budget}}
    return [
        TransferHandler(rank, direction, backend="triton", backend_options=options)
        for rank in layouts
    ]


def _check_staging(page_size_bytes: int, staging: PinnedPool | None, num_slots: int) -> None:
    if staging is not None and staging.slot_bytes < page_size_bytes:
        raise ValueError(
            f"staging slots of {staging.slot_bytes} bytes cannot hold one "
            f"{page_size_bytes}-byte page"
        )
    if staging is None and num_slots < 1:
        raise ValueError(f"staging needs at least one slot, got {num_slots}")


def _staging_pool(
    page_size_bytes: int, staging: PinnedPool | None, staging_bytes: int, num_slots: int
) -> PinnedPool:
    """The caller's pool, or a new lazily pinned one of ``staging_bytes`` in ``num_slots``."""
    if staging is not None:
        return staging
    # A slot holds at least one canonical page, and never a fraction of one.
    slot_bytes = max(page_size_bytes, staging_bytes // num_slots)
    slot_bytes -= slot_bytes % page_size_bytes
    # Pinned slot by slot on first use: the first copy waits for one slot, not the pool.
    return PinnedPool(slot_bytes, num_slots, lazy=True)


def _chunks(count: int, per_chunk: int) -> Iterator[slice]:
    for start in range(0, count, per_chunk):
        yield slice(start, min(count, start + per_chunk))


def _submit_to_all(
    handlers: Sequence[TransferHandler], job_ids: Iterator[int], copy: PageCopy, what: str
) -> list[int]:
    """Submit ``copy`` to every rank's handler; the job ids, one per handler."""
    jobs = []
    for handler in handlers:
        job_id = next(job_ids)
        if not handler.submit(job_id, [copy]):
            raise TransferFailedError(f"{what}: the transfer handler refused a job")
        jobs.append(job_id)
    return jobs


def _wait_for_all(handlers: Sequence[TransferHandler], jobs: Sequence[int], what: str) -> None:
    """Wait for each handler's job; a failed one raises :class:`TransferFailedError`."""
    for handler, job_id in zip(handlers, jobs, strict=True):
        for result in handler.wait([job_id]):
            if not result.success:
                raise TransferFailedError(
                    f"{what}: transfer job {result.job_id} failed: {result.error}"
                )


def capture(
    layout: CacheLayout | Sequence[CacheLayout],
    sequences: Sequence[SequenceBlocks],
    path: str | Path,
    *,
    source: fmt.SourceInfo,
    backend: str = "auto",
    sm_budget: int | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    staging_slots: int = DEFAULT_STAGING_SLOTS,
    progress: ProgressCallback | None = None,
    reproducible: bool = False,
    max_shard_bytes: int | None = None,
    direct_io: bool | None = None,
    staging: PinnedPool | None = None,
    trace: TraceHook | None = None,
) -> CaptureResult:
    """Write the KV of ``sequences`` from the cache ``layout`` describes to a snapshot at ``path``.

    ``layout`` may be a list with one layout per TP rank held by this process; each rank then
    contributes the canonical fragments it is elected for, and the snapshot is the complete
    TP-free one. Blocks whose prefix hash chains coincide are stored once. With
    ``reproducible`` the metadata holds nothing time- or host-dependent. The snapshot is
    published atomically: on any error the previous file at ``path`` is untouched.

    ``backend`` picks the copy backend (``auto``, ``cuda-batch``, ``triton``, ``torch``,
    ``cpu``). ``sm_budget`` bounds the SMs the copy may occupy while the model computes: the
    copies then run on the Triton kernel with at most that many programs (docs/benchmarks.md
    gives its cost in bandwidth).

    Staging: ``staging_bytes`` of host memory in ``staging_slots`` slots, pinned slot by slot
    on first use and freed at the end; or ``staging``, a :class:`~kvsnap.pinned.PinnedPool` the
    caller keeps (pinned once, warm for every capture and restore that shares it; its slots
    are given back at the end). ``trace(kind, started, finished, nbytes)`` receives a span for
    each step (setup, slot waits, transfers, checksums, writes, commit phases):
    ``benchmarks/e2e.py --timeline`` shows what it records.
    """
    started = time.perf_counter()
    layouts = _as_layouts(layout)
    geometry = _check_same_geometry(layouts)
    _validate_sequences(geometry, sequences)
    token_lists = [np.asarray(sequence.token_ids, dtype=np.int64) for sequence in sequences]
    chains = [fmt.prefix_hash_chain(tokens, geometry.block_size) for tokens in token_lists]
    dedupe = fmt.dedupe_blocks(chains)
    # The device block holding each unique snapshot block: take its first owner's block.
    device_block_ids = np.array(
        [int(sequences[seq_index].block_ids[position]) for seq_index, position in dedupe.owners],
        dtype=np.int64,
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
        num_blocks=len(device_block_ids),
        capture_encoding=layouts[0].encoding,
        tp_size=layouts[0].tp_size,
        # A reproducible snapshot must not change bytes with each patch release.
        kvsnap_version=".".join(__version__.split(".")[:2]) if reproducible else __version__,
        created=None if reproducible else fmt.utc_now(),
    )
    page_bytes = geometry.canonical_page_size_bytes
    total_bytes = page_bytes * len(device_block_ids) * len(geometry.tensor_names())
    _check_staging(page_bytes, staging, staging_slots)
    with traced(trace, "setup.handlers"):
        handlers = _handlers(layouts, Direction.DEVICE_TO_HOST, backend, sm_budget)
    with traced(trace, "setup.pool"):
        pool = _staging_pool(page_bytes, staging, staging_bytes, staging_slots)
    held: list[Slot] = []  # the slot being filled, until the writer owns it
    moved = _Progress(progress, total_bytes)
    try:
        with traced(trace, "setup.writer"):
            writer = SnapshotWriter(
                path, metadata, direct_io=direct_io, max_shard_bytes=max_shard_bytes, trace=trace
            )
        try:
            _transfer_to_writer(handlers, pool, writer, device_block_ids, held, moved, trace)
            info = writer.commit()
        except BaseException:
            writer.abort()
            raise
    finally:
        with traced(trace, "teardown"):
            _finish_staging(handlers, pool, held, owned=staging is None)
    return CaptureResult(
        path=str(info.path),
        num_sequences=len(records),
        num_tokens=sum(len(tokens) for tokens in token_lists),
        num_blocks=len(device_block_ids),
        num_bytes=info.num_bytes,
        seconds=time.perf_counter() - started,
        backend=handlers[0].backend_name,
        direct_io_fallback=writer.fallback_reason,
    )


class _Progress:
    """Counts the bytes moved and reports them to an optional :data:`ProgressCallback`."""

    def __init__(self, callback: ProgressCallback | None, total_bytes: int) -> None:
        self.callback = callback
        self.total_bytes = total_bytes
        self.done_bytes = 0

    def add(self, num_bytes: int) -> None:
        self.done_bytes += num_bytes
        if self.callback is not None:
            self.callback(self.done_bytes, self.total_bytes)


def _transfer_to_writer(
    handlers: Sequence[TransferHandler],
    pool: PinnedPool,
    writer: SnapshotWriter,
    device_block_ids: np.ndarray,
    held: list[Slot],
    progress: _Progress,
    trace: TraceHook | None,
) -> None:
    """Copy every layer tensor's blocks slot by slot into staging and hand each slot to the
    writer as soon as its copy completes.

    The copy of one slot is short next to the disk's time for it, so waiting for it here costs
    nothing while the writer holds every other slot: the disk always has queued writes.
    """
    job_ids = itertools.count()
    page_bytes = writer.page_size_bytes
    blocks_per_slot = pool.slot_bytes // page_bytes
    for name in writer.tensor_order():
        for chunk in _chunks(len(device_block_ids), blocks_per_slot):
            with traced(trace, "staging.wait"):
                slot = pool.acquire()
            held.append(slot)
            count = chunk.stop - chunk.start
            copy = PageCopy(
                name=name,
                device_block_ids=device_block_ids[chunk],
                host=HostPages.contiguous(slot.data_ptr, count, page_bytes),
                host_chunk_ids=np.arange(count, dtype=np.int64),
                snapshot_block_ids=np.arange(chunk.start, chunk.stop, dtype=np.int64),
            )
            with traced(trace, "transfer", count * page_bytes):
                jobs = _submit_to_all(handlers, job_ids, copy, f"capture of {name}")
                _wait_for_all(handlers, jobs, f"capture of {name}")
            with traced(trace, "writer.enqueue", count * page_bytes):
                written = writer.write_pages(name, slot.as_numpy(count * page_bytes))
            held.remove(slot)
            written.add_done_callback(lambda _future, slot=slot: pool.release(slot))
            progress.add(count * page_bytes)


def _finish_staging(
    handlers: Sequence[TransferHandler], pool: PinnedPool, held: Sequence[Slot], *, owned: bool
) -> None:
    """Wait for the copies still in flight, then give back the slots still held (and close a
    pool this call made): no slot is reused while a copy may still touch it."""
    try:
        for handler in handlers:
            handler.shutdown()
    finally:
        for slot in held:
            pool.release(slot)
        if owned:
            pool.close()


@dataclass(frozen=True)
class _SlotRead:
    """A staging slot being filled with ``chunk`` of tensor ``name``'s snapshot blocks."""

    future: Future[None]
    slot: Slot
    name: str
    chunk: slice


class Snapshot:
    """An open snapshot: its metadata, its sequences, and what can be done with them.

    Use :meth:`open`; a ``Snapshot`` is a context manager that closes the file.
    """

    def __init__(self, reader: SnapshotReader, path: str) -> None:
        self._reader = reader
        self.path = path

    @classmethod
    def open(cls, path: str | Path, *, verify: bool = True) -> Snapshot:
        """Open and strictly validate the snapshot header at ``path`` (a local path or fsspec URL).

        With ``verify`` (the default) every block read later is checked against its checksum.
        Raises :class:`~kvsnap.errors.KVSnapError` subclasses for anything that is not a
        readable kvsnap snapshot.
        """
        return cls(SnapshotReader(path, verify=verify), str(path))

    # -- metadata --------------------------------------------------------------------------

    @property
    def metadata(self) -> fmt.SnapshotMetadata:
        return self._reader.metadata

    @property
    def format_version(self) -> int:
        """The format version the snapshot was written in."""
        return self._reader.format_version

    @property
    def geometry(self) -> KVGeometry:
        return self.metadata.geometry

    @property
    def sequences(self) -> list[fmt.SequenceRecord]:
        return self.metadata.sequences

    def sequence(self, sequence_id: str) -> fmt.SequenceRecord:
        """The sequence named ``sequence_id``; ``KeyError`` naming the known ids otherwise."""
        for record in self.sequences:
            if record.id == sequence_id:
                return record
        known = ", ".join(record.id for record in self.sequences)
        raise KeyError(f"no sequence {sequence_id!r} in {self.path} (it has: {known})")

    @property
    def num_blocks(self) -> int:
        return self.metadata.num_blocks

    @property
    def kv_bytes(self) -> int:
        """Bytes of KV data (all layer tensors)."""
        return self.num_blocks * self.geometry.bytes_per_block

    def shared_blocks(self) -> dict[str, int]:
        """Per sequence, how many of its blocks another sequence also uses."""
        users = np.zeros(self.num_blocks, dtype=np.int64)
        for record in self.sequences:
            np.add.at(users, np.unique(record.block_ids), 1)
        return {record.id: int((users[record.block_ids] > 1).sum()) for record in self.sequences}

    # -- checks ----------------------------------------------------------------------------

    def verify(self, progress: ProgressCallback | None = None) -> list[fmt.Problem]:
        """Check the structure and every checksum; an empty list means the snapshot is intact."""
        total = self.kv_bytes
        callback = None if progress is None else (lambda done: progress(done, total))
        return self._reader.verify(progress=callback)

    def check_compatible(
        self, geometry: KVGeometry, *, model_fingerprint: str | None = None, force: bool = False
    ) -> None:
        """Refuse (with :class:`IncompatibleSnapshotError`) a target this snapshot does not fit.

        The KV geometry (layers, KV heads x head dim or latent, tokens per block, dtype) must
        match; the model fingerprint must too unless ``force``. The message names both sides.
        """
        mine = self.geometry
        differences = [
            f"{field_name}: snapshot {getattr(mine, field_name)!r}, "
            f"target {getattr(geometry, field_name)!r}"
            for field_name in (
                "num_layers",
                "num_kv_heads",
                "head_dim",
                "latent_dim",
                "block_size",
                "dtype",
            )
            if getattr(mine, field_name) != getattr(geometry, field_name)
        ]
        if differences:
            raise IncompatibleSnapshotError(
                f"{self.path} does not fit the target cache ({'; '.join(differences)}). "
                f"Snapshot: {mine.describe()}; target: {geometry.describe()}"
            )
        snapshot_fingerprint = self.metadata.source.model_fingerprint
        if (
            model_fingerprint is not None
            and not force
            and snapshot_fingerprint
            and snapshot_fingerprint != model_fingerprint
        ):
            raise IncompatibleSnapshotError(
                f"{self.path} was captured from model {self.metadata.source.model_id!r} "
                f"(fingerprint {snapshot_fingerprint[:16]}), the target's fingerprint is "
                f"{model_fingerprint[:16]}; use --force to restore anyway"
            )

    # -- data ------------------------------------------------------------------------------

    def read_tensor(self, name: str) -> torch.Tensor:
        """A whole canonical tensor, ``(num_blocks, *canonical_page_shape)``, checksums verified."""
        return self._reader.read_tensor(name)

    def sequence_kv(self, sequence_id: str, name: str) -> torch.Tensor:
        """One sequence's KV of tensor ``name``.

        Shaped ``(num_tokens, heads, head_dim)``, or ``(num_tokens, latent_dim)`` for MLA.
        """
        record = self.sequence(sequence_id)
        page_bytes = self._reader.page_size_bytes(name)
        pages = np.empty(len(record.block_ids) * page_bytes, dtype=np.uint8)
        self._reader.read_pages(name, record.block_ids, pages)
        shape = self.geometry.canonical_page_shape
        tensor = torch.from_numpy(pages).view(torch_dtype(self.geometry.dtype))
        tokens = tensor.reshape(len(record.block_ids) * shape[0], *shape[1:])
        return tokens[: len(record.token_ids)]

    def compare(
        self, other: Snapshot, *, atol: float = 0.0, rtol: float = 0.0
    ) -> analysis.Comparison:
        """Compare this snapshot's KV with ``other``: see :func:`kvsnap.analysis.compare`."""
        return analysis.compare(self, other, atol=atol, rtol=rtol)

    def restore(
        self,
        layout: CacheLayout | Sequence[CacheLayout],
        block_ids: Mapping[str, np.ndarray | Sequence[int]],
        *,
        backend: str = "auto",
        sm_budget: int | None = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        staging_slots: int = DEFAULT_STAGING_SLOTS,
        progress: ProgressCallback | None = None,
        model_fingerprint: str | None = None,
        force: bool = False,
        staging: PinnedPool | None = None,
        trace: TraceHook | None = None,
    ) -> RestoreResult:
        """Write the KV of the sequences named in ``block_ids`` into the target cache.

        ``block_ids`` maps a sequence id to the target's device block ids, one per block of that
        sequence. ``layout`` may list one layout per TP rank held by this process; every rank
        receives its own heads. Everything is checked before the first byte is written: the
        geometry (see :meth:`check_compatible`), the sequence ids and the block counts and
        ranges. Only the blocks of the named sequences are read. ``backend``, ``sm_budget``,
        the staging options and ``trace`` are as for :func:`capture`.
        """
        started = time.perf_counter()
        layouts = _as_layouts(layout)
        geometry = _check_same_geometry(layouts)
        self.check_compatible(geometry, model_fingerprint=model_fingerprint, force=force)
        snapshot_blocks, target_blocks, num_tokens = self._restore_pairs(block_ids, layouts)
        page_bytes = geometry.canonical_page_size_bytes
        names = geometry.tensor_names()
        total_bytes = page_bytes * len(snapshot_blocks) * len(names)
        _check_staging(page_bytes, staging, staging_slots)
        with traced(trace, "setup.handlers"):
            handlers = _handlers(layouts, Direction.HOST_TO_DEVICE, backend, sm_budget)
        with traced(trace, "setup.pool"):
            pool = _staging_pool(page_bytes, staging, staging_bytes, staging_slots)
        reads: deque[_SlotRead] = deque()
        moved = _Progress(progress, total_bytes)
        try:
            self._read_and_scatter(
                handlers, pool, names, (snapshot_blocks, target_blocks), reads, moved, trace
            )
        finally:
            with traced(trace, "teardown"):
                # A read still in flight must finish before its slot is reused or freed.
                wait_futures([read.future for read in reads])
                _finish_staging(
                    handlers, pool, [read.slot for read in reads], owned=staging is None
                )
        return RestoreResult(
            num_sequences=len(block_ids),
            num_tokens=num_tokens,
            num_blocks=len(snapshot_blocks),
            num_bytes=total_bytes,
            seconds=time.perf_counter() - started,
            backend=handlers[0].backend_name,
        )

    def _read_and_scatter(
        self,
        handlers: Sequence[TransferHandler],
        pool: PinnedPool,
        names: Sequence[str],
        block_pairs: tuple[np.ndarray, np.ndarray],
        reads: deque[_SlotRead],
        moved: _Progress,
        trace: TraceHook | None,
    ) -> None:
        """Read (and verify) into every free staging slot, and scatter slots in order as their
        reads complete; ``block_pairs`` are the snapshot blocks and their target blocks, and
        ``reads`` holds the slots being read, oldest first.

        Every slot but the one being scattered has a read queued, so the disk never waits for
        a scatter, and verifying one piece overlaps reading the next.
        """
        snapshot_blocks, target_blocks = block_pairs
        page_bytes = self._reader.page_size_bytes(names[0])
        blocks_per_slot = pool.slot_bytes // page_bytes
        work = deque(
            (name, chunk)
            for name in names
            for chunk in _chunks(len(snapshot_blocks), blocks_per_slot)
        )
        job_ids = itertools.count()
        while work or reads:
            while work:
                # Wait for a slot only with no read of ours queued: a pool shared with another
                # restore must not leave both waiting for each other's slots.
                slot = pool.try_acquire() if reads else self._acquire(pool, trace)
                if slot is None:
                    break
                try:
                    reads.append(self._start_read(slot, *work.popleft(), snapshot_blocks, trace))
                except BaseException:
                    pool.release(slot)
                    raise
            read = reads[0]
            with traced(trace, "read.wait"):
                read.future.result()
            count = read.chunk.stop - read.chunk.start
            copy = PageCopy(
                name=read.name,
                device_block_ids=target_blocks[read.chunk],
                host=HostPages.contiguous(read.slot.data_ptr, count, page_bytes),
                host_chunk_ids=np.arange(count, dtype=np.int64),
            )
            with traced(trace, "transfer", count * page_bytes):
                jobs = _submit_to_all(handlers, job_ids, copy, f"restore of {read.name}")
                _wait_for_all(handlers, jobs, f"restore of {read.name}")
            reads.popleft()
            pool.release(read.slot)
            moved.add(count * page_bytes)

    @staticmethod
    def _acquire(pool: PinnedPool, trace: TraceHook | None) -> Slot:
        with traced(trace, "staging.wait"):
            return pool.acquire()

    def _start_read(
        self,
        slot: Slot,
        name: str,
        chunk: slice,
        snapshot_blocks: np.ndarray,
        trace: TraceHook | None,
    ) -> _SlotRead:
        """Queue the read (and verification) of ``chunk`` of tensor ``name`` into ``slot``."""
        count = chunk.stop - chunk.start
        future = self._reader.read_pages_async(
            name,
            snapshot_blocks[chunk],
            slot.as_numpy(count * self._reader.page_size_bytes(name)),
            trace=trace,
        )
        return _SlotRead(future, slot, name, chunk)

    def _restore_pairs(
        self, block_ids: Mapping[str, np.ndarray | Sequence[int]], layouts: Sequence[CacheLayout]
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """(snapshot block, target block) pairs, sorted by snapshot block, and the token count."""
        if not block_ids:
            raise ValueError("restore needs at least one sequence")
        capacity = min(layout.num_blocks for layout in layouts)
        sources, targets = [], []
        num_tokens = 0
        for sequence_id, targets_of_sequence in block_ids.items():
            record = self.sequence(sequence_id)
            target = np.asarray(targets_of_sequence, dtype=np.int64)
            if len(target) != len(record.block_ids):
                raise IncompatibleSnapshotError(
                    f"sequence {sequence_id!r} has {len(record.block_ids)} blocks in {self.path}, "
                    f"the target gave {len(target)} block ids"
                )
            if len(target) and (target.min() < 0 or target.max() >= capacity):
                raise IncompatibleSnapshotError(
                    f"sequence {sequence_id!r}: target block ids {target.min()}..{target.max()} "
                    f"do not fit a cache of {capacity} blocks"
                )
            sources.append(record.block_ids)
            targets.append(target)
            num_tokens += len(record.token_ids)
        pairs = np.unique(
            np.stack([np.concatenate(sources), np.concatenate(targets)], axis=1), axis=0
        )
        written_twice = np.unique(pairs[:, 1], return_counts=True)
        if (written_twice[1] > 1).any():
            block = int(written_twice[0][np.argmax(written_twice[1] > 1)])
            raise IncompatibleSnapshotError(
                f"target block {block} would receive two different snapshot blocks"
            )
        return pairs[:, 0].copy(), pairs[:, 1].copy(), num_tokens

    # -- statistics ------------------------------------------------------------------------

    def valid_tokens_per_block(self) -> np.ndarray:
        """See :func:`kvsnap.analysis.valid_tokens_per_block`."""
        return analysis.valid_tokens_per_block(self)

    def tensor_stats(self, name: str) -> dict[str, float | int]:
        """See :func:`kvsnap.analysis.tensor_stats`."""
        return analysis.tensor_stats(self, name)

    def token_norms(self, sequence_id: str) -> dict[str, np.ndarray]:
        """See :func:`kvsnap.analysis.token_norms`."""
        return analysis.token_norms(self, sequence_id)

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
