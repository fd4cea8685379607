"""Streaming snapshot writer and reader over local files and fsspec URLs, with atomic publish.

:class:`SnapshotWriter` takes KV pages in caller-owned buffers (a pinned staging slot, usually)
and moves them to the file while the caller fills the next buffer: every
:meth:`~SnapshotWriter.write_pages` call is hashed (xxh3-64 per page, in sub-chunks on the hash
threads; xxhash releases the GIL) and, at the same time, written at its final offset: ``pwrite``
of pieces up to 64 MiB, front to back from one write thread (on the measured disk one
sequential stream beat parallel writers), into blocks reserved when the file was created. The
returned future completes when the buffer may be reused. The bytes in flight are bounded
(``max_inflight_bytes``), so host memory stays flat whatever the snapshot size.

The file layout is fixed before the first byte (:func:`kvsnap.format.plan_files`), so the
header is written first and never rewritten: the data-dependent checksums live in the last two
tensors. That makes a snapshot a pure front-to-back stream, which is what object stores need.

Local files are written to a temporary name in the target directory, fsynced, renamed over the
target and the directory fsynced: a crash leaves the old file or the new complete one. Layer
data goes through ``O_DIRECT`` where the filesystem accepts it and buffers and offsets are
4096-aligned (``fallback_reason`` says why not, otherwise). fsspec URLs (``memory://``,
``s3://``, ...) are written front to back through one ordered lane; object stores publish
atomically on their own (S3's multipart upload appears only when completed), other
filesystems get a temporary name and a move.

:class:`SnapshotReader` validates the whole header before allocating anything, reads only the
byte ranges of the blocks asked for (coalescing consecutive blocks), and checks every block
against its checksum as it reads; :meth:`SnapshotReader.read_pages_async` queues a read on the
reader's threads, so a caller keeps the disk busy while it consumes the previous buffer.

An optional :data:`TraceHook` receives a span for every hash, write, read and verification and
for the commit's phases; without one the pipeline only pays a ``None`` check per piece.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno
import math
import mmap
import os
import posixpath
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from kvsnap import format as fmt
from kvsnap.errors import (
    KVSnapError,
    NotASnapshotError,
    SnapshotCorruptError,
    SnapshotIOError,
)
from kvsnap.format import Problem, SnapshotMetadata, TensorEntry
from kvsnap.layout import DTYPES

TraceHook = Callable[[str, float, float, int], None]
"""``trace(kind, started, finished, nbytes)``: one span of pipeline work (``time.perf_counter``
seconds), called from worker threads; it must be cheap and thread-safe (``list.append`` is)."""

#: Bytes of caller buffers the writer holds at once; ``write_pages`` waits beyond this.
DEFAULT_MAX_INFLIGHT_BYTES = 256 << 20
#: Unit of hashing, and of the reader's threads (rounded to whole pages).
SUBCHUNK_BYTES = 8 << 20
#: Largest single write of layer data to a local file, as large as the raw-disk benchmark's:
#: where the filesystem serializes writes to one file, the disk drains its queue once per write.
WRITE_CHUNK_BYTES = 64 << 20
#: Writes to one local file in flight at once. One: on the H200 machine's disk a single stream of
#: in-order 64 MiB O_DIRECT writes reached 0.89-0.92 of the raw write, 2 threads 0.83 and 4
#: threads 0.77-0.81 (docs/benchmarks.md); hashing runs on its own threads alongside, so the
#: writer still has the next buffer ready when a write returns.
LOCAL_WRITE_THREADS = 1
#: Part size of streaming uploads to object stores (S3 needs at least 5 MiB).
STREAM_BLOCK_BYTES = 16 << 20
#: Blocks a verify reports per tensor before summarizing the rest.
MAX_PROBLEMS_PER_TENSOR = 16
#: fsspec protocols whose writes publish atomically at close, so no temporary name is needed.
OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "adl"})
INDEX_SUFFIX = ".index.json"
SAFETENSORS_SUFFIX = ".safetensors"

_ALIGN = fmt.DATA_ALIGNMENT
_TORCH_DTYPES: dict[str, torch.dtype] = {
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "U64": torch.uint64,
}
assert set(DTYPES.values()) <= set(_TORCH_DTYPES.values())


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


@contextlib.contextmanager
def traced(trace: TraceHook | None, kind: str, nbytes: int = 0) -> Iterator[None]:
    """Report the time the ``with`` body takes to ``trace`` as a ``kind`` span (when tracing)."""
    if trace is None:
        yield
        return
    started = time.perf_counter()
    try:
        yield
    finally:
        trace(kind, started, time.perf_counter(), nbytes)


class _Completion:
    """A future for work split over several futures: it completes once every watched future is
    done (so no thread touches the caller's buffer any more), with ``None`` or the first failure.

    The first failure cancels the watched futures that have not started; ``on_done`` runs before
    the future completes; ``cancelled`` makes the error a cancelled piece reports.
    """

    def __init__(
        self,
        count: int,
        *,
        on_done: Callable[[], None] | None = None,
        cancelled: Callable[[], BaseException],
    ) -> None:
        self.future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._remaining = count
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._on_done = on_done
        self._cancelled = cancelled
        self._watched: list[concurrent.futures.Future[Any]] = []
        if count == 0:
            self._finish()

    def watch(self, future: concurrent.futures.Future[Any]) -> None:
        self._watched.append(future)
        future.add_done_callback(self._one_done)

    def _one_done(self, future: concurrent.futures.Future[Any]) -> None:
        error = self._cancelled() if future.cancelled() else future.exception()
        with self._lock:
            self._remaining -= 1
            first_failure = error is not None and self._error is None
            if first_failure:
                self._error = error
            last = self._remaining == 0
        if first_failure:
            for other in list(self._watched):
                other.cancel()
        if last:
            self._finish()

    def _finish(self) -> None:
        # The watched futures call back into this object: drop them, or the cycle would keep
        # the caller's buffer (a whole staging pool, through its done callbacks) alive until
        # the garbage collector runs.
        self._watched = []
        if self._on_done is not None:
            self._on_done()
            self._on_done = None
        if self._error is not None:
            self.future.set_exception(self._error)
        else:
            self.future.set_result(None)


# --------------------------------------------------------------------------------------------
# Locations


@dataclass(frozen=True)
class _Location:
    """A local path (``fs is None``) or a path on an fsspec filesystem."""

    url: str
    path: str
    fs: Any = None

    @property
    def is_local(self) -> bool:
        return self.fs is None

    @property
    def object_store(self) -> bool:
        protocols = self.fs.protocol if self.fs is not None else ()
        protocols = (protocols,) if isinstance(protocols, str) else tuple(protocols)
        return any(protocol in OBJECT_STORE_PROTOCOLS for protocol in protocols)

    def sibling(self, name: str) -> _Location:
        """The location of ``name`` in the same directory."""
        if self.fs is None:
            path = os.path.join(os.path.dirname(self.path), name)
            return _Location(path, path)
        path = posixpath.join(posixpath.dirname(self.path), name)
        return _Location(self.fs.unstrip_protocol(path), path, self.fs)

    def with_suffix(self, suffix: str) -> _Location:
        if self.fs is None:
            return _Location(self.url + suffix, self.path + suffix)
        return _Location(self.url + suffix, self.path + suffix, self.fs)

    @property
    def name(self) -> str:
        return os.path.basename(self.path) if self.fs is None else posixpath.basename(self.path)

    def exists(self) -> bool:
        try:
            return os.path.exists(self.path) if self.fs is None else bool(self.fs.exists(self.path))
        except OSError as error:
            raise SnapshotIOError(
                f"cannot check whether it exists ({error})", file=self.url
            ) from error

    def remove(self) -> None:
        """Delete, ignoring a missing file."""
        with contextlib.suppress(FileNotFoundError):
            if self.fs is None:
                os.unlink(self.path)
            elif self.fs.exists(self.path):
                self.fs.rm(self.path)


def _locate(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None) -> _Location:
    text = os.fspath(url)
    if "://" not in text:
        return _Location(text, os.path.abspath(text))
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    try:
        fs, path = fsspec.core.url_to_fs(text, **dict(storage_options or {}))
    except (ImportError, ValueError) as error:
        raise SnapshotIOError(f"cannot open this URL ({error})", file=text) from error
    if isinstance(fs, LocalFileSystem):
        return _Location(text, os.path.abspath(path))
    return _Location(text, path, fs)


def _stem(location: _Location) -> str:
    name = location.name
    return name[: -len(SAFETENSORS_SUFFIX)] if name.endswith(SAFETENSORS_SUFFIX) else name


def _io_error(action: str, location: str, error: BaseException) -> SnapshotIOError:
    return SnapshotIOError(f"{action} failed: {error}", file=location)


# --------------------------------------------------------------------------------------------
# Output files


def _open_direct(path: str) -> int:
    """A second, O_DIRECT descriptor on ``path`` (tests replace this to simulate refusal)."""
    return os.open(path, os.O_WRONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.EIO, "pwrite wrote nothing")
        view = view[written:]
        offset += written


def _aligned_copy(data: bytes) -> mmap.mmap:
    """``data`` in page-aligned anonymous memory (O_DIRECT needs aligned buffers)."""
    buffer = mmap.mmap(-1, max(len(data), 1))
    buffer[: len(data)] = data
    return buffer


def _libc_fallocate() -> Callable[..., int] | None:
    try:
        function = ctypes.CDLL(None, use_errno=True).fallocate
    except (AttributeError, OSError):
        return None  # not glibc/Linux
    function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    function.restype = ctypes.c_int
    return function


_FALLOCATE = _libc_fallocate()
#: fallocate errors that mean "not for this file": the snapshot is then written without it.
_NO_FALLOCATE = frozenset({errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EPERM})


def _preallocate(fd: int, size: int) -> bool:
    """Reserve ``size`` bytes of disk blocks for ``fd`` (and set its size) before any data.

    Writes into reserved blocks do not allocate as they go (on the H200 machine's ext4 one
    O_DIRECT stream reached 0.89-0.92 of the raw write with the reservation, 0.87 without); a
    full disk also fails here, before any data moves. Not ``posix_fallocate``: glibc emulates
    it by writing every block where the filesystem lacks fallocate. Returns whether the blocks
    were reserved.
    """
    if _FALLOCATE is None or size <= 0:
        return False
    if _FALLOCATE(fd, 0, 0, size) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NO_FALLOCATE:
        return False
    raise OSError(code, os.strerror(code))


class _LocalFile:
    """One output file written through a temporary name next to its final path."""

    def __init__(self, final: _Location) -> None:
        self.final = final
        directory = os.path.dirname(final.path)
        self.temp = os.path.join(
            directory, f".{final.name}.kvsnap-tmp-{os.getpid()}-{secrets.token_hex(4)}"
        )
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        self.fd: int | None = os.open(self.temp, flags, 0o666)
        self.direct_fd: int | None = None

    def enable_direct(self, header: bytes) -> str | None:
        """Write ``header`` through O_DIRECT as a probe; keep the O_DIRECT descriptor when it works.

        Returns ``None`` on success, else why O_DIRECT is unavailable (the header is then
        written through the page cache).
        """
        if not hasattr(os, "O_DIRECT"):
            return "this platform has no O_DIRECT"
        try:
            self.direct_fd = _open_direct(self.temp)
        except OSError as error:
            return f"the filesystem refused O_DIRECT ({error.strerror or error})"
        buffer = _aligned_copy(header)
        try:
            _pwrite_all(self.direct_fd, memoryview(buffer)[: len(header)], 0)
            return None
        except OSError as error:
            os.close(self.direct_fd)
            self.direct_fd = None
            return f"the filesystem refused an O_DIRECT write ({error.strerror or error})"
        finally:
            buffer.close()

    def write(self, offset: int, view: memoryview) -> None:
        assert self.fd is not None
        _pwrite_all(self.fd, view, offset)

    def write_direct(self, offset: int, view: memoryview) -> None:
        assert self.direct_fd is not None
        _pwrite_all(self.direct_fd, view, offset)

    def sync_and_close(self) -> None:
        """fsync (flushes the page-cache writes and the file's metadata), then close."""
        assert self.fd is not None
        os.fsync(self.fd)
        self._close()

    def _close(self) -> None:
        for fd in (self.direct_fd, self.fd):
            if fd is not None:
                os.close(fd)
        self.fd = self.direct_fd = None

    def publish(self) -> None:
        os.replace(self.temp, self.final.path)

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            self._close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.temp)


class _StreamFile:
    """One output file written front to back through fsspec (``wb``), from one thread."""

    def __init__(self, final: _Location) -> None:
        self.final = final
        # Object stores make an upload visible only when it completes: write in place.
        # Elsewhere (memory://, sftp, ...) a file is visible while written: use a temporary name.
        if final.object_store:
            self.target = final
            self.handle = final.fs.open(final.path, "wb", block_size=STREAM_BLOCK_BYTES)
        else:
            self.target = final.sibling(
                f".{final.name}.kvsnap-tmp-{os.getpid()}-{secrets.token_hex(4)}"
            )
            self.handle = final.fs.open(self.target.path, "wb")
        self.position = 0
        self.closed = False

    def write(self, offset: int, view: memoryview) -> None:
        if offset != self.position:
            raise RuntimeError(f"stream write at {offset}, the stream is at {self.position}")
        self.handle.write(view)
        self.position += len(view)

    def close(self) -> None:
        self.handle.close()
        self.closed = True

    def publish(self) -> None:
        if self.target is not self.final:
            self.final.fs.mv(self.target.path, self.final.path)

    def discard(self) -> None:
        if not self.closed:
            # discard() aborts a multipart upload; marking the file closed keeps its
            # finalizer from completing the upload anyway.
            with contextlib.suppress(Exception):
                discard = getattr(self.handle, "discard", None)
                if discard is not None:
                    discard()
            with contextlib.suppress(Exception):
                self.handle.closed = True
            self.closed = True
        if self.target is not self.final:
            with contextlib.suppress(Exception):
                self.target.remove()


def _fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------
# Writer


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
        hash_threads: worker threads hashing (default: CPUs, 2 to 8); local files are
            written by ``LOCAL_WRITE_THREADS`` more, fsspec URLs by one ordered lane.
        max_shard_bytes: largest tensor bytes per shard (a larger single tensor gets a shard
            of its own); ``None`` writes one file.
        progress: called with the layer bytes written so far, from worker threads, serialized,
            with non-decreasing values.
        max_inflight_bytes: bytes of caller buffers held at once (default 256 MiB).
        storage_options: passed to fsspec for URLs (e.g. an S3 ``endpoint_url``).
        trace: receives ``hash`` and ``write`` spans per piece and ``commit.*`` spans.
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
    ) -> None:
        self._state = "starting"
        self._trace = trace
        self._started = time.perf_counter()
        problems = metadata.problems()
        if problems:
            raise ValueError("cannot write this snapshot metadata: " + "; ".join(problems[:5]))
        self.metadata = metadata
        self.fallback_reason: str | None = None
        #: Whether the local files' blocks were reserved up front (see ``_preallocate``).
        self.preallocated = False
        #: What :meth:`commit` published (also set when the context manager commits).
        self.info: SnapshotInfo | None = None
        self._location = _locate(url, storage_options)
        self._layouts = fmt.plan_files(metadata, max_shard_bytes)
        self._sharded = len(self._layouts) > 1
        if self._sharded:
            stem = _stem(self._location)
            count = len(self._layouts)
            self._finals = [
                self._location.sibling(fmt.shard_file_name(stem, index + 1, count))
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
        num_blocks = self._num_blocks = metadata.num_blocks
        self._digests = np.zeros((len(self._names), num_blocks), dtype=np.uint64)
        self._blocks_written = [0] * len(self._names)
        self._current = 0 if num_blocks else len(self._names)
        self._progress = progress
        self._max_inflight = max_inflight_bytes or DEFAULT_MAX_INFLIGHT_BYTES
        self._inflight = 0
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._layer_bytes_done = 0
        self._direct_bytes = 0
        self._buffered_bytes = 0
        self._unaligned_buffers = False
        threads = hash_threads or max(2, min(8, os.cpu_count() or 1))
        self._hash_pool = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix="kvsnap-hash"
        )
        self._writes = concurrent.futures.ThreadPoolExecutor(
            LOCAL_WRITE_THREADS, thread_name_prefix="kvsnap-write"
        )
        self._hash_futures: list[list[concurrent.futures.Future[None]]] = [
            [] for _ in self._layouts
        ]
        self._local_files: list[_LocalFile] = []
        self._stream_files: list[_StreamFile | None] = [None] * len(self._layouts)
        self._lane: concurrent.futures.ThreadPoolExecutor | None = None
        try:
            if self._location.is_local:
                self._start_local(direct_io)
            else:
                if direct_io:
                    raise SnapshotIOError("O_DIRECT needs a local file", file=self._location.url)
                self.fallback_reason = f"not a local file ({self._location.url})"
                self._lane = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="kvsnap-stream"
                )
                self._items = self._stream_items()
                self._cursor = 0
                self._advance(self._names[0] if self._current == 0 else None)
        except BaseException as error:
            self._state = "open"
            self.abort()
            if isinstance(error, OSError):
                raise _io_error("creating the snapshot", self._location.url, error) from error
            raise
        self._state = "open"

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
        shard, entry = self._placement[name]
        if count == 0:
            empty: concurrent.futures.Future[None] = concurrent.futures.Future()
            empty.set_result(None)
            return empty
        self._admit(flat.nbytes)
        hash_parts = self._split(first, count, SUBCHUNK_BYTES)
        write_parts = self._split(first, count, WRITE_CHUNK_BYTES)
        done = _Completion(
            len(hash_parts) + len(write_parts),
            on_done=lambda: self._release(flat.nbytes),
            cancelled=lambda: SnapshotIOError("the writer was aborted", file=self._location.url),
        )
        # The file write does not need the checksums: hashing and writing read the same buffer
        # at once, so the disk starts as soon as the buffer arrives.
        for block, blocks in hash_parts:
            view = self._pages_view(flat, first, block, blocks)
            hashed = self._hash_pool.submit(self._guarded(self._hash, tensor, block, view))
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
                raise _io_error("committing the snapshot", self._location.url, error) from error
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
        )
        return self.info

    def abort(self) -> None:
        """Stop, wait for the workers, and delete everything written; safe to call repeatedly."""
        if self._state in ("committed", "aborted", "starting"):
            return
        self._state = "aborted"
        self._fail(SnapshotIOError("the writer was aborted", file=self._location.url))
        self._shutdown_threads(cancel=True)
        for file in self._local_files:
            file.discard()
        for stream in self._stream_files:
            if stream is not None:
                stream.discard()

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
            raise _io_error("writing the snapshot", self._location.url, error) from error

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
        step = _ALIGN // math.gcd(self._page_bytes, _ALIGN)
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

    def _write_local_data(self, file: _LocalFile, offset: int, view: np.ndarray) -> None:
        with traced(self._trace, "write", view.nbytes):
            self._write_local_parts(file, offset, view)

    def _write_local_parts(self, file: _LocalFile, offset: int, view: np.ndarray) -> None:
        """The aligned body through O_DIRECT, an unaligned head or tail through the page cache."""
        data = memoryview(view)
        if file.direct_fd is not None:
            address = view.ctypes.data
            head = (-offset) % _ALIGN
            if (address + head) % _ALIGN == 0:
                body = (len(data) - head) // _ALIGN * _ALIGN if len(data) > head else 0
                if body:
                    if head:
                        file.write(offset, data[:head])
                    file.write_direct(offset + head, data[head : head + body])
                    if head + body < len(data):
                        file.write(offset + head + body, data[head + body :])
                    with self._cond:
                        self._direct_bytes += body
                        self._buffered_bytes += len(data) - body
                    return
            else:
                self._unaligned_buffers = True
        file.write(offset, data)
        with self._cond:
            self._buffered_bytes += len(data)

    def _partial_direct_reason(self) -> str:
        total = self._direct_bytes + self._buffered_bytes
        why = []
        if self._page_bytes % _ALIGN:
            why.append(f"pages of {self._page_bytes} bytes are not multiples of {_ALIGN}")
        if self._unaligned_buffers:
            why.append(f"some caller buffers were not {_ALIGN}-aligned")
        cause = "; ".join(why) or "unaligned boundaries"
        return f"{self._buffered_bytes} of {total} KV bytes went through the page cache ({cause})"

    # -- local files ---------------------------------------------------------------------

    def _start_local(self, direct_io: bool | None) -> None:
        directory = os.path.dirname(self._location.path)
        needed = sum(layout.file_size for layout in self._layouts)
        try:
            stats = os.statvfs(directory)
        except OSError as error:
            raise _io_error("opening the target directory", directory, error) from error
        free = stats.f_bavail * stats.f_frsize
        if free < needed:
            raise SnapshotIOError(
                f"the snapshot needs {needed} bytes, {directory} has {free} free",
                file=self._location.url,
            )
        reserved = []
        for final, layout in zip(self._finals, self._layouts, strict=True):
            file = _LocalFile(final)
            self._local_files.append(file)
            assert file.fd is not None
            reserved.append(_preallocate(file.fd, layout.file_size))
        self.preallocated = all(reserved)
        for index, (file, layout) in enumerate(zip(self._local_files, self._layouts, strict=True)):
            if direct_io is False:
                self.fallback_reason = "direct_io=False"
                file.write(0, memoryview(layout.header))
            elif index == 0 or self._local_files[0].direct_fd is not None:
                reason = file.enable_direct(layout.header)
                if reason is not None:
                    if direct_io:
                        raise SnapshotIOError(
                            f"O_DIRECT was required but {reason}", file=self._location.url
                        )
                    self.fallback_reason = reason
                    file.write(0, memoryview(layout.header))
            else:
                file.write(0, memoryview(layout.header))
            for entry in layout.entries:
                static = self._static_bytes(entry)
                if static is not None:
                    file.write(entry.begin, memoryview(static))

    def _static_bytes(self, entry: TensorEntry) -> np.ndarray | bytes | None:
        """The bytes of an entry known before any data: metadata tensors and padding."""
        if entry.name.startswith(fmt.PADDING_PREFIX):
            return bytes(entry.nbytes)
        return self._static.get(entry.name)

    def _finish_local(self) -> None:
        with traced(self._trace, "commit.drain"):
            with self._cond:
                while self._inflight and self._error is None:
                    self._cond.wait()
            self._shutdown_threads()
        self._raise_error()
        with traced(self._trace, "commit.checksums"):
            for shard, (file, layout) in enumerate(
                zip(self._local_files, self._layouts, strict=True)
            ):
                for entry in layout.entries:
                    if entry.name == fmt.BLOCK_CHECKSUMS_TENSOR:
                        file.write(entry.begin, memoryview(self._digests.astype("<u8").tobytes()))
                trailer = layout.by_name[fmt.CHECKSUMS_TENSOR]
                file.write(trailer.begin, memoryview(self._trailer(shard)))
        with traced(self._trace, "commit.fsync"):
            for file in self._local_files:
                file.sync_and_close()

    def _publish_local(self) -> None:
        stale = self._stale_files()
        for file in self._local_files:
            file.publish()
        if self._sharded:
            index = self._location.with_suffix(INDEX_SUFFIX)
            index_file = _LocalFile(index)
            self._local_files.append(index_file)
            index_file.write(0, memoryview(self._index_bytes()))
            index_file.sync_and_close()
            index_file.publish()
        _fsync_directory(os.path.dirname(self._location.path))
        self._local_files = []
        self._remove_stale(stale)

    # -- streams (fsspec) ------------------------------------------------------------------

    def _stream_items(self) -> list[tuple[str, int, TensorEntry | None]]:
        """Everything to write, in file order: (kind, shard, entry); kind is one of header,
        static, layer, blocksums, trailer."""
        items: list[tuple[str, int, TensorEntry | None]] = []
        for shard, layout in enumerate(self._layouts):
            items.append(("header", shard, None))
            for entry in layout.entries:
                if fmt.is_layer_tensor(entry.name):
                    kind = "layer"
                elif entry.name == fmt.BLOCK_CHECKSUMS_TENSOR:
                    kind = "blocksums"
                elif entry.name == fmt.CHECKSUMS_TENSOR:
                    kind = "trailer"
                else:
                    kind = "static"
                items.append((kind, shard, entry))
        return items

    def _advance(self, stop_at: str | None) -> None:
        """Queue, in order, everything before layer tensor ``stop_at`` (``None``: to the end)."""
        assert self._lane is not None
        while self._cursor < len(self._items):
            kind, shard, entry = self._items[self._cursor]
            if kind == "layer":
                assert entry is not None
                if entry.name == stop_at:
                    return
                if entry.nbytes:
                    raise RuntimeError(f"internal error: {entry.name} was never written")
                self._cursor += 1  # an empty tensor (no blocks) has nothing to write
                continue
            self._lane.submit(self._guarded_lane(kind, shard, entry))
            self._cursor += 1

    def _guarded_lane(self, kind: str, shard: int, entry: TensorEntry | None) -> Callable[[], None]:
        def run() -> None:
            if self._error is not None:
                return
            try:
                self._lane_item(kind, shard, entry)
            except BaseException as error:
                self._fail(error)

        return run

    def _lane_item(self, kind: str, shard: int, entry: TensorEntry | None) -> None:
        layout = self._layouts[shard]
        if kind == "header":
            self._stream_files[shard] = _StreamFile(self._finals[shard])
            self._stream_write(shard, 0, memoryview(layout.header))
            return
        assert entry is not None
        if kind == "static":
            static = self._static_bytes(entry)
            assert static is not None
            self._stream_write(shard, entry.begin, memoryview(static))
        elif kind == "blocksums":
            concurrent.futures.wait([f for futures in self._hash_futures for f in futures])
            self._raise_error()
            self._stream_write(
                shard, entry.begin, memoryview(self._digests.astype("<u8").tobytes())
            )
        elif kind == "trailer":
            concurrent.futures.wait(self._hash_futures[shard])
            self._raise_error()
            self._stream_write(shard, entry.begin, memoryview(self._trailer(shard)))
            stream = self._stream_files[shard]
            assert stream is not None
            stream.close()

    def _stream_write(self, shard: int, offset: int, view: memoryview | np.ndarray) -> None:
        stream = self._stream_files[shard]
        assert stream is not None
        with traced(self._trace, "write", len(memoryview(view))):
            stream.write(offset, memoryview(view))

    def _publish_stream(self) -> None:
        stale = self._stale_files()
        for stream in self._stream_files:
            assert stream is not None
            stream.publish()
        if self._sharded:
            index = self._location.with_suffix(INDEX_SUFFIX)
            data = self._index_bytes()
            if index.object_store:
                index.fs.pipe_file(index.path, data)
            else:
                temp = index.sibling(f".{index.name}.kvsnap-tmp-{secrets.token_hex(4)}")
                temp.fs.pipe_file(temp.path, data)
                temp.fs.mv(temp.path, index.path)
        self._stream_files = [None] * len(self._layouts)
        self._remove_stale(stale)

    # -- shared --------------------------------------------------------------------------

    def _trailer(self, shard: int) -> bytes:
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
        return fmt.encode_trailer(digests)

    def _index_bytes(self) -> bytes:
        trailers = [self._trailer(shard) for shard in range(len(self._layouts))]
        return fmt.encode_index(
            self.metadata, [f.name for f in self._finals], self._layouts, trailers
        )

    def _stale_files(self) -> list[_Location]:
        """Files of a previous snapshot at this URL in the other form (single vs sharded), or
        shards of a previous sharded snapshot that the new one does not overwrite."""
        stale: list[_Location] = []
        index = self._location.with_suffix(INDEX_SUFFIX)
        new_names = {final.name for final in self._finals}
        # An unreadable old index is left alone: nothing it names is known to be ours.
        with contextlib.suppress(KVSnapError):
            if index.exists():
                previous = _read_small(index, fmt.MAX_INDEX_BYTES)
                names = fmt.decode_index(previous, file=index.url).files
                if not self._sharded:
                    stale.append(index)  # first: readers stop seeing the old shards at once
                stale += [index.sibling(name) for name in names if name not in new_names]
        if self._sharded and self._location.exists():
            stale.append(self._location)
        return stale

    def _remove_stale(self, stale: Sequence[_Location]) -> None:
        for location in stale:
            with contextlib.suppress(OSError):
                location.remove()

    def _shutdown_threads(self, cancel: bool = False) -> None:
        self._hash_pool.shutdown(wait=True, cancel_futures=cancel)
        self._writes.shutdown(wait=True, cancel_futures=cancel)
        if self._lane is not None:
            self._lane.shutdown(wait=True, cancel_futures=cancel)


