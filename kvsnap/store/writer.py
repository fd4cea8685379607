"""The streaming snapshot writer: hashing beside writing, bounded memory, atomic publish."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from kvsnap import format as fmt
from kvsnap.errors import KVSnapError, SnapshotIOError
from kvsnap.format import SnapshotMetadata, TensorEntry
from kvsnap.format.signing import KeyRing
from kvsnap.store import tuning
from kvsnap.store.completion import Completion
from kvsnap.store.lanes import SerialLane, TaskGroup
from kvsnap.store.local_file import LocalFile
from kvsnap.store.location import INDEX_SUFFIX, io_error, locate, stem_of
from kvsnap.store.pools import shared_executor
from kvsnap.store.slot_writes import SlotWrites
from kvsnap.store.stream_file import StreamFile
from kvsnap.store.tracing import TraceHook, traced
from kvsnap.store.write_local import LocalTarget
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


class SnapshotWriter(SlotWrites, LocalTarget, StreamTarget):
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
            metadata's ``signature`` is set, and each file ends with its signature.
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
        self._keys = keys
        self.metadata = metadata
        self.fallback_reason: str | None = None
        #: Whether the local files' blocks were reserved up front (see ``preallocate``).
        self.preallocated = False
        #: What :meth:`commit` published (also set when the context manager commits).
        self.info: SnapshotInfo | None = None
        self._location = locate(url, storage_options)
        self._plan(metadata, max_shard_bytes)
        self._start_pipeline(hash_threads, progress, max_inflight_bytes)
        try:
            if self._location.is_local:
                self._start_local(direct_io)
            else:
                self._start_stream(direct_io)
        except BaseException as error:
            self._state = "open"
            self.abort()
            if isinstance(error, OSError):
                raise io_error("creating the snapshot", self._location.url, error) from error
            raise
        self._state = "open"

    def _plan(self, metadata: SnapshotMetadata, max_shard_bytes: int | None) -> None:
        """Every file's layout and final location, where each tensor goes, and the bytes known
        before any data (metadata tensors)."""
        self._layouts = fmt.plan_files(metadata, max_shard_bytes)
        self._sharded = len(self._layouts) > 1
        if self._sharded and metadata.part is not None:
            raise ValueError("a part of a parted snapshot is one file: it cannot be sharded")
        if self._sharded:
            stem = stem_of(self._location)
            count = len(self._layouts)
            # New names on every write: the old index's shards stay intact until it is replaced.
            generation = fmt.new_generation()
            self._finals = [
                self._location.sibling(fmt.shard_file_name(stem, index + 1, count, generation))
                for index in range(count)
            ]
        else:
            self._finals = [self._location]
        geometry = metadata.geometry
        self._page_bytes = geometry.canonical_page_size_bytes
        self._names = geometry.tensor_names()
        self._tensor_index = {name: index for index, name in enumerate(self._names)}
        self._placement: dict[str, tuple[int, TensorEntry]] = {}
        for shard, layout in enumerate(self._layouts):
            for entry in layout.entries:
                self._placement[entry.name] = (shard, entry)
        # Metadata tensors are little-endian int64 / uint8 already (see metadata_tensors).
        self._static = {
            name: np.ascontiguousarray(array).view(np.uint8).reshape(-1)
            for name, array in metadata.metadata_tensors().items()
        }

    def _start_pipeline(
        self,
        hash_threads: int | None,
        progress: Callable[[int], None] | None,
        max_inflight_bytes: int | None,
    ) -> None:
        """The digests, counters, in-flight bound and worker threads of the data path."""
        num_blocks = self._num_blocks = self.metadata.num_blocks
        self._digests = np.zeros((len(self._names), num_blocks), dtype=np.uint64)
        self._blocks_written = [0] * len(self._names)
        self._current = 0 if num_blocks else len(self._names)
        self._progress = progress
        self._max_inflight = max_inflight_bytes or tuning.DEFAULT_MAX_INFLIGHT_BYTES
        self._inflight = 0
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._layer_bytes_done = 0
        self._trailer_bytes: dict[int, bytes] = {}
        self._direct_bytes = 0
        self._buffered_bytes = 0
        self._unaligned_buffers = False
        threads = hash_threads or max(2, min(8, os.cpu_count() or 1))
        # Shared pools: a snapshot creates no thread (three per snapshot cost ~7 ms of a small
        # capture); the lane keeps this writer's writes in order, one at a time.
        self._hash_pool = TaskGroup(shared_executor("hash", threads))
        self._writes = SerialLane(shared_executor("write", tuning.WRITE_POOL_THREADS))
        self._hash_futures: list[list[concurrent.futures.Future[None]]] = [
            [] for _ in self._layouts
        ]
        self._local_files: list[LocalFile] = []
        self._stream_files: list[StreamFile | None] = [None] * len(self._layouts)
        self._lane: SerialLane | None = None

    # -- public API ----------------------------------------------------------------------

    def tensor_order(self) -> list[str]:
        """Layer tensor names in the order :meth:`write_pages` must receive them."""
        return list(self._names)

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
        first = self._blocks_written[tensor]
        shard, entry = self._placement[name]
        if count == 0:
            empty: concurrent.futures.Future[None] = concurrent.futures.Future()
            empty.set_result(None)
            return empty
        self._admit(flat.nbytes)
        hash_parts = self._split(first, count, tuning.SUBCHUNK_BYTES)
        write_parts = self._split(first, count, tuning.WRITE_CHUNK_BYTES)
        done = Completion(
            len(hash_parts) + len(write_parts),
            on_done=lambda: self._release(flat.nbytes),
            cancelled=lambda: SnapshotIOError("the writer was aborted", file=self._location.url),
        )
        # The file write does not need the checksums: hashing and writing read the same buffer
        # at once, so the disk starts as soon as the buffer arrives.
        for block, blocks in hash_parts:
            view = self._pages_view(flat, first, block, blocks)
            hashed = self._submit_hash(self._hash, tensor, block, view)
            if self._lane is not None:
                self._hash_futures[shard].append(hashed)
            done.watch(hashed)
        for block, blocks in write_parts:
            view = self._pages_view(flat, first, block, blocks)
            done.watch(self._submit_write(shard, entry.begin + block * self._page_bytes, view))
        self._blocks_written[tensor] += count
        if self._blocks_written[tensor] == self._num_blocks:
            self._current += 1
            if self._lane is not None:
                self._cursor += 1  # past this tensor's item
                if self._current < len(self._names):
                    self._advance(self._names[self._current])
        return done.future

    def _checked_pages(self, name: str, pages: np.ndarray) -> tuple[int, np.ndarray]:
        """``write_pages``' arguments checked: the tensor's index and the pages, flat."""
        self._check_open()
        if name not in self._tensor_index:
            raise ValueError(
                f"{name!r} is not a layer tensor of this snapshot (see tensor_order())"
            )
        tensor = self._tensor_index[name]
        if tensor != self._current:
            expected = (
                self._names[self._current]
                if self._current < len(self._names)
                else "nothing (commit)"
            )
            raise ValueError(
                f"write_pages got {name}, expected {expected}: tensors go in tensor_order()"
            )
        if (
            not isinstance(pages, np.ndarray)
            or pages.dtype != np.uint8
            or not pages.flags.c_contiguous
        ):
            raise TypeError("pages must be a C-contiguous uint8 numpy array")
        flat = pages.reshape(-1)
        if flat.nbytes % self._page_bytes:
            raise ValueError(f"{flat.nbytes} bytes are not whole pages of {self._page_bytes} bytes")
        count = flat.nbytes // self._page_bytes
        first = self._blocks_written[tensor]
        if first + count > self._num_blocks:
            raise ValueError(
                f"{name}: {first} blocks written, {count} more exceed the {self._num_blocks} blocks"
            )
        return tensor, flat

    def commit(self) -> SnapshotInfo:
        """Finish and publish: checksums, fsync, atomic rename, directory fsync.

        Raises ``ValueError`` when a layer tensor is incomplete and
        :class:`SnapshotIOError` when writing failed; either way nothing is published.
        """
        self._check_open()
        missing = [
            f"{name} ({written}/{self._num_blocks} blocks)"
            for name, written in zip(self._names, self._blocks_written, strict=True)
            if written != self._num_blocks
        ]
        if missing:
            self.abort()
            raise ValueError("cannot commit an incomplete snapshot: " + ", ".join(missing[:4]))
        self._state = "committing"
        try:
            if self._lane is not None:
                self._advance(None)
                self._lane.submit(lambda: None).result()
                self._raise_error()
                self._publish_stream()
            else:
                self._finish_local()
                with traced(self._trace, "commit.publish"):
                    self._publish_local()
        except BaseException as error:
            self._state = "open"
            self.abort()
            if isinstance(error, OSError):
                raise io_error("committing the snapshot", self._location.url, error) from error
            raise
        self._state = "committed"
        self._shutdown_threads()
        if self.fallback_reason is None and self._buffered_bytes:
            # O_DIRECT was on, but some layer bytes could not use it.
            self.fallback_reason = self._partial_direct_reason()
        files = tuple(location.url for location in self._finals)
        path = self._location.with_suffix(INDEX_SUFFIX).url if self._sharded else self._location.url
        self.info = SnapshotInfo(
            path=path,
            files=files,
            num_bytes=sum(layout.file_size for layout in self._layouts),
            kv_bytes=self._num_blocks * self.metadata.geometry.bytes_per_block,
            num_blocks=self._num_blocks,
            direct_io=self._direct_bytes > 0,
            fallback_reason=self.fallback_reason,
            seconds=time.perf_counter() - self._started,
            trailers=tuple(
                xxhash.xxh3_128_hexdigest(self._trailer(shard))
                for shard in range(len(self._layouts))
            ),
        )
        return self.info

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
        self._fail(SnapshotIOError("the writer was aborted", file=self._location.url))
        for file in self._local_files:
            file.unlink_temp()
        interrupted = _uninterrupted(lambda: self._shutdown_threads(cancel=True))
        for file in self._local_files:
            file.discard()
        for stream in self._stream_files:
            if stream is not None:
                stream.discard()
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
        self._raise_error()

    def _raise_error(self) -> None:
        error = self._error
        if error is not None:
            if isinstance(error, KVSnapError):
                raise error
            raise io_error("writing the snapshot", self._location.url, error) from error

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    def _admit(self, nbytes: int) -> None:
        with self._cond:
            # One buffer larger than the bound is still admitted when nothing else is in flight.
            while (
                self._inflight
                and self._inflight + nbytes > self._max_inflight
                and self._error is None
            ):
                self._cond.wait()
            self._inflight += nbytes
        self._raise_error()

    def _release(self, nbytes: int) -> None:
        with self._cond:
            self._inflight -= nbytes
            self._cond.notify_all()

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
        with self._cond:
            self._layer_bytes_done += nbytes
            if self._progress is not None:
                self._progress(self._layer_bytes_done)

    def _hash(self, tensor: int, block: int, view: np.ndarray) -> None:
        with traced(self._trace, "hash", view.nbytes):
            digests = fmt.block_digests(view, self._page_bytes)
        self._digests[tensor, block : block + len(digests)] = digests

    def _pages_view(self, flat: np.ndarray, first: int, block: int, count: int) -> np.ndarray:
        """Blocks ``block .. block+count`` of a buffer whose first page is block ``first``."""
        page = self._page_bytes
        return flat[(block - first) * page : (block - first + count) * page]

    def _guarded(self, work: Callable[..., None], *args: Any) -> Callable[[], None]:
        """``work(*args)`` for a worker thread: skipped after an earlier failure, and its own
        failure stops the writer."""

        def run() -> None:
            if self._error is not None:
                raise SnapshotIOError(
                    "the writer stopped after an earlier error", file=self._location.url
                )
            try:
                work(*args)
            except BaseException as error:
                self._fail(error)
                raise

        return run

    def _submit_write(
        self, shard: int, offset: int, view: np.ndarray
    ) -> concurrent.futures.Future[None]:
        """Queue ``view`` for the file at ``offset``: on the local write thread(s), or in order on
        the stream lane. Progress counts the bytes once written."""
        if self._lane is None:
            future = self._writes.submit(
                self._guarded(self._write_local_data, self._local_files[shard], offset, view)
            )
        else:
            future = self._lane.submit(self._guarded(self._stream_write, shard, offset, view))
        nbytes = view.nbytes
        future.add_done_callback(lambda f: f.cancelled() or f.exception() or self._report(nbytes))
        return future

    # -- shared --------------------------------------------------------------------------

    def _trailer(self, shard: int) -> bytes:
        # Computed once all data is written (commit), then reused by the index and the info.
        cached = self._trailer_bytes.get(shard)
        if cached is not None:
            return cached
        layout = self._layouts[shard]
        digests = [fmt.digest128(layout.header)]
        for entry in layout.checksummed():
            if fmt.is_layer_tensor(entry.name):
                digests.append(
                    fmt.layer_tensor_digest(self._digests[self._tensor_index[entry.name]])
                )
            elif entry.name == fmt.BLOCK_CHECKSUMS_TENSOR:
                digests.append(fmt.digest128(self._digests.astype("<u8").tobytes()))
            else:
                static = self._static_bytes(entry)
                assert static is not None
                digests.append(fmt.digest128(static))
        self._trailer_bytes[shard] = fmt.encode_trailer(digests)
        return self._trailer_bytes[shard]

    def _signature(self, shard: int) -> bytes:
        """File ``shard``'s signature over its header and trailer (a signing writer only)."""
        assert self._keys is not None
        return self._keys.sign(self._layouts[shard].header, self._trailer(shard))

    def _index_bytes(self) -> bytes:
        trailers = [self._trailer(shard) for shard in range(len(self._layouts))]
        return fmt.encode_index(
            self.metadata, [f.name for f in self._finals], self._layouts, trailers
        )

    def _shutdown_threads(self, cancel: bool = False) -> None:
        """Wait for this writer's hashing and writes on the shared pools to end (``cancel``:
        cancel those not started first); the pools keep running for other writers."""
        self._hash_pool.shutdown(wait=True, cancel_futures=cancel)
        self._writes.shutdown(wait=True, cancel_futures=cancel)
        if self._lane is not None:
            self._lane.shutdown(wait=True, cancel_futures=cancel)


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
