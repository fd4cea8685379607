"""The writer's local-file target: reservation, O_DIRECT, checksums, fsync, rename."""

from __future__ import annotations

import os

import numpy as np

from kvsnap import format as fmt
from kvsnap.errors import (
    SnapshotIOError,
)
from kvsnap.format import TensorEntry
from kvsnap.store import overwrite, publish
from kvsnap.store.local_file import LocalFile, memory_backed, preallocate
from kvsnap.store.location import (
    INDEX_SUFFIX,
    io_error,
    stem_of,
)
from kvsnap.store.tracing import traced


class LocalTarget:
    """The local-file half of :class:`~kvsnap.store.writer.SnapshotWriter` (a mixin)."""

    def _write_local_data(self, file: LocalFile, offset: int, view: np.ndarray) -> None:
        with traced(self._trace, "write", view.nbytes):
            self._write_local_parts(file, offset, view)

    def _write_local_parts(self, file: LocalFile, offset: int, view: np.ndarray) -> None:
        """The aligned body through O_DIRECT, an unaligned head or tail through the page cache."""
        data = memoryview(view)
        if file.direct_fd is not None:
            address = view.ctypes.data
            head = (-offset) % fmt.DATA_ALIGNMENT
            if (address + head) % fmt.DATA_ALIGNMENT == 0:
                body = (
                    (len(data) - head) // fmt.DATA_ALIGNMENT * fmt.DATA_ALIGNMENT
                    if len(data) > head
                    else 0
                )
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
        if self._page_bytes % fmt.DATA_ALIGNMENT:
            why.append(
                f"pages of {self._page_bytes} bytes are not multiples of {fmt.DATA_ALIGNMENT}"
            )
        if self._unaligned_buffers:
            why.append(f"some caller buffers were not {fmt.DATA_ALIGNMENT}-aligned")
        cause = "; ".join(why) or "unaligned boundaries"
        return f"{self._buffered_bytes} of {total} KV bytes went through the page cache ({cause})"

    def _start_local(self, direct_io: bool | None) -> None:
        directory = os.path.dirname(self._location.path)
        # Leftovers of killed writers of this snapshot (their lock is free); never a live one's.
        stem = stem_of(self._location)
        publish.remove_dead_temps(directory, overwrite.owns_name(self._location), stem)
        needed = sum(layout.file_size for layout in self._layouts)
        try:
            stats = os.statvfs(directory)
        except OSError as error:
            raise io_error("opening the target directory", directory, error) from error
        free = stats.f_bavail * stats.f_frsize
        if free < needed:
            raise SnapshotIOError(
                f"the snapshot needs {needed} bytes, {directory} has {free} free",
                file=self._location.url,
            )
        for final in self._finals:
            self._local_files.append(LocalFile(final, owner=stem))
        memory = memory_backed(directory)
        for index, (file, layout) in enumerate(zip(self._local_files, self._layouts, strict=True)):
            if direct_io is False or (direct_io is None and memory):
                # On tmpfs the page cache is the file: O_DIRECT saves no copy there.
                self.fallback_reason = (
                    "direct_io=False"
                    if direct_io is False
                    else ("a memory-backed file (tmpfs): O_DIRECT saves nothing there")
                )
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
        # Blocks are reserved for an O_DIRECT stream to a disk only: that is what the
        # reservation speeds up. On a memory-backed file (tmpfs takes O_DIRECT since Linux 6.6)
        # it would only zero every page before the data overwrites it (28-30 ms of a 268 MB
        # capture to /dev/shm on the H200 host).
        self.preallocated = not memory and all(
            file.direct_fd is not None and preallocate(file.fd, layout.file_size)
            for file, layout in zip(self._local_files, self._layouts, strict=True)
        )

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
                signature = layout.by_name.get(fmt.SIGNATURE_TENSOR)
                if signature is not None:
                    file.write(signature.begin, memoryview(self._signature(shard)))
        with traced(self._trace, "commit.fsync"):
            for file in self._local_files:
                file.sync()

    def _publish_local(self) -> None:
        stale = overwrite.stale_files(self._location, self._finals, self._sharded)
        for file in self._local_files:
            file.publish()
        publish.fsync_directory(os.path.dirname(self._location.path))
        self._local_files = []
        if self._sharded:
            index = self._location.with_suffix(INDEX_SUFFIX)
            publish.publish_bytes(index.path, self._index_bytes())
        overwrite.remove_quietly(stale)
