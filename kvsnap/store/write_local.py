"""The writer's local-file target: reservation, O_DIRECT, checksums, fsync, rename; on a
memory-backed filesystem, the files mapped for the caller's device to place the data in."""

from __future__ import annotations

import concurrent.futures
import errno
import os
import threading
from collections.abc import Callable

import numpy as np

from kvsnap import format as fmt
from kvsnap.errors import SnapshotIOError
from kvsnap.host_registration import cuda_unavailable_reason
from kvsnap.store import overwrite, publish, tuning
from kvsnap.store.lanes import SerialLane
from kvsnap.store.local_file import LocalFile, memory_backed, preallocate
from kvsnap.store.location import io_error, stem_of
from kvsnap.store.mapped_file import MappedFile
from kvsnap.store.mapping_release import release_later
from kvsnap.store.pools import cpu_count, shared_executor
from kvsnap.store.snapshot_files import SnapshotFiles, WriteGate, WriteTarget
from kvsnap.store.spare_files import SpareFile, spare_files
from kvsnap.store.tracing import TraceHook, traced


class LocalTarget(WriteTarget):
    """Local files: each written under a locked temporary name beside its final path, layer
    data at its final offset (through O_DIRECT where the filesystem takes it and buffers are
    aligned), in order and one write at a time on a lane of the process-wide write pool;
    fsynced, renamed into place, the directory fsynced. Or, after :meth:`map_data`, placed in
    the mapped, registered file by the caller's device copies (memory-backed files only)."""

    def __init__(
        self, snapshot_files: SnapshotFiles, gate: WriteGate, trace: TraceHook | None
    ) -> None:
        self._snapshot_files = snapshot_files
        self._gate = gate
        self._trace = trace
        #: The files being written, in order (until published or discarded).
        self.files: list[LocalFile] = []
        # A writer starts no thread: its writes go in order through a lane of the shared pool.
        self._writes = SerialLane(shared_executor("write", tuning.WRITE_POOL_THREADS))
        self._counts_lock = threading.Lock()
        self._buffered_bytes = 0
        self._unaligned_buffers = False
        self._memory_backed = False
        #: Each file mapped for the device's copies, in file order (empty: written by pwrite).
        self._mapped_files: list[MappedFile] = []
        #: Whether the mapped files are registered with CUDA (what a spare made after the
        #: publish should be).
        self._registering = False

    # -- start ---------------------------------------------------------------------------

    def start(self, direct_io: bool | None) -> None:
        location = self._snapshot_files.location
        directory = os.path.dirname(location.path)
        # Leftovers of killed writers of this snapshot (their lock is free); never a live one's.
        stem = stem_of(location)
        publish.remove_dead_temps(directory, overwrite.owns_name(location), stem)
        self._check_free_space(directory)
        for final in self._snapshot_files.finals:
            self.files.append(LocalFile(final, owner=stem))
        memory = self._memory_backed = memory_backed(directory)
        for index, (file, layout) in enumerate(
            zip(self.files, self._snapshot_files.layouts, strict=True)
        ):
            if direct_io is False or (direct_io is None and memory):
                # On tmpfs the page cache is the file: O_DIRECT saves no copy there.
                self.fallback_reason = (
                    "direct_io=False"
                    if direct_io is False
                    else ("a memory-backed file (tmpfs): O_DIRECT saves nothing there")
                )
                file.write(0, memoryview(layout.header))
            elif index == 0 or self.files[0].direct_fd is not None:
                reason = file.enable_direct(layout.header)
                if reason is not None:
                    if direct_io:
                        raise SnapshotIOError(
                            f"O_DIRECT was required but {reason}", file=location.url
                        )
                    self.fallback_reason = reason
                    file.write(0, memoryview(layout.header))
            else:
                file.write(0, memoryview(layout.header))
            for entry in layout.entries:
                static = self._snapshot_files.static_bytes(entry)
                if static is not None:
                    file.write(entry.begin, memoryview(static))
        # Blocks are reserved for an O_DIRECT stream to a disk only: that is what the
        # reservation speeds up. On a memory-backed file (tmpfs takes O_DIRECT since Linux 6.6)
        # it would only zero every page before the data overwrites it (28-30 ms of a 268 MB
        # capture to /dev/shm on the H200 host).
        self.preallocated = not memory and all(
            file.direct_fd is not None and preallocate(file.fd, layout.file_size)
            for file, layout in zip(self.files, self._snapshot_files.layouts, strict=True)
        )

    def _check_free_space(self, directory: str) -> None:
        needed = sum(layout.file_size for layout in self._snapshot_files.layouts)
        try:
            stats = os.statvfs(directory)
        except OSError as error:
            raise io_error("opening the target directory", directory, error) from error
        free = stats.f_bavail * stats.f_frsize
        if free < needed and spare_files().held_bytes()[0]:
            # Spare capture files hold room on some filesystem: this one's go first.
            spare_files().drop(device=os.stat(directory).st_dev)
            stats = os.statvfs(directory)
            free = stats.f_bavail * stats.f_frsize
        if free < needed:
            # Raised from an ENOSPC so that callers tell a full disk from other failures.
            raise SnapshotIOError(
                f"the snapshot needs {needed} bytes, {directory} has {free} free",
                file=self._snapshot_files.location.url,
            ) from OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    # -- mapped data ---------------------------------------------------------------------

    def map_data(self, register: bool) -> str | None:
        reason = self._mapping_refusal(register)
        if reason is not None:
            return reason
        self._registering = register
        spare = self._spare(register)
        threads = min(tuning.POPULATE_THREADS, cpu_count())
        executor = shared_executor("populate", threads) if threads > 1 else None
        for file, layout in zip(self.files, self._snapshot_files.layouts, strict=True):
            assert file.fd is not None
            try:
                if spare is not None:
                    taken, spare = spare, None
                    if self._adopt_spare(file, layout, taken, register):
                        continue
                mapped = MappedFile(file.fd, layout.file_size)
                self._mapped_files.append(mapped)
                with traced(self._trace, "setup.map.populate", layout.file_size):
                    mapped.populate(executor, threads)
                if register:
                    with traced(self._trace, "setup.map.register", layout.file_size):
                        mapped.register()
            except (OSError, ValueError) as error:
                # The filesystem full, no pinnable memory: the data is written as usual (and
                # a full filesystem fails that write with ENOSPC). Spares there go first.
                self._unmap()
                if getattr(error, "errno", None) == errno.ENOSPC:
                    spare_files().drop(device=os.fstat(file.fd).st_dev)
                return f"mapping the file failed ({error})"
        self.mapped = True
        return None

    def _spare(self, register: bool) -> SpareFile | None:
        """The spare capture file of the target directory when it fits this snapshot (a
        single file: spares are never taken for shards)."""
        if len(self.files) != 1:
            return None
        directory = os.path.dirname(self._snapshot_files.location.path)
        with traced(self._trace, "setup.map.take_spare"):
            return spare_files().take(directory, self._snapshot_files.layouts[0].file_size)

    def _adopt_spare(
        self, file: LocalFile, layout: fmt.FileLayout, spare: SpareFile, register: bool
    ) -> bool:
        """Write ``file`` into ``spare`` instead: renamed to a temporary name of ``file``'s
        own, cut to the file's size, the front written again, registered if it is not. False
        (the spare removed) when it cannot be renamed or cut; ``OSError`` once it is
        ``file``'s (already of the file's size, as the staged path then needs)."""
        final = file.final.path
        temp = os.path.join(
            os.path.dirname(final),
            publish.temp_name(os.path.basename(final), stem_of(self._snapshot_files.location)),
        )
        with traced(self._trace, "setup.map.spare", layout.file_size):
            try:
                os.rename(spare.path, temp)
                spare.path = temp
                spare.mapped.shrink_file(layout.file_size)
            except OSError:
                spare.discard()  # removed by someone: make the file as usual
                return False
            file.adopt(spare.mapped.fd, temp)
            self._mapped_files.append(spare.mapped)
            self._write_front(file, layout)
        if register and not spare.mapped.registered:
            with traced(self._trace, "setup.map.register", spare.mapped.file_size):
                spare.mapped.register()
        return True

    def _write_front(self, file: LocalFile, layout: fmt.FileLayout) -> None:
        """The header and the tensors known before any data (the page cache's way)."""
        file.write(0, memoryview(layout.header))
        for entry in layout.entries:
            static = self._snapshot_files.static_bytes(entry)
            if static is not None:
                file.write(entry.begin, memoryview(static))

    def _mapping_refusal(self, register: bool) -> str | None:
        """Why this snapshot's data should not go by mapping (``None``: it should)."""
        if not self._memory_backed:
            # On a disk the mapping would only move the page cache's copy: O_DIRECT writes
            # from pinned memory are the faster path there.
            return "not a memory-backed file"
        snapshot_files = self._snapshot_files
        layer_bytes = len(snapshot_files.names) * snapshot_files.num_blocks
        layer_bytes *= snapshot_files.page_bytes
        if layer_bytes < tuning.MAPPED_WRITE_MIN_BYTES:
            return (
                f"{layer_bytes} layer bytes, under the {tuning.MAPPED_WRITE_MIN_BYTES} for "
                "which registering the file pays"
            )
        return cuda_unavailable_reason() if register else None

    def mapped_arrays(self) -> list[np.ndarray]:
        if not self.mapped:
            raise RuntimeError("the files are not mapped")
        arrays = [mapped.array for mapped in self._mapped_files]
        assert all(array is not None for array in arrays)
        return arrays  # type: ignore[return-value]

    def _unmap(self) -> None:
        """Unregister and unmap every mapped file (the caller's copies into them are done)."""
        mapped_files, self._mapped_files = self._mapped_files, []
        for mapped in mapped_files:
            mapped.close()

    # -- data ----------------------------------------------------------------------------

    def write(self, shard: int, offset: int, view: np.ndarray) -> concurrent.futures.Future[None]:
        return self._writes.submit(
            self._gate.guarded(self.write_data, self.files[shard], offset, view)
        )

    def write_data(self, file: LocalFile, offset: int, view: np.ndarray) -> None:
        with traced(self._trace, "write", view.nbytes):
            self._write_parts(file, offset, view)

    def _write_parts(self, file: LocalFile, offset: int, view: np.ndarray) -> None:
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
                    with self._counts_lock:
                        self.direct_bytes += body
                        self._buffered_bytes += len(data) - body
                    return
            else:
                self._unaligned_buffers = True
        file.write(offset, data)
        with self._counts_lock:
            self._buffered_bytes += len(data)

    def partial_direct_reason(self) -> str | None:
        if not self._buffered_bytes:
            return None
        total = self.direct_bytes + self._buffered_bytes
        why = []
        page = self._snapshot_files.page_bytes
        if page % fmt.DATA_ALIGNMENT:
            why.append(f"pages of {page} bytes are not multiples of {fmt.DATA_ALIGNMENT}")
        if self._unaligned_buffers:
            why.append(f"some caller buffers were not {fmt.DATA_ALIGNMENT}-aligned")
        cause = "; ".join(why) or "unaligned boundaries"
        return f"{self._buffered_bytes} of {total} KV bytes went through the page cache ({cause})"

    # -- commit --------------------------------------------------------------------------

    def finish(self, drain: Callable[[], None]) -> None:
        with traced(self._trace, "commit.drain"):
            drain()
        self._gate.raise_error()
        # A mapped file stays mapped and registered until it is published: the trailer's
        # writes reach the same pages, and the unregistering waits for the background.
        snapshot_files = self._snapshot_files
        with traced(self._trace, "commit.checksums"):
            for shard, (file, layout) in enumerate(
                zip(self.files, snapshot_files.layouts, strict=True)
            ):
                for entry in layout.entries:
                    if entry.name == fmt.BLOCK_CHECKSUMS_TENSOR:
                        file.write(entry.begin, memoryview(snapshot_files.block_checksums()))
                    elif entry.name == fmt.PAGE_DIGESTS_TENSOR:
                        data = snapshot_files.page_digest_bytes(shard)
                        file.write(entry.begin, memoryview(data))
                trailer = layout.by_name[fmt.CHECKSUMS_TENSOR]
                file.write(trailer.begin, memoryview(snapshot_files.trailer(shard)))
                signature = layout.by_name.get(fmt.SIGNATURE_TENSOR)
                if signature is not None:
                    file.write(signature.begin, memoryview(snapshot_files.signature(shard)))
        with traced(self._trace, "commit.fsync"):
            for file in self.files:
                file.sync()

    def publish(self) -> None:
        snapshot_files = self._snapshot_files
        with traced(self._trace, "commit.publish"):
            stale = overwrite.stale_files(
                snapshot_files.location, snapshot_files.finals, snapshot_files.sharded
            )
            for file in self.files:
                file.publish()
            publish.fsync_directory(os.path.dirname(snapshot_files.location.path))
            self.files = []
            if snapshot_files.sharded:
                publish.publish_to(snapshot_files.index_location, snapshot_files.index_bytes())
            overwrite.remove_quietly(stale)
        if self._mapped_files:
            with traced(self._trace, "commit.release"):
                self._release_mappings()

    def _release_mappings(self) -> None:
        """After the publish: the mappings unregistered and unmapped in the background, and a
        spare file made in the background for the directory's next capture (a single file)."""
        mapped_files, self._mapped_files = self._mapped_files, []
        release_later(mapped_files)
        snapshot_files = self._snapshot_files
        if len(snapshot_files.finals) == 1:
            location = snapshot_files.location
            spare_files().replenish(
                location.path,
                stem_of(location),
                snapshot_files.layouts[0].file_size,
                self._registering,
            )

    # -- abort ---------------------------------------------------------------------------

    def unlink_temporaries(self) -> None:
        for file in self.files:
            file.unlink_temp()

    def shutdown(self, cancel: bool) -> None:
        self._writes.shutdown(wait=True, cancel_futures=cancel)

    def discard(self) -> None:
        self._unmap()
        for file in self.files:
            file.discard()
