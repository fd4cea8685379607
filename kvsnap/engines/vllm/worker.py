"""The connector's worker side: load planned blocks before a step, save blocks after it.

:class:`KVSnapWorker` runs in every vLLM worker process. It reads the registered caches
(:func:`~kvsnap.engines.vllm.registration.register_caches`), loads the blocks the scheduler
planned before the forward pass (every block checksum verified; blocks it could not load are
reported so vLLM recomputes them) and, after the forward pass, copies the saved blocks to host
memory and hands the snapshot write to a background thread.

The save and load paths themselves are :meth:`KVSnapWorker._load` (one stored chunk, or the
part of it vLLM's own prefix cache lacks, into the cache through the worker's warm
:class:`~kvsnap.pipeline.Pipeline`: one slot spans every layer) and :meth:`KVSnapWorker._write`
(one snapshot from host copies, after :func:`copy_blocks_to_host`): the only code that moves
KV. After each chunk write the store is pruned to ``store_capacity_bytes`` (LRU,
:func:`~kvsnap.engines.vllm.eviction.prune_store`).

Tensor parallelism: each rank copies the saved blocks of its own heads to host memory and the
TP group's CPU (gloo) group gathers them on rank 0, which builds one layout per rank over the
gathered copies and lets :func:`kvsnap.snapshot.capture` take from each rank the canonical
fragments it is elected for. Loads need no collective: every rank reads its own heads out of
the same canonical pages.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvsnap import format as fmt
from kvsnap.compat import check_fits
from kvsnap.engines.vllm.events import EventLog
from kvsnap.engines.vllm.eviction import prune_store, store_bytes
from kvsnap.engines.vllm.options import ConnectorOptions
from kvsnap.engines.vllm.registration import RegisteredCache, register_caches
from kvsnap.engines.vllm.specs import ChunkLoad, KVSnapConnectorMetadata, LoadSpec, SaveSpec
from kvsnap.engines.vllm.store import PrefixStore
from kvsnap.errors import (
    IncompatibleSnapshotError,
    NotASnapshotError,
    SnapshotCorruptError,
    SnapshotIOError,
    UnsupportedVersionError,
)
from kvsnap.layout import KVGeometry
from kvsnap.pipeline import Pipeline
from kvsnap.snapshot import SequenceBlocks, Snapshot, capture

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: Load errors that mean the chunk file is at fault (quarantined), not the engine.
_FILE_ERRORS = (
    SnapshotCorruptError,
    NotASnapshotError,
    UnsupportedVersionError,
    IncompatibleSnapshotError,
    SnapshotIOError,
    OSError,
)
#: Host staging for loads: snapshot pages are read into it, then scattered into the cache.


class KVSnapWorker:
    """The worker side of :class:`~kvsnap.engines.vllm.KVSnapConnector`.

    :meth:`register_kv_caches` builds the cache layout (or refuses the cache);
    :meth:`start_load_kv` loads, verifying every block checksum, and collects the blocks it
    could not load for :meth:`get_block_ids_with_load_errors`; :meth:`wait_for_save` copies
    the saved blocks to host memory and queues their snapshot writes.
    """

    def __init__(
        self,
        options: ConnectorOptions,
        store: PrefixStore,
        events: EventLog,
        *,
        vllm_config: VllmConfig,
        fingerprint: str,
        source: fmt.SourceInfo | None,
    ) -> None:
        self.options = options
        self.store = store
        self.events = events
        self.fingerprint = fingerprint
        self._vllm_config = vllm_config
        self._source = source
        self.cache: RegisteredCache | None = None
        self._load_errors: set[int] = set()
        self._pipeline: Pipeline | None = None
        self._writer: ThreadPoolExecutor | None = None
        self._writes: list[tuple[SaveSpec, Future[None]]] = []
        #: The store's size as this worker last measured it plus what it wrote since.
        self._store_bytes: int | None = None

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Build the cache layout from the registered tensors, or refuse them (LayoutError)."""
        self.cache = register_caches(self._vllm_config, kv_caches)
        layout = self.cache.layout
        # Kept for the engine's life: page table, staging and kernels stay warm across loads.
        self._pipeline = Pipeline(layout)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvsnap-writer")
        self.events.emit(
            "registered",
            layout=layout.describe(),
            encoding=layout.encoding,
            kv_cache_layout=self.cache.kv_cache_layout,
        )

    # -- loads -------------------------------------------------------------------------------

    def start_load_kv(self, meta: KVSnapConnectorMetadata) -> None:
        """Load this step's planned blocks before the forward pass (checksums verified).

        A chunk that fails to load ends its request's load: its blocks and those of the
        request's later chunks are reported (:meth:`get_block_ids_with_load_errors`) for vLLM
        to recompute, and a chunk whose file is at fault is quarantined.
        """
        for spec in meta.loads:
            started = time.perf_counter()
            for position, chunk in enumerate(spec.chunks):
                try:
                    self._load(chunk)
                except Exception as error:  # any failure: report the blocks, vLLM recomputes
                    self._load_failed(spec, position, error)
                    break
            else:
                self.events.emit(
                    "load",
                    request=spec.request_id,
                    paths=[chunk.path for chunk in spec.chunks],
                    tokens=spec.num_tokens,
                    blocks=len(spec.target_blocks),
                    seconds=round(time.perf_counter() - started, 6),
                )

    def _load_failed(self, spec: LoadSpec, position: int, error: Exception) -> None:
        """Report the blocks of ``spec`` from chunk ``position`` on; quarantine a bad file."""
        failed = spec.chunks[position]
        blocks = np.concatenate([chunk.target_blocks for chunk in spec.chunks[position:]])
        self._load_errors.update(int(block) for block in blocks)
        message = f"{type(error).__name__}: {error}"
        self.events.emit(
            "load_failed",
            logging.ERROR,
            request=spec.request_id,
            path=failed.path,
            blocks=len(blocks),
            error=message,
        )
        if isinstance(error, _FILE_ERRORS):
            moved = self.store.quarantine(failed.path)
            if moved is not None:
                self.events.emit(
                    "quarantine",
                    logging.WARNING,
                    request=spec.request_id,
                    path=failed.path,
                    moved_to=str(moved),
                    reason=message,
                )

    def _load(self, chunk: ChunkLoad) -> None:
        """Read ``chunk``'s blocks (checksums verified) and scatter them into the cache, through
        the worker's warm :class:`~kvsnap.pipeline.Pipeline` (one slot spans every layer)."""
        assert self.cache is not None and self._pipeline is not None
        with Snapshot.open(chunk.path) as snapshot:
            _check_fits(snapshot.metadata, self.cache.layout.geometry, self.fingerprint, chunk.path)
            self._pipeline.restore_blocks(snapshot, chunk.snapshot_blocks, chunk.target_blocks)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call; vLLM recomputes them."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves -------------------------------------------------------------------------------

    def wait_for_save(self, meta: KVSnapConnectorMetadata) -> None:
        """Copy this step's saved blocks to host memory and queue their snapshot writes.

        The forward pass waits for the copy (and, at TP > 1, the gather on rank 0) only; the
        checksumming and writing run on a background thread, at most
        ``max_pending_writes`` snapshots behind.
        """
        self._reap_writes(block=False)
        if not meta.saves:
            return
        assert self.cache is not None and self._writer is not None
        all_blocks = np.concatenate([spec.block_ids for spec in meta.saves])
        per_rank = _gather_on_first_rank(
            copy_blocks_to_host(self.cache.caches, all_blocks), self.cache.layout.tp_size
        )
        if per_rank is None:  # not the writing rank
            return
        offset = 0
        for spec in meta.saves:
            count = len(spec.block_ids)
            parts = [rank_copy[:, offset : offset + count] for rank_copy in per_rank]
            offset += count
            while len(self._writes) >= self.options.max_pending_writes:
                self._reap_writes(block=True)
            self._writes.append((spec, self._writer.submit(self._write, spec, parts)))

    def _write(self, spec: SaveSpec, parts: Sequence[torch.Tensor]) -> None:
        """Write one saved snapshot from the host copies ``parts`` (one per TP rank)."""
        assert self.cache is not None and self._source is not None
        started = time.perf_counter()
        path = Path(spec.path)
        if spec.kind == "persist" and path.exists():
            return  # another request or engine stored this chunk meanwhile
        path.parent.mkdir(parents=True, exist_ok=True)
        sequence = SequenceBlocks(
            id=spec.sequence_id,
            token_ids=spec.token_ids,
            block_ids=np.arange(len(spec.block_ids), dtype=np.int64),
        )
        result = capture(self.cache.host_layouts(parts), [sequence], path, source=self._source)
        self.events.emit(
            "save" if spec.kind == "persist" else "dump",
            request=spec.request_id,
            path=str(path),
            tokens=len(spec.token_ids),
            blocks=result.num_blocks,
            bytes=result.num_bytes,
            seconds=round(time.perf_counter() - started, 6),
        )
        if spec.kind == "persist":
            self._keep_capacity(result.num_bytes)

    def _keep_capacity(self, written: int) -> None:
        """After a chunk write: prune the store to ``store_capacity_bytes`` (LRU) if above it."""
        capacity = self.options.store_capacity_bytes
        if capacity is None:
            return
        if self._store_bytes is None:
            self._store_bytes = store_bytes(self.store.root)
        else:
            self._store_bytes += written
        if self._store_bytes <= capacity:
            return
        removed = prune_store(self.store.root, capacity, min_idle_s=self.options.store_min_idle_s)
        for entry in removed:
            self.events.emit(
                "evict",
                path=str(entry.path),
                bytes=entry.size,
                idle_s=round(entry.age(), 3),
                quarantined=entry.quarantined,
            )
        self._store_bytes = store_bytes(self.store.root)

    def _reap_writes(self, block: bool) -> None:
        """Collect finished writes (all of the oldest one when ``block``); log failures."""
        remaining = []
        for position, (spec, future) in enumerate(self._writes):
            if block and position == 0:
                future.exception()
            if not future.done():
                remaining.append((spec, future))
                continue
            error = future.exception()
            if error is not None:
                self.events.emit(
                    "save_failed",
                    logging.ERROR,
                    request=spec.request_id,
                    path=spec.path,
                    error=f"{type(error).__name__}: {error}",
                )
        self._writes = remaining

    def shutdown(self) -> None:
        """Finish every queued snapshot write, then drop the load pipeline."""
        while self._writes:
            self._reap_writes(block=True)
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        self._pipeline = None


