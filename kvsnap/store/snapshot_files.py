"""What one snapshot write is made of, shared by :class:`~kvsnap.store.writer.SnapshotWriter`
and the target it writes to: the snapshot_files of its files and the digests that complete them
(:class:`SnapshotFiles`), the bound on the caller's bytes in flight and the write's first error
(:class:`WriteGate`), and the interface of a target (:class:`WriteTarget`: local files,
:mod:`~kvsnap.store.write_local`, or an fsspec stream, :mod:`~kvsnap.store.write_stream`).
"""

from __future__ import annotations

import concurrent.futures
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np

from kvsnap import format as fmt
from kvsnap.errors import KVSnapError, SnapshotIOError
from kvsnap.format import SnapshotMetadata, TensorEntry
from kvsnap.format.signing import KeyRing
from kvsnap.store.location import INDEX_SUFFIX, Location, io_error, stem_of


class SnapshotFiles:
    """Every file of one snapshot: its layout (fixed before the first byte) and final location,
    where each tensor goes, the bytes known before any data, and, once the data is hashed, the
    checksums, trailers, signatures and index that complete them.

    ``digests`` (tensors x blocks, xxh3-64) is filled by the writer's hashing as pages arrive,
    and so is ``page_digests`` (tensors x blocks x 32, BLAKE3-256) for a snapshot signed with
    :data:`~kvsnap.format.constants.SIGNATURE_ALGORITHM` (``None`` otherwise); :meth:`trailer`
    and what depends on it are read only once every page is hashed.
    """

    def __init__(
        self,
        location: Location,
        metadata: SnapshotMetadata,
        max_shard_bytes: int | None,
        keys: KeyRing | None,
    ) -> None:
        self.location = location
        self.metadata = metadata
        self.layouts = fmt.file_layouts(metadata, max_shard_bytes)
        if self.sharded and metadata.part is not None:
            raise ValueError("a part of a parted snapshot is one file: it cannot be sharded")
        self.finals = self._final_locations()
        geometry = metadata.geometry
        self.page_bytes = geometry.canonical_page_size_bytes
        self.num_blocks = metadata.num_blocks
        self.names = geometry.tensor_names()
        self.tensor_index = {name: index for index, name in enumerate(self.names)}
        self.placement: dict[str, tuple[int, TensorEntry]] = {
            entry.name: (shard, entry)
            for shard, layout in enumerate(self.layouts)
            for entry in layout.entries
        }
        # Metadata tensors are little-endian int64 / uint8 already (see metadata_tensors).
        self._static = {
            name: np.ascontiguousarray(array).view(np.uint8).reshape(-1)
            for name, array in metadata.metadata_tensors().items()
        }
        self.digests = np.zeros((len(self.names), self.num_blocks), dtype=np.uint64)
        self.page_digests: np.ndarray | None = None
        if metadata.signature == fmt.SIGNATURE_ALGORITHM:
            shape = (len(self.names), self.num_blocks, fmt.PAGE_DIGEST_BYTES)
            self.page_digests = np.zeros(shape, dtype=np.uint8)
        self._keys = keys
        self._trailers: dict[int, bytes] = {}

    @property
    def sharded(self) -> bool:
        return len(self.layouts) > 1

    @property
    def index_location(self) -> Location:
        """Where a sharded snapshot's index goes: ``{url}.index.json``."""
        return self.location.with_suffix(INDEX_SUFFIX)

    def _final_locations(self) -> list[Location]:
        if not self.sharded:
            return [self.location]
        stem = stem_of(self.location)
        count = len(self.layouts)
        # New names on every write: the old index's shards stay intact until it is replaced.
        generation = fmt.new_generation()
        return [
            self.location.sibling(fmt.shard_file_name(stem, index + 1, count, generation))
            for index in range(count)
        ]

    def static_bytes(self, entry: TensorEntry) -> np.ndarray | bytes | None:
        """The bytes of an entry known before any data: metadata tensors and padding."""
        if entry.name.startswith(fmt.PADDING_PREFIX):
            return bytes(entry.nbytes)
        return self._static.get(entry.name)

    def block_checksums(self) -> bytes:
        """The ``kvsnap.block_checksums`` tensor's bytes."""
        return self.digests.astype("<u8").tobytes()

    def page_digest_bytes(self, shard: int) -> bytes:
        """File ``shard``'s ``kvsnap.page_digests`` bytes: the rows of its layer tensors, in
        file order (a file signed with BLAKE3 page digests only)."""
        assert self.page_digests is not None
        entries = self.layouts[shard].layer_entries
        rows = [self.tensor_index[e.name] for e in entries if fmt.is_layer_tensor(e.name)]
        return self.page_digests[rows].tobytes()

    def tensor_bytes(self, shard: int, entry: TensorEntry) -> bytes | np.ndarray:
        """The bytes of file ``shard``'s entry ``entry``, other than a layer tensor or the
        signature; those written at commit once every page is hashed."""
        if entry.name == fmt.BLOCK_CHECKSUMS_TENSOR:
            return self.block_checksums()
        if entry.name == fmt.PAGE_DIGESTS_TENSOR:
            return self.page_digest_bytes(shard)
        if entry.name == fmt.CHECKSUMS_TENSOR:
            return self.trailer(shard)
        static = self.static_bytes(entry)
        assert static is not None, entry.name
        return static

    def trailer(self, shard: int) -> bytes:
        """File ``shard``'s checksum trailer; computed once all data is hashed (commit), then
        reused by the index and the info."""
        cached = self._trailers.get(shard)
        if cached is not None:
            return cached
        layout = self.layouts[shard]
        digests = [fmt.digest128(layout.header)]
        for entry in layout.checksummed():
            if fmt.is_layer_tensor(entry.name):
                digests.append(fmt.layer_tensor_digest(self.digests[self.tensor_index[entry.name]]))
            elif entry.name == fmt.BLOCK_CHECKSUMS_TENSOR:
                digests.append(fmt.digest128(self.block_checksums()))
            elif entry.name == fmt.PAGE_DIGESTS_TENSOR:
                digests.append(fmt.digest128(self.page_digest_bytes(shard)))
            else:
                static = self.static_bytes(entry)
                assert static is not None
                digests.append(fmt.digest128(static))
        self._trailers[shard] = fmt.encode_trailer(digests)
        return self._trailers[shard]

    def signature(self, shard: int) -> bytes:
        """File ``shard``'s signature (a signing writer only): an HMAC over its header and its
        signed tensors' bytes (:func:`~kvsnap.format.signing.signed_entries`)."""
        assert self._keys is not None and self.metadata.signature is not None
        layout = self.layouts[shard]
        algorithm = self.metadata.signature
        parts = [layout.header]
        parts += [self.tensor_bytes(shard, e) for e in fmt.signed_entries(layout, algorithm)]
        return self._keys.sign([memoryview(part) for part in parts], algorithm)

    def index_bytes(self) -> bytes:
        """A sharded snapshot's index, binding it to its shards' trailers."""
        trailers = [self.trailer(shard) for shard in range(len(self.layouts))]
        names = [final.name for final in self.finals]
        return fmt.encode_index(self.metadata, names, self.layouts, trailers)


