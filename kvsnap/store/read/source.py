"""Random-access reads of one snapshot file, and the per-block checksum check."""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvsnap import format as fmt
from kvsnap.errors import (
    NotASnapshotError,
    SnapshotCorruptError,
    SnapshotIOError,
)
from kvsnap.store.base import tuning
from kvsnap.store.files.location import (
    Location,
    io_error,
    open_regular,
)
from kvsnap.store.hot.residency import resident
from kvsnap.store.read import kvikio_reads
from kvsnap.store.read.kvikio_reads import KvikioFile


def _open_direct_reader(path: str, status: os.stat_result) -> int | None:
    """A second, O_DIRECT descriptor on the same file (``status``) for aligned reads, or ``None``
    where the filesystem refuses (or the path meanwhile names another file)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | flag | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    again = os.fstat(fd)
    if (again.st_dev, again.st_ino) != (status.st_dev, status.st_ino):
        os.close(fd)
        return None
    return fd


def check_blocks(
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


def check_page_digests(
    view: np.ndarray, page: int, table: np.ndarray, block: int, url: str, name: str
) -> None:
    """Raise :class:`SnapshotCorruptError` naming the first page of ``view`` (block ``block``
    onwards) whose BLAKE3 digest differs from the signed one in ``table`` (``(blocks, 32)``):
    a page changed after signing."""
    bad = fmt.page_digest_failures(view, page, table[block : block + len(view) // page])
    if len(bad):
        raise SnapshotCorruptError(
            "BLAKE3 digest does not match the signed page digest (changed after signing)",
            file=url,
            tensor=name,
            block=block + int(bad[0]),
        )


class Source:
    """Random-access reads of one file: ``pread`` for local files, seek+read for fsspec, or
    copies out of the file's bytes read whole at open (``read_whole_max_bytes``) or held in
    memory already (``location.held``)."""

    def __init__(
        self, location: Location, *, inside: str | None = None, read_whole_max_bytes: int = 0
    ) -> None:
        """Open ``location``; a local file must resolve into the real directory ``inside``
        when given (:func:`~kvsnap.store.files.location.open_regular`). A local file of at most
        ``read_whole_max_bytes`` bytes is read whole here, with one ``preadv``, and every
        later read of it is a copy out of those bytes: one version of the file, read once
        (:attr:`holds_whole`). A file held in memory (``location.held``) is served the same
        way from that very array, never copied: it is the caller's not to change while the
        source is open, and :meth:`close` drops the source's reference to it."""
        # The path, not the location: a held location's array is let go at close.
        self._path = location.path
        self.url = location.url
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._direct_fd: int | None = None
        self._handle: Any = None
        self._status: os.stat_result | None = None
        self._kvikio: KvikioFile | None = None
        self._whole: np.ndarray | None = None
        #: Ranges read once and kept (:meth:`keep`): ``(offset, bytes)``.
        self._kept: list[tuple[int, bytes]] = []
        try:
            if location.held is not None:
                self._whole = location.held
                self.size = len(location.held)
            elif location.is_local:
                self._fd, status = open_regular(location, inside=inside)
                self._status = status
                self.size = status.st_size
                if 0 < status.st_size <= read_whole_max_bytes:
                    self._whole = self._read_whole(status.st_size)
                elif tuning.COLD_READS_DIRECT:
                    self._direct_fd = _open_direct_reader(location.path, status)
            else:
                self._handle = location.fs.open(location.path, "rb", cache_type="none")
                # An open file knows its size (object stores looked it up to open it): asking
                # the filesystem again would be another request per file.
                size = getattr(self._handle, "size", None)
                if not isinstance(size, int):
                    try:
                        size = int(location.fs.size(location.path))
                    except BaseException:
                        self.close()
                        raise
                self.size = size
        except FileNotFoundError as error:
            self.close()
            raise SnapshotIOError("no such file", file=self.url) from error
        except IsADirectoryError as error:
            self.close()
            raise NotASnapshotError("is a directory", file=self.url) from error
        except OSError as error:
            self.close()
            raise io_error("opening", self.url, error) from error

    def _read_whole(self, size: int) -> np.ndarray:
        """The open local file's ``size`` bytes, read with one ``preadv`` (more only where the
        kernel returns fewer bytes; a file cut short leaves the rest unread, and a read there
        fails as a short file's would)."""
        assert self._fd is not None
        whole = np.empty(size, dtype=np.uint8)
        done = 0
        while done < size:
            count = os.preadv(self._fd, [memoryview(whole)[done:]], done)
            if count <= 0:
                break
            done += count
        return whole[:done]

    def held(self, offset: int, size: int) -> np.ndarray | None:
        """The file's bytes ``[offset, offset + size)`` as a view of those read whole at open
        (or held in memory), valid while the source is open; ``None`` when the file was not
        read whole or is shorter."""
        whole = self._whole
        if whole is None or offset + size > len(whole):
            return None
        return whole[offset : offset + size]

    def keep(self, offset: int, data: bytes) -> None:
        """Serve every later read that lies within ``[offset, offset + len(data))`` from
        ``data`` (bytes of this file read once, a signature checked over them): such a read
        gets exactly those bytes, whatever the file holds by then."""
        self._kept.append((offset, data))

    def _kept_bytes(self, offset: int, size: int) -> memoryview | None:
        """The kept bytes ``[offset, offset + size)``, if one kept range holds them all."""
        for start, data in self._kept:
            if start <= offset and offset + size <= start + len(data):
                return memoryview(data)[offset - start : offset - start + size]
        return None

    @property
    def holds_whole(self) -> bool:
        """Whether the file was read whole at open (or is held in memory) and every read is
        served from those bytes."""
        return self._whole is not None

    @property
    def concurrent(self) -> bool:
        """Whether several threads may read at once (``pread`` on a local descriptor, or
        copies out of the bytes held)."""
        return self._fd is not None or self._whole is not None

    def local_file(self) -> tuple[str, int, os.stat_result] | None:
        """A local file's path, open descriptor and its ``fstat`` at open; ``None`` for fsspec
        files or once closed."""
        if self._fd is None or self._status is None:
            return None
        return self._path, self._fd, self._status

    def kvikio_file(self, threads: int) -> KvikioFile | None:
        """kvikio's handle on this local file (opened on first use, closed with the source), or
        ``None``: kvikio is off or missing, the file is not local, or cold ranges are read with
        O_DIRECT (``tuning.COLD_READS_DIRECT``), which only :meth:`read_into` decides."""
        if (
            self._fd is None
            or self._direct_fd is not None
            or self._whole is not None
            or not kvikio_reads.available(threads)
        ):
            return None
        with self._lock:
            if self._kvikio is None:
                self._kvikio = KvikioFile(self._fd, threads)
            return self._kvikio

    def read_into(self, offset: int, out: memoryview, *, tensor: str | None = None) -> None:
        """Fill ``out`` from ``offset``; a short file is a :class:`SnapshotCorruptError`."""
        wanted = len(out)
        done = 0
        if self._kept:
            kept = self._kept_bytes(offset, wanted)
            if kept is not None:
                out[:] = kept
                return
        try:
            if self._whole is not None:
                done = max(0, min(wanted, len(self._whole) - offset))
                if done:
                    np.frombuffer(out, dtype=np.uint8)[:done] = self._whole[offset : offset + done]
            elif self._fd is not None:
                address = np.frombuffer(out, dtype=np.uint8).ctypes.data if wanted else 0
                while done < wanted:
                    direct = self._direct_fd is not None and not (
                        (offset + done) % fmt.DATA_ALIGNMENT
                        or (wanted - done) % fmt.DATA_ALIGNMENT
                        or (address + done) % fmt.DATA_ALIGNMENT
                    )
                    count = self._read_local(out[done:], offset + done, direct)
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
            raise io_error("reading", self.url, error) from error
        if done < wanted:
            raise SnapshotCorruptError(
                f"file ended at byte {offset + done}, {wanted - done} bytes short (truncated?)",
                file=self.url,
                tensor=tensor,
            )

    def _read_local(self, out: memoryview, offset: int, direct: bool) -> int:
        """One ``preadv`` into ``out`` at ``offset``: through the page cache, or with ``direct``
        (an aligned range, cold reads set to O_DIRECT) through O_DIRECT unless the page cache
        holds the whole range: a page-cached file is never read through O_DIRECT, which would
        go to the disk for bytes already in memory."""
        assert self._fd is not None
        if not direct or resident(self._fd, offset, len(out)):
            return os.preadv(self._fd, [out], offset)
        assert self._direct_fd is not None
        return os.preadv(self._direct_fd, [out], offset)

    def read(self, offset: int, size: int, *, tensor: str | None = None) -> bytes:
        """``size`` bytes from ``offset``; a short file is a :class:`SnapshotCorruptError`."""
        if self._whole is not None and offset + size <= len(self._whole):
            return self._whole[offset : offset + size].tobytes()
        if self._kept:
            kept = self._kept_bytes(offset, size)
            if kept is not None:
                return kept.tobytes()
        buffer = bytearray(size)
        self.read_into(offset, memoryview(buffer), tensor=tensor)
        return bytes(buffer)

    def close(self) -> None:
        self._whole = None
        self._kept = []
        if self._kvikio is not None:
            self._kvikio.close()
            self._kvikio = None
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


@dataclass(slots=True)
class OpenFile:
    """One open file of a snapshot and its checked layout."""

    source: Source
    layout: fmt.FileLayout