def copy_blocks_to_host(caches: Sequence[torch.Tensor], block_ids: np.ndarray) -> torch.Tensor:
    """``[layers, n, H, N, C]``: blocks ``block_ids`` of every layer, copied to host memory."""
    index = torch.from_numpy(block_ids).to(caches[0].device)
    # One host copy per layer, contiguous: the bytes the snapshot is made of.
    return torch.stack([cache.index_select(0, index) for cache in caches]).cpu()


def _check_fits(
    metadata: fmt.SnapshotMetadata, geometry: KVGeometry, fingerprint: str, path: str
) -> None:
    """Refuse a snapshot whose geometry or model fingerprint differs from the engine's (the
    restore contract's one check, :func:`kvsnap.compat.check_fits`)."""
    check_fits(metadata, geometry, path=path, model_fingerprint=fingerprint)


def _gather_on_first_rank(copies: torch.Tensor, tp_size: int) -> list[torch.Tensor] | None:
    """Every TP rank's ``copies`` on rank 0 (in rank order); ``None`` on the other ranks.

    Runs over the TP group's CPU (gloo) group as raw bytes, so any KV dtype travels unchanged.
    """
    if tp_size == 1:
        return [copies]
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    raw = copies.contiguous().view(torch.uint8)
    gathered = (
        [torch.empty_like(raw) for _ in range(group.world_size)]
        if group.rank_in_group == 0
        else None
    )
    dist.gather(raw, gathered, dst=group.ranks[0], group=group.cpu_group)
    if gathered is None:
        return None
    return [part.view(copies.dtype).view(copies.shape) for part in gathered]