class WriteGate:
    """The caller's bytes in flight, bounded by ``max_inflight`` bytes, and the first error of
    the write, which stops it: shared by the writer, its worker threads and its target."""

    def __init__(self, url: str, max_inflight: int) -> None:
        self._url = url
        self._max_inflight = max_inflight
        self._inflight = 0
        self._cond = threading.Condition()
        self.error: BaseException | None = None

    def fail(self, error: BaseException) -> None:
        """Record ``error`` (the first one stays) and wake whoever waits."""
        with self._cond:
            if self.error is None:
                self.error = error
            self._cond.notify_all()

    def raise_error(self) -> None:
        """Raise the recorded error, as a :class:`KVSnapError` (an ``OSError`` as an I/O one)."""
        error = self.error
        if error is not None:
            if isinstance(error, KVSnapError):
                raise error
            raise io_error("writing the snapshot", self._url, error) from error

    def admit(self, nbytes: int) -> None:
        """Wait until ``nbytes`` more fit the bound (one buffer larger than the bound is still
        admitted when nothing else is in flight), then count them."""
        with self._cond:
            while (
                self._inflight
                and self._inflight + nbytes > self._max_inflight
                and self.error is None
            ):
                self._cond.wait()
            self._inflight += nbytes
        self.raise_error()

    def release(self, nbytes: int) -> None:
        with self._cond:
            self._inflight -= nbytes
            self._cond.notify_all()

    def drain(self) -> None:
        """Wait until no caller bytes are in flight (or the write failed)."""
        with self._cond:
            while self._inflight and self.error is None:
                self._cond.wait()

    def guarded(self, work: Callable[..., None], *args: Any) -> Callable[[], None]:
        """``work(*args)`` for a worker thread: skipped after an earlier failure, and its own
        failure stops the write."""

        def run() -> None:
            if self.error is not None:
                raise SnapshotIOError("the writer stopped after an earlier error", file=self._url)
            try:
                work(*args)
            except BaseException as error:
                self.fail(error)
                raise

        return run