# --------------------------------------------------------------------------------------------
# Reader


def _read_small(location: _Location, limit: int) -> bytes:
    """A whole small file (an index), refusing files larger than ``limit``."""
    try:
        if location.is_local:
            size = os.path.getsize(location.path)
            if size > limit:
                raise NotASnapshotError(
                    f"{size} bytes is too large for an index", file=location.url
                )
            with open(location.path, "rb") as handle:
                return handle.read()
        size = location.fs.size(location.path)
        if size is not None and size > limit:
            raise NotASnapshotError(f"{size} bytes is too large for an index", file=location.url)
        return bytes(location.fs.cat_file(location.path))
    except FileNotFoundError as error:
        raise SnapshotIOError("no such file", file=location.url) from error
    except OSError as error:
        raise _io_error("reading", location.url, error) from error


def _open_direct_reader(path: str) -> int | None:
    """A second, O_DIRECT descriptor for aligned reads, or ``None`` where the filesystem refuses."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_RDONLY | flag | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None


def _check_blocks(
    view: np.ndarray, page: int, row: np.ndarray, block: int, url: str, name: str
) -> None:
    """Raise :class:`SnapshotCorruptError` naming the first page of ``view`` (block ``block``
    onwards) whose xxh3-64 differs from the stored ``row``."""
    got = fmt.block_digests(view, page)
    bad = np.flatnonzero(got != row[block : block + len(got)])
    if len(bad):
        first = int(bad[0])
        raise SnapshotCorruptError(
            f"xxh3-64 {int(got[first]):016x} does not match the stored "
            f"{int(row[block + first]):016x}",
            file=url,
            tensor=name,
            block=block + first,
        )


class _Source:
    """Random-access reads of one file: ``pread`` for local files, seek+read for fsspec."""

    def __init__(self, location: _Location) -> None:
        self.location = location
        self.url = location.url
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._direct_fd: int | None = None
        self._handle: Any = None
        try:
            if location.is_local:
                self._fd = os.open(location.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                status = os.fstat(self._fd)
                if not stat.S_ISREG(status.st_mode):
                    os.close(self._fd)
                    self._fd = None
                    raise NotASnapshotError("not a regular file", file=self.url)
                self.size = status.st_size
                self._direct_fd = _open_direct_reader(location.path)
            else:
                self.size = int(location.fs.size(location.path))
                self._handle = location.fs.open(location.path, "rb", cache_type="none")
        except FileNotFoundError as error:
            raise SnapshotIOError("no such file", file=self.url) from error
        except IsADirectoryError as error:
            raise NotASnapshotError("is a directory", file=self.url) from error
        except OSError as error:
            raise _io_error("opening", self.url, error) from error

    @property
    def concurrent(self) -> bool:
        """Whether several threads may read at once (``pread`` on a local descriptor)."""
        return self._fd is not None

    def read_into(self, offset: int, out: memoryview, *, tensor: str | None = None) -> None:
        """Fill ``out`` from ``offset``; a short file is a :class:`SnapshotCorruptError`."""
        wanted = len(out)
        done = 0
        try:
            if self._fd is not None:
                address = np.frombuffer(out, dtype=np.uint8).ctypes.data if wanted else 0
                while done < wanted:
                    # Aligned ranges bypass the page cache (O_DIRECT): on the disks measured
                    # that reads up to twice as fast and leaves the cache to the engine.
                    direct = self._direct_fd is not None and not (
                        (offset + done) % _ALIGN
                        or (wanted - done) % _ALIGN
                        or (address + done) % _ALIGN
                    )
                    descriptor = self._direct_fd if direct else self._fd
                    count = os.preadv(descriptor, [out[done:]], offset + done)
                    if count <= 0:
                        break
                    done += count
            else:
                with self._lock:
                    self._handle.seek(offset)
                    while done < wanted:
                        count = self._handle.readinto(out[done:])
                        if not count:
                            break
                        done += count
        except OSError as error:
            raise _io_error("reading", self.url, error) from error
        if done < wanted:
            raise SnapshotCorruptError(
                f"file ended at byte {offset + done}, {wanted - done} bytes short (truncated?)",
                file=self.url,
                tensor=tensor,
            )

    def read(self, offset: int, size: int, *, tensor: str | None = None) -> bytes:
        buffer = bytearray(size)
        self.read_into(offset, memoryview(buffer), tensor=tensor)
        return bytes(buffer)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._direct_fd is not None:
            os.close(self._direct_fd)
            self._direct_fd = None
        if self._handle is not None:
            with contextlib.suppress(Exception):
                self._handle.close()
            self._handle = None


@dataclass
class _OpenFile:
    source: _Source
    layout: fmt.FileLayout
    trailer: list[bytes] | None = None
    row_of: dict[str, int] | None = None


class SnapshotReader:
    """Reads a snapshot (single file or sharded index) from a local path or fsspec URL.

    The constructor validates every header strictly before allocating anything (header size
    limit, offsets inside the file with no overlap or gap, dtypes and shapes against the
    layout, the metadata against the JSON schema) and loads the sequences. With ``verify``
    (the default) it also checks the header and metadata tensors against their checksums, and
    every later read checks each block against its checksum.

    ``url`` may name the ``.safetensors`` file, a sharded snapshot's ``.index.json``, or the
    ``.safetensors`` name a sharded snapshot was written to.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        verify: bool = True,
        io_threads: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self._verify = verify
        self._threads = io_threads or max(2, min(8, os.cpu_count() or 1))
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._files: list[_OpenFile] = []
        self._rows: dict[int, np.ndarray] = {}
        self._index_digests: tuple[str, ...] | None = None
        location = _locate(url, storage_options)
        self.url = location.url
        try:
            self._open(location)
            self._where = {
                entry.name: (index, entry)
                for index, open_file in enumerate(self._files)
                for entry in open_file.layout.entries
                if not fmt.is_container_tensor(entry.name)
            }
            geometry = self._header_metadata.geometry
            self._names = geometry.tensor_names()
            self._tensor_index = {name: index for index, name in enumerate(self._names)}
            self._page_bytes = geometry.canonical_page_size_bytes
            self._num_blocks = self._header_metadata.num_blocks
            self.metadata: SnapshotMetadata = self._load_metadata()
        except BaseException:
            self.close()
            raise

    # -- opening ---------------------------------------------------------------------------

    def _open(self, location: _Location) -> None:
        if location.path.endswith(INDEX_SUFFIX):
            self._open_sharded(location)
        elif location.exists() or not location.with_suffix(INDEX_SUFFIX).exists():
            open_file, header = self._open_file(location)
            if header.metadata.shard is not None:
                index, count = header.metadata.shard
                raise NotASnapshotError(
                    f"this is shard {index} of {count} of a sharded snapshot: "
                    f"open its {INDEX_SUFFIX}",
                    file=location.url,
                )
            self._files.append(open_file)
            self._header_metadata = header.metadata
        else:
            self._open_sharded(location.with_suffix(INDEX_SUFFIX))

    def _open_file(self, location: _Location) -> tuple[_OpenFile, fmt.DecodedHeader]:
        source = _Source(location)
        try:
            prefix = source.read(0, min(8, source.size))
            length = fmt.header_length(prefix, source.size, file=source.url)
            header_bytes = prefix + source.read(8, length)
            header = fmt.decode_header(header_bytes, source.size, file=source.url)
            layout, _, _ = fmt.expected_layout(header, file=source.url)
            if layout.header != header_bytes:
                raise SnapshotCorruptError(
                    "header bytes differ from the format's encoding", file=source.url
                )
            open_file = _OpenFile(source, layout)
            if self._verify:
                self._load_trailer(open_file)
        except BaseException:
            source.close()
            raise
        return open_file, header

    def _open_sharded(self, index_location: _Location) -> None:
        index = fmt.decode_index(
            _read_small(index_location, fmt.MAX_INDEX_BYTES), file=index_location.url
        )
        self._header_metadata = index.metadata
        self._index_digests = index.trailer_digests
        specs = fmt.specs_for(index.metadata)
        position = 0
        count = len(index.files)
        for number, name in enumerate(index.files, start=1):
            location = index_location.sibling(name)
            open_file, header = self._open_file(location)
            self._files.append(open_file)
            if header.metadata.shard != (number, count):
                raise SnapshotCorruptError(
                    f"claims to be shard {header.metadata.shard}, "
                    f"the index lists it as {number} of {count}",
                    file=location.url,
                )
            if header.metadata.unsharded_document() != index.metadata.document:
                raise SnapshotCorruptError("metadata differs from the index's", file=location.url)
            held = [entry.name for entry in open_file.layout.checksummed()]
            expected = [spec.name for spec in specs[position : position + len(held)]]
            if held != expected or any(index.weight_map[held_name] != name for held_name in held):
                raise SnapshotCorruptError(
                    "holds other tensors than the index assigns it", file=location.url
                )
            position += len(held)
            if self._verify:
                self._check_index_digest(number - 1)
        if position != len(specs):
            raise SnapshotCorruptError(
                f"the shards hold {position} of {len(specs)} tensors", file=index_location.url
            )

    def _load_trailer(self, open_file: _OpenFile) -> None:
        layout = open_file.layout
        entry = layout.by_name[fmt.CHECKSUMS_TENSOR]
        raw = open_file.source.read(entry.begin, entry.nbytes, tensor=fmt.CHECKSUMS_TENSOR)
        digests = fmt.decode_trailer(raw, file=open_file.source.url)
        if digests[0] != fmt.digest128(layout.header):
            # The trailer checked out, so the header bytes are what changed.
            raise SnapshotCorruptError(
                "header does not match its checksum (trailer row 0)", file=open_file.source.url
            )
        open_file.trailer = digests
        open_file.row_of = {
            item.name: row for row, item in enumerate(layout.checksummed(), start=1)
        }

    def _check_index_digest(self, shard: int) -> None:
        assert self._index_digests is not None
        open_file = self._files[shard]
        entry = open_file.layout.by_name[fmt.CHECKSUMS_TENSOR]
        raw = open_file.source.read(entry.begin, entry.nbytes, tensor=fmt.CHECKSUMS_TENSOR)
        if xxhash.xxh3_128_hexdigest(raw) != self._index_digests[shard]:
            raise SnapshotCorruptError(
                "shard does not match the index (a shard of another snapshot, or a partly "
                "published overwrite)",
                file=open_file.source.url,
                tensor=fmt.CHECKSUMS_TENSOR,
            )

    def _load_metadata(self) -> SnapshotMetadata:
        header = self._header_metadata
        names = [
            f"sequences.{index}.{part}"
            for index in range(len(header.sequences))
            for part in ("token_ids", "block_ids")
        ]
        tensors: dict[str, np.ndarray] = {}
        for name in [*names, fmt.BLOCK_HASHES_TENSOR]:
            raw = self._read_checked(name)
            dtype = np.dtype("<i8") if name.startswith("sequences.") else np.dtype(np.uint8)
            array = np.frombuffer(raw, dtype=dtype)
            tensors[name] = (
                array.reshape(-1, fmt.DIGEST_BYTES) if name == fmt.BLOCK_HASHES_TENSOR else array
            )
        return header.with_tensors(tensors, file=self.url)

    # -- helpers ---------------------------------------------------------------------------

    def _locate_tensor(self, name: str) -> tuple[_OpenFile, TensorEntry]:
        try:
            index, entry = self._where[name]
        except KeyError:
            raise KeyError(f"no tensor {name!r} in {self.url}") from None
        return self._files[index], entry

    def _expected_digest(self, open_file: _OpenFile, name: str) -> bytes | None:
        if open_file.trailer is None or open_file.row_of is None:
            return None
        return open_file.trailer[open_file.row_of[name]]

    def _read_checked(self, name: str) -> bytes:
        """A whole non-layer tensor's bytes, checked against the trailer when verifying."""
        open_file, entry = self._locate_tensor(name)
        raw = open_file.source.read(entry.begin, entry.nbytes, tensor=name)
        expected = self._expected_digest(open_file, name) if self._verify else None
        if expected is not None and fmt.digest128(raw) != expected:
            raise SnapshotCorruptError(
                "does not match its xxh3-128 checksum", file=open_file.source.url, tensor=name
            )
        return raw

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self._threads, thread_name_prefix="kvsnap-read"
            )
        return self._pool

    def _ensure_trailers(self) -> None:
        for open_file in self._files:
            if open_file.trailer is None:
                self._load_trailer(open_file)

    def _block_checksum_row(self, tensor: int) -> np.ndarray:
        """Stored xxh3-64 of every block of layer tensor ``tensor``, checked against the trailer."""
        row = self._rows.get(tensor)
        if row is not None:
            return row
        self._ensure_trailers()
        open_file, entry = self._locate_tensor(fmt.BLOCK_CHECKSUMS_TENSOR)
        num_blocks = self._num_blocks
        raw = open_file.source.read(
            entry.begin + tensor * num_blocks * 8, num_blocks * 8, tensor=fmt.BLOCK_CHECKSUMS_TENSOR
        )
        row = np.frombuffer(raw, dtype="<u8")
        name = self._names[tensor]
        layer_file, _ = self._locate_tensor(name)
        if fmt.layer_tensor_digest(row) != self._expected_digest(layer_file, name):
            raise SnapshotCorruptError(
                f"the stored block checksums of {name} do not match their xxh3-128 checksum",
                file=open_file.source.url,
                tensor=fmt.BLOCK_CHECKSUMS_TENSOR,
            )
        self._rows[tensor] = row
        return row

    def _layer(self, name: str) -> tuple[int, _OpenFile, TensorEntry]:
        tensor = self._tensor_index.get(name)
        if tensor is None:
            raise KeyError(
                f"{name!r} is not a layer tensor of {self.url} (they are {self._names[0]}, ...)"
            )
        open_file, entry = self._locate_tensor(name)
        return tensor, open_file, entry

    def _pieces(self, block_ids: np.ndarray) -> list[tuple[int, int, int]]:
        """Coalesced reads ``(first_block, num_blocks, output_page)``: runs of consecutive ids,
        cut at about SUBCHUNK_BYTES so threads share large runs."""
        if not len(block_ids):
            return []
        breaks = np.flatnonzero(np.diff(block_ids) != 1) + 1
        starts = np.concatenate(([0], breaks))
        stops = np.concatenate((breaks, [len(block_ids)]))
        per = max(1, SUBCHUNK_BYTES // self._page_bytes)
        pieces = []
        for start, stop in zip(starts.tolist(), stops.tolist(), strict=True):
            for position in range(start, stop, per):
                count = min(per, stop - position)
                pieces.append((int(block_ids[position]), count, position))
        return pieces

    def _run(
        self, work: Callable[[Any], Any], items: Sequence[Any], concurrent_ok: bool, nbytes: int
    ) -> list[Any]:
        if concurrent_ok and len(items) > 1 and nbytes > SUBCHUNK_BYTES:
            return list(self._executor().map(work, items))
        return [work(item) for item in items]

    # -- public API ------------------------------------------------------------------------

    @property
    def format_version(self) -> int:
        """The snapshot format version the file was written in."""
        return int(self._header_metadata.document["format_version"])

    @property
    def files(self) -> list[str]:
        """The data files, in order (one, or the shards)."""
        return [open_file.source.url for open_file in self._files]

    def locate(self, name: str) -> tuple[str, TensorEntry]:
        """The file holding tensor ``name`` and its entry (absolute file offsets)."""
        open_file, entry = self._locate_tensor(name)
        return open_file.source.url, entry

    def page_size_bytes(self, name: str) -> int:
        """Bytes of one block of layer tensor ``name``."""
        self._layer(name)
        return self._page_bytes

    def block_checksums(self, name: str) -> np.ndarray:
        """The stored xxh3-64 of every block of layer tensor ``name`` (checked against the
        trailer; :class:`SnapshotCorruptError` if they do not match it)."""
        tensor, _, _ = self._layer(name)
        return self._block_checksum_row(tensor)

    def read_pages(self, name: str, block_ids: np.ndarray | Sequence[int], out: np.ndarray) -> None:
        """Read blocks ``block_ids`` of layer tensor ``name``, in that order, into ``out``.

        ``out`` is a C-contiguous uint8 array of at least ``len(block_ids) * page_bytes``
        bytes; page ``i`` lands at ``[i*page_bytes, (i+1)*page_bytes)``. Consecutive ids are
        read as one range and only the blocks asked for are read. With ``verify`` every block
        is checked against its xxh3-64 (:class:`SnapshotCorruptError` naming the block).
        """
        read_piece, pieces, concurrent_ok = self._piece_reader(name, block_ids, out, None)
        nbytes = sum(count for _, count, _ in pieces) * self._page_bytes
        # Small reads stay on the calling thread: a handoff costs more than it saves.
        if concurrent_ok and len(pieces) > 1 and nbytes > SUBCHUNK_BYTES:
            self._submit_pieces(read_piece, pieces).result()
        else:
            for piece in pieces:
                read_piece(piece)

    def read_pages_async(
        self,
        name: str,
        block_ids: np.ndarray | Sequence[int],
        out: np.ndarray,
        *,
        trace: TraceHook | None = None,
    ) -> concurrent.futures.Future[None]:
        """:meth:`read_pages` on the reader's threads; the arguments are checked before it returns.

        The future completes once no thread touches ``out`` any more: with ``None``, or the
        first error (the pieces not started yet are then skipped). Calls queue behind each
        other, so a caller that keeps the next buffer's call queued keeps the disk busy while
        it consumes the previous buffer. ``trace`` receives a ``read`` and a ``verify`` span
        per piece.
        """
        read_piece, pieces, _ = self._piece_reader(name, block_ids, out, trace)
        return self._submit_pieces(read_piece, pieces)

    def _submit_pieces(
        self, read_piece: Callable[[tuple[int, int, int]], None], pieces: list[tuple[int, int, int]]
    ) -> concurrent.futures.Future[None]:
        done = _Completion(
            len(pieces),
            cancelled=lambda: SnapshotIOError("skipped after an earlier failure", file=self.url),
        )
        executor = self._executor()
        for piece in pieces:
            done.watch(executor.submit(read_piece, piece))
        return done.future

    def _piece_reader(
        self,
        name: str,
        block_ids: np.ndarray | Sequence[int],
        out: np.ndarray,
        trace: TraceHook | None,
    ) -> tuple[Callable[[tuple[int, int, int]], None], list[tuple[int, int, int]], bool]:
        """Check a read of ``block_ids`` into ``out``; the function that reads (and verifies)
        one piece, the pieces, and whether pieces may run concurrently."""
        tensor, open_file, entry = self._layer(name)
        ids = np.asarray(block_ids)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise ValueError("block_ids must be a one-dimensional integer array")
        ids = ids.astype(np.int64, copy=False)
        num_blocks = self._num_blocks
        if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
            raise IndexError(
                f"{name}: block ids must lie in [0, {num_blocks}), got {ids.min()}..{ids.max()}"
            )
        if not isinstance(out, np.ndarray) or out.dtype != np.uint8 or not out.flags.c_contiguous:
            raise TypeError("out must be a C-contiguous uint8 numpy array")
        page = self._page_bytes
        needed = len(ids) * page
        if out.nbytes < needed:
            raise ValueError(f"out holds {out.nbytes} bytes, {len(ids)} pages need {needed}")
        flat = out.reshape(-1)
        row = self._block_checksum_row(tensor) if self._verify else None
        source = open_file.source

        def read_piece(piece: tuple[int, int, int]) -> None:
            block, count, position = piece
            view = flat[position * page : (position + count) * page]
            with traced(trace, "read", view.nbytes):
                source.read_into(entry.begin + block * page, memoryview(view), tensor=name)
            if row is not None:
                with traced(trace, "verify", view.nbytes):
                    _check_blocks(view, page, row, block, source.url, name)

        return read_piece, self._pieces(ids), source.concurrent

    def read_tensor(self, name: str) -> torch.Tensor:
        """A whole tensor (layer, sequence or ``kvsnap.*``) with its dtype and shape, verified
        when the reader verifies."""
        _, entry = self._locate_tensor(name)
        dtype = _TORCH_DTYPES[entry.dtype]
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=dtype)
        buffer = np.empty(entry.nbytes, dtype=np.uint8)
        if name in self._tensor_index:
            self.read_pages(name, np.arange(self._num_blocks), buffer)
        else:
            buffer[:] = np.frombuffer(self._read_checked(name), dtype=np.uint8)
        return torch.from_numpy(buffer).view(dtype).reshape(entry.shape)

    def verify(self, progress: Callable[[int], None] | None = None) -> list[Problem]:
        """Check every checksum and the structure; ``[]`` means the snapshot is intact.

        Reads the whole snapshot once, in bounded pieces. Reports a header or index that does
        not match its checksum, each corrupt tensor, the first corrupt blocks of each layer
        tensor by index, non-zero padding, and sequences whose token ids do not hash to the
        stored prefix hashes. ``progress`` receives the KV (layer) bytes checked so far.
        """
        problems: list[Problem] = []
        for shard, open_file in enumerate(self._files):
            try:
                self._load_trailer(open_file)
                if self._index_digests is not None:
                    self._check_index_digest(shard)
            except SnapshotCorruptError as error:
                problems.append(Problem(error.tensor, error.block, str(error)))
                open_file.trailer = None
        done = 0
        for open_file in self._files:
            for entry in open_file.layout.entries:
                if entry.name == fmt.CHECKSUMS_TENSOR:
                    continue
                try:
                    if entry.name.startswith(fmt.PADDING_PREFIX):
                        problems += self._verify_padding(open_file, entry)
                    elif fmt.is_layer_tensor(entry.name):
                        row, trusted = self._stored_row(entry.name, problems)
                        problems += self._verify_layer(open_file, entry, row, trusted)
                        done += entry.nbytes
                        if progress is not None:
                            progress(done)
                    elif open_file.trailer is not None:
                        problems += self._verify_whole(open_file, entry)
                except SnapshotCorruptError as error:
                    problems.append(Problem(error.tensor or entry.name, error.block, str(error)))
        problems += self._verify_hash_chains()
        return problems

    def _stored_row(self, name: str, problems: list[Problem]) -> tuple[np.ndarray, bool]:
        """Layer tensor ``name``'s stored block checksums, and whether they match their own
        checksum (a trusted row). An untrusted row still names the blocks that disagree."""
        tensor = self._tensor_index[name]
        open_file, entry = self._locate_tensor(fmt.BLOCK_CHECKSUMS_TENSOR)
        row_bytes = self._num_blocks * 8
        raw = open_file.source.read(
            entry.begin + tensor * row_bytes, row_bytes, tensor=fmt.BLOCK_CHECKSUMS_TENSOR
        )
        row = np.frombuffer(raw, dtype="<u8")
        layer_file, _ = self._locate_tensor(name)
        expected = self._expected_digest(layer_file, name)
        trusted = expected is not None and fmt.layer_tensor_digest(row) == expected
        if expected is not None and not trusted:
            problems.append(
                Problem(
                    fmt.BLOCK_CHECKSUMS_TENSOR,
                    None,
                    f"{open_file.source.url}: the stored block checksums of {name} do not match "
                    "their xxh3-128 checksum",
                )
            )
        return row, trusted

    def _verify_padding(self, open_file: _OpenFile, entry: TensorEntry) -> list[Problem]:
        raw = open_file.source.read(entry.begin, entry.nbytes, tensor=entry.name)
        if any(raw):
            url = open_file.source.url
            return [Problem(entry.name, None, f"{url}: padding {entry.name} is not all zero")]
        return []

    def _verify_whole(self, open_file: _OpenFile, entry: TensorEntry) -> list[Problem]:
        expected = self._expected_digest(open_file, entry.name)
        hasher = xxhash.xxh3_128()
        buffer = np.empty(min(entry.nbytes, SUBCHUNK_BYTES), dtype=np.uint8)
        for offset in range(entry.begin, entry.end, SUBCHUNK_BYTES):
            view = memoryview(buffer)[: min(SUBCHUNK_BYTES, entry.end - offset)]
            open_file.source.read_into(offset, view, tensor=entry.name)
            hasher.update(view)
        if hasher.digest() != expected:
            url = open_file.source.url
            return [
                Problem(
                    entry.name, None, f"{url}: {entry.name} does not match its xxh3-128 checksum"
                )
            ]
        return []

    def _verify_layer(
        self, open_file: _OpenFile, entry: TensorEntry, stored: np.ndarray, trusted: bool
    ) -> list[Problem]:
        name = entry.name
        url = open_file.source.url
        page = self._page_bytes

        def digest_piece(piece: tuple[int, int, int]) -> np.ndarray:
            block, count, _ = piece
            buffer = np.empty(count * page, dtype=np.uint8)
            open_file.source.read_into(entry.begin + block * page, memoryview(buffer), tensor=name)
            return fmt.block_digests(buffer, page)

        pieces = self._pieces(np.arange(self._num_blocks, dtype=np.int64))
        parts = self._run(digest_piece, pieces, open_file.source.concurrent, entry.nbytes)
        computed = np.concatenate(parts) if parts else np.empty(0, dtype=np.uint64)
        bad = np.flatnonzero(computed != stored)
        # With a trusted row the data is wrong; otherwise the data or its stored checksum is.
        blamed = name if trusted else fmt.BLOCK_CHECKSUMS_TENSOR
        problems = [
            Problem(
                blamed,
                block,
                f"{url}: tensor {name}, block {block}: xxh3-64 {int(computed[block]):016x}, "
                f"stored {int(stored[block]):016x}",
            )
            for block in bad[:MAX_PROBLEMS_PER_TENSOR].tolist()
        ]
        if len(bad) > MAX_PROBLEMS_PER_TENSOR:
            more = len(bad) - MAX_PROBLEMS_PER_TENSOR
            problems.append(
                Problem(blamed, None, f"{url}: tensor {name}: {more} more corrupt blocks")
            )
        return problems

    def _verify_hash_chains(self) -> list[Problem]:
        problems = []
        block_size = self.metadata.geometry.block_size
        referenced = np.zeros(self._num_blocks, dtype=bool)
        for index, record in enumerate(self.metadata.sequences):
            referenced[record.block_ids] = True
            chain = fmt.prefix_hash_chain(record.token_ids, block_size)
            for position, (got, stored) in enumerate(zip(chain, record.prefix_hashes, strict=True)):
                if got != stored:
                    block = int(record.block_ids[position])
                    problems.append(
                        Problem(
                            f"sequences.{index}.token_ids",
                            None,
                            f"{self.url}: sequence {record.id!r}: its tokens hash to {got} at "
                            f"block position {position}, {fmt.BLOCK_HASHES_TENSOR} holds "
                            f"{stored} for snapshot block {block}",
                        )
                    )
                    break
        unreferenced = np.flatnonzero(~referenced)
        if len(unreferenced):
            open_file, entry = self._locate_tensor(fmt.BLOCK_HASHES_TENSOR)
            hashes = open_file.source.read(
                entry.begin, entry.nbytes, tensor=fmt.BLOCK_HASHES_TENSOR
            )
            nonzero = [int(b) for b in unreferenced.tolist() if any(hashes[16 * b : 16 * b + 16])]
            for block in nonzero[:MAX_PROBLEMS_PER_TENSOR]:
                problems.append(
                    Problem(
                        fmt.BLOCK_HASHES_TENSOR,
                        block,
                        f"{self.url}: block {block} belongs to no sequence but has a prefix hash",
                    )
                )
        return problems

    def close(self) -> None:
        """Close every file and stop the reader's threads."""
        for open_file in self._files:
            open_file.source.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> SnapshotReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


__all__ = [
    "DEFAULT_MAX_INFLIGHT_BYTES",
    "SnapshotInfo",
    "SnapshotReader",
    "SnapshotWriter",
    "TraceHook",
    "traced",
]
