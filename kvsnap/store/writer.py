"""The streaming snapshot writer: hashing beside writing, bounded memory, atomic publish.

:class:`SnapshotWriter` takes the caller's pages, hashes them on the process-wide hashing pool
and hands them to its one :class:`~kvsnap.store.snapshot_files.WriteTarget`, chosen once: local
files (:mod:`~kvsnap.store.write_local`) or an fsspec stream (:mod:`~kvsnap.store.
write_stream`). The layouts of the files and the digests that complete them are a
:class:`~kvsnap.store.snapshot_files.SnapshotFiles`; the bound on bytes in flight and the first
error a :class:`~kvsnap.store.snapshot_files.WriteGate`; the order the pages must come in, and
how far they got, a :class:`~kvsnap.store.write_order.WriteOrder`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from kvsnap import format as fmt
from kvsnap.errors import SnapshotIOError
from kvsnap.format import SnapshotMetadata
from kvsnap.format.signing import KeyRing
from kvsnap.store import tuning
from kvsnap.store.completion import Completion
from kvsnap.store.lanes import TaskGroup
from kvsnap.store.location import io_error, locate
from kvsnap.store.pools import cpu_count, shared_executor
from kvsnap.store.slot_writes import SlotPiece, all_done, contiguous_writes, hash_batches
from kvsnap.store.snapshot_files import SnapshotFiles, WriteGate, WriteTarget
from kvsnap.store.tracing import TraceHook, traced
from kvsnap.store.write_local import LocalTarget
from kvsnap.store.write_order import WriteOrder
from kvsnap.store.write_stream import StreamTarget


@dataclass(frozen=True)
class SnapshotInfo:
    """What :meth:`SnapshotWriter.commit` published.

    ``path`` is what :class:`SnapshotReader` opens (the file, or the index of a sharded
    snapshot); ``files`` the data files in order; ``num_bytes`` their total size; ``kv_bytes``
    the layer tensors' bytes. ``direct_io`` tells whether O_DIRECT carried layer data.
    """

    path: str
    files: tuple[str, ...]
    num_bytes: int
    kv_bytes: int
    num_blocks: int
    direct_io: bool
    fallback_reason: str | None
    seconds: float
    #: xxh3-128 (hex) of each file's checksum trailer, in ``files`` order: what an index
    #: records to bind itself to exactly these files.
    trailers: tuple[str, ...] = ()
    #: Whether the layer data was placed in the mapped files by the caller's device copies
    #: (:meth:`SnapshotWriter.map_for_device`) rather than written.
    mapped: bool = False


class SnapshotWriter:
    """Streams one snapshot to ``url``: a local path or an fsspec URL.

    Feed every layer tensor in :meth:`tensor_order`, each as consecutive blocks
    (:meth:`write_pages`), then :meth:`commit`. As a context manager it commits on a clean exit
    and aborts on an exception. :meth:`abort` removes everything written and leaves any
    previous snapshot at ``url`` untouched.

    Args:
        url: target path or URL. With ``max_shard_bytes`` and a snapshot larger than it,
            shards go to ``{stem}-00001-of-0000n.safetensors`` next to it (``stem``: the name
            without ``.safetensors``) and the index to ``{url}.index.json``.
        metadata: what the snapshot describes; checked (``ValueError``) before anything is
            written.
        direct_io: ``None`` uses O_DIRECT for local files when the filesystem accepts it,
            ``True`` requires it (:class:`SnapshotIOError` otherwise), ``False`` never uses it.
        hash_threads: threads of the process-wide hashing pool this writer uses (default:
            CPUs, 2 to 8; each count is one pool, created once). Writes go in file order, one
            at a time, through a lane on the process-wide write pool: a writer starts no
            thread of its own.
        max_shard_bytes: largest tensor bytes per shard (a larger single tensor gets a shard
            of its own); ``None`` writes one file.
        progress: called with the layer bytes written so far, from worker threads, serialized,
            with non-decreasing values.
        max_inflight_bytes: bytes of caller buffers held at once (default 256 MiB).
        storage_options: passed to fsspec for URLs (e.g. an S3 ``endpoint_url``).
        trace: receives ``hash`` and ``write`` spans per piece and ``commit.*`` spans.
        keys: sign every file with the first key (:mod:`kvsnap.format.signing`): the
            metadata's ``signature`` is set to ``"hmac-sha256-blake3"``, every page's BLAKE3
            digest is computed beside its xxh3-64 (or taken from the caller: ``write_slot``,
            ``placed_slot``) and each file ends with its page digests, trailer and signature.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        metadata: SnapshotMetadata,
        *,
        direct_io: bool | None = None,
        hash_threads: int | None = None,
        max_shard_bytes: int | None = None,
        progress: Callable[[int], None] | None = None,
        max_inflight_bytes: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        trace: TraceHook | None = None,
        keys: KeyRing | None = None,
    ) -> None:
        self._state = "starting"
        self._trace = trace
        self._started = time.perf_counter()
        problems = metadata.problems()
        if problems:
            raise ValueError("cannot write this snapshot metadata: " + "; ".join(problems[:5]))
        if keys is not None:
            metadata = dataclasses.replace(metadata, signature=fmt.SIGNATURE_ALGORITHM)
        elif metadata.signature is not None:
            raise ValueError("the metadata says the snapshot is signed, but no keys were given")
        self.metadata = metadata
        #: What :meth:`commit` published (also set when the context manager commits).
        self.info: SnapshotInfo | None = None
        self._location = locate(url, storage_options)
        self._snapshot_files = SnapshotFiles(self._location, metadata, max_shard_bytes, keys)
        self._page_bytes = self._snapshot_files.page_bytes
        self._num_blocks = self._snapshot_files.num_blocks
        self._binds_pages = self._snapshot_files.page_digests is not None
        self._order = WriteOrder(
            self._snapshot_files.names, self._snapshot_files.tensor_index, self._num_blocks
        )
        self._progress = progress
        self._progress_lock = threading.Lock()
        self._layer_bytes_done = 0
        self._gate = WriteGate(
            self._location.url, max_inflight_bytes or tuning.DEFAULT_MAX_INFLIGHT_BYTES
        )
        threads = hash_threads or max(2, min(8, cpu_count()))
        # Shared pools: a snapshot creates no thread (three per snapshot cost ~7 ms of a small
        # capture); the target keeps this writer's writes in order, one at a time.
        self._hash_pool = TaskGroup(shared_executor("hash", threads))
        target_kind = LocalTarget if self._location.is_local else StreamTarget
        self._target: WriteTarget = target_kind(self._snapshot_files, self._gate, trace)
        try:
            self._target.start(direct_io)
        except BaseException as error:
            self._state = "open"
            self.abort()
            if isinstance(error, OSError):
                raise io_error("creating the snapshot", self._location.url, error) from error
            raise
        self._state = "open"

    # -- public API ----------------------------------------------------------------------

    @property
    def fallback_reason(self) -> str | None:
        """Why O_DIRECT did not carry (all) layer data (``None``: it did)."""
        return self._target.fallback_reason

    @property
    def preallocated(self) -> bool:
        """Whether the local files' blocks were reserved up front."""
        return self._target.preallocated

    def tensor_order(self) -> list[str]:
        """Layer tensor names in the order :meth:`write_pages` must receive them."""
        return list(self._order.names)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one canonical page (one block of one layer tensor)."""
        return self._page_bytes

    def write_pages(self, name: str, pages: np.ndarray) -> concurrent.futures.Future[None]:
        """Append the next ``len(pages) // page_size_bytes`` blocks of layer tensor ``name``.

        ``pages`` is a C-contiguous uint8 array of whole canonical pages. Returns a future that
        completes (``None``, or the write's exception) once ``pages`` may be reused; the data
        is then hashed and handed to the file. Waits first while more than
        ``max_inflight_bytes`` are in flight. Tensors must come in :meth:`tensor_order`, each
        tensor's blocks in order, possibly over several calls.
        """
        tensor, flat = self._checked_pages(name, pages)
        count = flat.nbytes // self._page_bytes
        first = self._order.blocks_written[tensor]
        shard, entry = self._snapshot_files.placement[name]
        if count == 0:
            empty: concurrent.futures.Future[None] = concurrent.futures.Future()
            empty.set_result(None)
            return empty
        self._gate.admit(flat.nbytes)
        hash_parts = self._split(first, count, tuning.SUBCHUNK_BYTES)
        write_parts = self._split(first, count, tuning.WRITE_CHUNK_BYTES)
        done = Completion(
            len(hash_parts) + len(write_parts),
            on_done=lambda: self._gate.release(flat.nbytes),
            cancelled=lambda: SnapshotIOError("the writer was aborted", file=self._location.url),
        )
        # The file write does not need the checksums: hashing and writing read the same buffer
        # at once, so the disk starts as soon as the buffer arrives.
        for block, blocks in hash_parts:
            view = self._pages_view(flat, first, block, blocks)
            hashed = self._submit_hash(self._hash, tensor, block, view)
            self._target.hashed(shard, hashed)
            done.watch(hashed)
        for block, blocks in write_parts:
            view = self._pages_view(flat, first, block, blocks)
            done.watch(self._submit_write(shard, entry.begin + block * self._page_bytes, view))
        if self._order.count(tensor, count):
            self._target.tensor_done(self._order.due())
        return done.future

    @property
    def wants_page_digests(self) -> bool:
        """Whether every page's BLAKE3 digest is part of the snapshot (a signed one): a caller
        that hashes pages itself passes them to :meth:`write_slot` and :meth:`placed_slot`."""
        return self._binds_pages

    def write_slot(
        self,
        segments: Sequence[tuple[str, np.ndarray]],
        digests: np.ndarray | None = None,
        page_digests: np.ndarray | None = None,
    ) -> concurrent.futures.Future[None]:
        """:meth:`write_pages` of several tensors' pages at once, in order.

        Each ``(name, pages)`` continues its tensor as :meth:`write_pages` would. The slot is
        hashed in a few tasks of about ``SUBCHUNK_BYTES`` whatever the number of tensors in it,
        and the pages that follow each other in the file and in memory (a slot holding whole
        tensors, back to back) go to the file as one write: a call's cost does not grow with
        the number of tensors it spans. The future completes once every page may be reused.
        ``digests``, the pages' xxh3-64 in order (computed where the pages were, on the
        device), replaces the hashing; so does ``page_digests``, their BLAKE3 digests
        (``(pages, 32)`` uint8), of a signed snapshot (:attr:`wants_page_digests`): whichever
        is not given is computed here.
        """
        if not self._target.merges_tensors:
            return all_done([self.write_pages(name, pages) for name, pages in segments])
        pieces = self._slot_pieces(segments)
        total = sum(piece[2].nbytes for piece in pieces)
        self._gate.admit(total)
        if digests is not None:
            self._store_digests(pieces, digests, self._snapshot_files.digests)
        if page_digests is not None and self._binds_pages:
            self._store_digests(pieces, page_digests, self._snapshot_files.page_digests)
        kinds = (digests is None, page_digests is None and self._binds_pages)
        batches = hash_batches(pieces, tuning.SUBCHUNK_BYTES) if kinds[0] or kinds[1] else []
        writes = contiguous_writes(pieces, tuning.WRITE_CHUNK_BYTES)

        def release() -> None:
            # Until here ``pieces`` keeps the caller's arrays alive under the merged views.
            self._gate.release(total)
            pieces.clear()

        done = Completion(
            len(batches) + len(writes),
            on_done=release,
            cancelled=lambda: SnapshotIOError("the writer was aborted", file=self._location.url),
        )
        for batch in batches:
            done.watch(self._submit_hash(self._hash_batch, batch, *kinds))
        for shard, offset, view in writes:
            done.watch(self._submit_write(shard, offset, view))
        return done.future

    def map_for_device(self, *, register: bool = True) -> str | None:
        """Have the caller's device place the layer data in the files instead of writing it.

        Where the files are local, memory-backed (tmpfs, ramfs) and the layer data at least
        ``tuning.MAPPED_WRITE_MIN_BYTES``, each temporary file is sized to its final length,
        mapped read-write shared and (``register``) registered with CUDA; the caller then
        copies every page to where :meth:`page_placement` says in :meth:`mapped_files` and
        reports it with :meth:`placed_slot` (with its digests: the host never reads the
        mapping). Commit unregisters and unmaps, then writes the checksums, trailer and
        signature, fsyncs and publishes as always. Call before any page. Returns ``None`` once
        mapped, else why not; the writer then takes pages as before. ``register=False``
        (tests only) maps without CUDA, for copies made by the host.
        """
        self._check_open()
        if self._order.started:
            raise RuntimeError("map_for_device must come before the first page")
        with traced(self._trace, "setup.map"):
            return self._target.map_data(register)

    def mapped_files(self) -> list[np.ndarray]:
        """After :meth:`map_for_device`: each file of the snapshot as a uint8 array over its
        mapping, in file order, for the device's copies."""
        return self._target.mapped_arrays()

    def page_placement(self, name: str, block: int) -> tuple[int, int]:
        """The file (index into :meth:`mapped_files`) and byte offset of block ``block`` of
        layer tensor ``name``; the tensor's later blocks follow it."""
        shard, entry = self._snapshot_files.placement[name]
        return shard, entry.begin + block * self._page_bytes

    def placed_slot(
        self,
        segments: Sequence[tuple[str, int]],
        digests: np.ndarray,
        page_digests: np.ndarray | None = None,
    ) -> None:
        """Count pages the caller placed in the mapped files as written.

        Each ``(name, num_pages)`` continues its tensor as :meth:`write_slot`'s segments do;
        ``digests`` are the pages' xxh3-64 in order, computed where the pages were, and
        ``page_digests`` their BLAKE3 digests (``(pages, 32)`` uint8), which a signed snapshot
        requires (:attr:`wants_page_digests`). The caller's copies must be complete (commit
        reads nothing back).
        """
        self._check_open()
        if not self._target.mapped:
            raise RuntimeError("placed_slot needs the files mapped (map_for_device)")
        total = sum(num_pages for _, num_pages in segments)
        if total != len(digests):
            raise ValueError(f"{len(digests)} digests for {total} pages")
        bound = self._snapshot_files.page_digests
        if bound is not None and (page_digests is None or len(page_digests) != total):
            raise ValueError(f"a signed snapshot needs the BLAKE3 digests of all {total} pages")
        pieces: list[tuple[int, int, int]] = []
        for name, num_pages in segments:
            tensor = self._order.checked(name, num_pages)
            pieces.append((tensor, self._order.blocks_written[tensor], num_pages))
            self._order.count(tensor, num_pages)
        page = 0
        for tensor, first, count in pieces:
            self._snapshot_files.digests[tensor, first : first + count] = digests[
                page : page + count
            ]
            if bound is not None:
                assert page_digests is not None
                bound[tensor, first : first + count] = page_digests[page : page + count]
            page += count
        self._report(page * self._page_bytes)

    def _slot_pieces(self, segments: Sequence[tuple[str, np.ndarray]]) -> list[SlotPiece]:
        """Each segment checked and counted as written: its tensor, first block, pages, file
        and file offset."""
        pieces = []
        for name, pages in segments:
            tensor, flat = self._checked_pages(name, pages)
            first = self._order.blocks_written[tensor]
            shard, entry = self._snapshot_files.placement[name]
            pieces.append((tensor, first, flat, shard, entry.begin + first * self._page_bytes))
            self._order.count(tensor, flat.nbytes // self._page_bytes)
        return pieces

    def _checked_pages(self, name: str, pages: np.ndarray) -> tuple[int, np.ndarray]:
        """``write_pages``' arguments checked: the tensor's index and the pages, flat."""
        self._check_open()
        if (
            not isinstance(pages, np.ndarray)
            or pages.dtype != np.uint8
            or not pages.flags.c_contiguous
        ):
            raise TypeError("pages must be a C-contiguous uint8 numpy array")
        flat = pages.reshape(-1)
        if flat.nbytes % self._page_bytes:
            raise ValueError(f"{flat.nbytes} bytes are not whole pages of {self._page_bytes} bytes")
        return self._order.checked(name, flat.nbytes // self._page_bytes), flat

    def commit(self) -> SnapshotInfo:
        """Finish and publish: checksums, fsync, atomic rename, directory fsync.

        Raises ``ValueError`` when a layer tensor is incomplete and
        :class:`SnapshotIOError` when writing failed; either way nothing is published.
        """
        if self._state != "open":
            raise RuntimeError(f"the snapshot writer is {self._state}")
        try:
            # A write that failed after the last page was handed over surfaces here: the
            # writer aborts (no temporary file stays behind until it is collected).
            self._gate.raise_error()
        except BaseException:
            self.abort()
            raise
        missing = self._order.missing()
        if missing:
            self.abort()
            raise ValueError("cannot commit an incomplete snapshot: " + ", ".join(missing[:4]))
        self._state = "committing"
        try:
            self._target.finish(self._gate.drain)
            self._target.publish()
        except BaseException as error:
            self._state = "open"
            self.abort()
            if isinstance(error, OSError):
                raise io_error("committing the snapshot", self._location.url, error) from error
            raise
        self._state = "committed"
        self._shutdown_threads()
        self.info = self._info()
        return self.info

    def _info(self) -> SnapshotInfo:
        snapshot_files = self._snapshot_files
        if self._target.fallback_reason is None:
            # O_DIRECT was on, but some layer bytes may not have used it.
            self._target.fallback_reason = self._target.partial_direct_reason()
        return SnapshotInfo(
            path=snapshot_files.index_location.url
            if snapshot_files.sharded
            else self._location.url,
            files=tuple(location.url for location in snapshot_files.finals),
            num_bytes=sum(layout.file_size for layout in snapshot_files.layouts),
            kv_bytes=self._num_blocks * self.metadata.geometry.bytes_per_block,
            num_blocks=self._num_blocks,
            direct_io=self._target.direct_bytes > 0,
            fallback_reason=self._target.fallback_reason,
            seconds=time.perf_counter() - self._started,
            trailers=tuple(
                xxhash.xxh3_128_hexdigest(snapshot_files.trailer(shard))
                for shard in range(len(snapshot_files.layouts))
            ),
            mapped=self._target.mapped,
        )

    def abort(self) -> None:
        """Stop, remove the local temporary files, wait for this writer's running work, and
        delete everything else written; safe to call repeatedly.

        The temporary names go first, before the wait: an abort that a second Ctrl-C (or any
        ``KeyboardInterrupt``) reaches while a slow write is still running leaves no file
        behind. Such an interrupt does not cut the wait short (the running write still reads
        the caller's buffer); it is raised again once the cleanup is done. Only a third one
        during the same wait ends it at once (a user insisting; nothing is left on disk).
        """
        if self._state in ("committed", "aborted", "starting"):
            return
        self._state = "aborted"
        self._gate.fail(SnapshotIOError("the writer was aborted", file=self._location.url))
        self._target.unlink_temporaries()
        interrupted = _uninterrupted(lambda: self._shutdown_threads(cancel=True))
        self._target.discard()
        if interrupted is not None:
            raise interrupted

    def __enter__(self) -> SnapshotWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> None:
        if exc_type is not None:
            self.abort()
        elif self._state == "open":
            self.commit()  # aborts by itself when it fails

    def __del__(self) -> None:
        # A writer dropped without commit or abort must not leave temporary files behind.
        if getattr(self, "_state", None) == "open":
            with contextlib.suppress(Exception):
                self.abort()

    # -- data path -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._state != "open":
            raise RuntimeError(f"the snapshot writer is {self._state}")
        self._gate.raise_error()

    def _split(self, first: int, count: int, unit_bytes: int) -> list[tuple[int, int]]:
        """Pieces ``(first_block, num_blocks)`` of about ``unit_bytes``; when pages are not
        4096-multiples, piece sizes stay multiples of 4096 so O_DIRECT keeps alignment."""
        per = max(1, unit_bytes // self._page_bytes)
        step = fmt.DATA_ALIGNMENT // math.gcd(self._page_bytes, fmt.DATA_ALIGNMENT)
        per = -(-per // step) * step
        return [
            (block, min(per, first + count - block)) for block in range(first, first + count, per)
        ]

    def _report(self, nbytes: int) -> None:
        with self._progress_lock:
            self._layer_bytes_done += nbytes
            if self._progress is not None:
                self._progress(self._layer_bytes_done)

    def _hash(
        self, tensor: int, block: int, view: np.ndarray, xxh3: bool = True, blake3: bool = True
    ) -> None:
        """Hash pages ``view`` (blocks ``block`` onwards of layer tensor ``tensor``): their
        xxh3-64 (``xxh3``) and, for a signed snapshot, their BLAKE3 digests (``blake3``)."""
        files = self._snapshot_files
        with traced(self._trace, "hash", view.nbytes):
            if xxh3:
                digests = fmt.block_digests(view, self._page_bytes)
                files.digests[tensor, block : block + len(digests)] = digests
            if blake3 and files.page_digests is not None:
                bound = fmt.page_digests(view, self._page_bytes)
                files.page_digests[tensor, block : block + len(bound)] = bound

    def _hash_batch(
        self, batch: Sequence[tuple[int, int, np.ndarray]], xxh3: bool, blake3: bool
    ) -> None:
        for tensor, block, view in batch:
            self._hash(tensor, block, view, xxh3, blake3)

    def _store_digests(
        self, pieces: Sequence[SlotPiece], digests: np.ndarray, table: np.ndarray | None
    ) -> None:
        """Record digests computed elsewhere into ``table`` (tensors x blocks, of xxh3-64 or
        of BLAKE3 digests), page by page in the order of ``pieces``."""
        assert table is not None
        page = 0
        for tensor, first, flat, _, _ in pieces:
            count = flat.nbytes // self._page_bytes
            table[tensor, first : first + count] = digests[page : page + count]
            page += count
        if page != len(digests):
            raise ValueError(f"{len(digests)} digests for {page} pages")

    def _pages_view(self, flat: np.ndarray, first: int, block: int, count: int) -> np.ndarray:
        """Blocks ``block .. block+count`` of a buffer whose first page is block ``first``."""
        page = self._page_bytes
        return flat[(block - first) * page : (block - first + count) * page]

    def _submit_hash(
        self, work: Callable[..., None], *args: Any
    ) -> concurrent.futures.Future[None]:
        """Queue a hashing task on the shared hashing pool."""
        return self._hash_pool.submit(self._gate.guarded(work, *args))

    def _submit_write(
        self, shard: int, offset: int, view: np.ndarray
    ) -> concurrent.futures.Future[None]:
        """Queue ``view`` for file ``shard`` at ``offset`` on the target. Progress counts the
        bytes once written."""
        future = self._target.write(shard, offset, view)
        nbytes = view.nbytes

        def count_if_written(done: concurrent.futures.Future[None]) -> None:
            if not done.cancelled() and done.exception() is None:
                self._report(nbytes)

        future.add_done_callback(count_if_written)
        return future

    def _shutdown_threads(self, cancel: bool = False) -> None:
        """Wait for this writer's hashing and writes on the shared pools to end (``cancel``:
        cancel those not started first); the pools keep running for other writers."""
        self._hash_pool.shutdown(wait=True, cancel_futures=cancel)
        self._target.shutdown(cancel)


#: ``KeyboardInterrupt``s an abort's wait absorbs before it lets the next one through.
_ABSORBED_INTERRUPTS = 2


def _uninterrupted(work: Callable[[], None]) -> KeyboardInterrupt | None:
    """Run ``work`` to its end even when ``KeyboardInterrupt`` arrives meanwhile (``work`` is
    then run again: it must be a wait that may be repeated); returns the last interrupt. After
    :data:`_ABSORBED_INTERRUPTS` of them the next one propagates: a wait that cannot end must
    not make Ctrl-C powerless."""
    interrupted: KeyboardInterrupt | None = None
    for _ in range(_ABSORBED_INTERRUPTS):
        try:
            work()
            return interrupted
        except KeyboardInterrupt as error:
            interrupted = error
    work()
    return interrupted