class WriteTarget(ABC):
    """Where a snapshot's files are written and published, chosen once per write: local files
    (temporary names, ``pwrite`` at final offsets, O_DIRECT, fsync, rename) or fsspec streams
    (front to back through one ordered lane)."""

    #: Why O_DIRECT does not carry (all) layer data; ``None`` when it does.
    fallback_reason: str | None = None
    #: Whether the files' blocks were reserved up front.
    preallocated: bool = False
    #: Layer bytes written through O_DIRECT.
    direct_bytes: int = 0
    #: Whether the pages of several tensors that follow each other in a file may go as one
    #: write (a stream takes each tensor's pages in turn).
    merges_tensors: bool = True
    #: Whether the layer data is placed in the mapped files by the caller's device copies
    #: (:meth:`map_data`) instead of written.
    mapped: bool = False

    @abstractmethod
    def start(self, direct_io: bool | None) -> None:
        """Create the files and write what is known before any data."""

    @abstractmethod
    def write(self, shard: int, offset: int, view: np.ndarray) -> concurrent.futures.Future[None]:
        """Queue ``view`` for file ``shard`` at ``offset``; the future completes once written."""

    def map_data(self, register: bool) -> str | None:
        """Map the files for the caller's device to place the layer data in (see
        :meth:`~kvsnap.store.writer.SnapshotWriter.map_for_device`); ``None`` once mapped,
        else why not (the data is then written as before)."""
        return "the snapshot goes to a stream, not to local files"

    def mapped_arrays(self) -> list[np.ndarray]:
        """Each mapped file as a uint8 array, in file order (after :meth:`map_data`)."""
        raise RuntimeError("the files are not mapped")

    def hashed(self, shard: int, future: concurrent.futures.Future[None]) -> None:  # noqa: B027
        """A hashing task of pages of file ``shard`` was queued (``future``)."""

    def tensor_done(self, next_name: str | None) -> None:  # noqa: B027
        """Every page of the current layer tensor was queued; ``next_name`` comes next
        (``None``: the last one)."""

    @abstractmethod
    def finish(self, drain: Callable[[], None]) -> None:
        """Write what follows the data (checksums, trailer, signature) and make the files
        durable; raises the write's error. ``drain`` waits until the caller's data is all
        hashed and written (a target whose own order ensures that need not call it)."""

    @abstractmethod
    def publish(self) -> None:
        """Publish the files (and a sharded snapshot's index), then remove what the snapshot
        they replace owned."""

    def partial_direct_reason(self) -> str | None:
        """Why some layer bytes went through the page cache although O_DIRECT was on."""
        return None

    def unlink_temporaries(self) -> None:  # noqa: B027
        """Remove temporary names at once, before an abort waits for running work."""

    @abstractmethod
    def shutdown(self, cancel: bool) -> None:
        """Wait for this target's queued work (``cancel``: cancel what has not started)."""

    @abstractmethod
    def discard(self) -> None:
        """Remove everything written (an abort)."""
