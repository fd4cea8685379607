"""The three forms a snapshot takes in storage, told apart in one step.

A snapshot written to ``NAME.safetensors`` is stored as

- *single*: the one file ``NAME.safetensors``;
- *sharded*: the index ``NAME.safetensors.index.json`` naming shards beside it
  (:func:`kvsnap.format.shard_file_name`);
- *parted*: the same index name, listing part files beside it, one per head range
  (:mod:`kvsnap.format.parts`).

Either name designates the snapshot. The index commits the two indexed forms; while one form
replaces another both names exist for a moment, and the single file is then the snapshot (a
writer publishes the new form before it removes the old one).

Whatever needs to know what a path holds asks this module: :func:`committed_file` finds the
file that commits a snapshot with at most two stats, :func:`resolve` adds at most one read of
the index and says which form it is and which files hold the data, and :func:`open_retrying`
is the one loop that starts an open over when a replacement removed a file it was about to
open. The caller opens each member file once.
"""

from __future__ import annotations

import enum
import errno
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kvsnap import format as fmt
from kvsnap.errors import KVSnapError, NotASnapshotError, SnapshotIOError
from kvsnap.store.files.location import (
    INDEX_SUFFIX,
    SAFETENSORS_SUFFIX,
    Location,
    io_error,
    missing_member,
    open_regular,
    real_directory,
)

__all__ = [
    "OPEN_ATTEMPTS",
    "Committed",
    "Form",
    "Resolved",
    "committed_file",
    "index_members",
    "is_index_name",
    "open_retrying",
    "read_index",
    "resolve",
    "snapshot_names",
    "snapshot_stem",
]

#: Opens of a snapshot that is being replaced, before a vanished file is an error.
OPEN_ATTEMPTS = 3

_T = TypeVar("_T")


class Form(enum.Enum):
    """How a snapshot is stored."""

    SINGLE = "single"
    SHARDED = "sharded"
    PARTED = "parted"


@dataclass(frozen=True)
class Committed:
    """The file whose presence commits a snapshot: ``NAME.safetensors``, or its index
    (``indexed``; the index says whether sharded or parted). ``status`` is the ``stat`` that
    found it (local files), ``size`` its size in bytes."""

    location: Location
    indexed: bool
    status: os.stat_result | None
    size: int | None


@dataclass(slots=True)
class Resolved:
    """What a path holds: the form, the data files (``members``, in order), and for the
    indexed forms the index's location and its parsed, checked content.

    ``status`` is the ``stat`` of the committing file that resolving took (the single file's,
    or the index's ``fstat`` as it was read; ``None`` on fsspec). ``directory`` is the real
    directory of a local index: its members must resolve into it (an index only ever names
    files beside it), which their opener checks on the open descriptor.
    """

    form: Form
    location: Location
    members: tuple[Location, ...]
    index_location: Location | None = None
    index: fmt.ShardIndex | fmt.PartsIndex | None = None
    status: os.stat_result | None = None
    directory: str | None = None

    @classmethod
    def single(cls, location: Location, directory: str | None = None) -> Resolved:
        """The single-file snapshot at ``location``, known without a look (a part an index
        names: ``directory`` is that index's)."""
        return cls(Form.SINGLE, location, (location,), directory=directory)


def is_index_name(name: str) -> bool:
    """Whether ``name`` (a file name, path or URL) names a snapshot's index."""
    return name.endswith(INDEX_SUFFIX)


def snapshot_stem(name: str) -> str:
    """``name`` (a snapshot's file or index name) without ``.safetensors[.index.json]``."""
    if is_index_name(name):
        name = name[: -len(INDEX_SUFFIX)]
    return name[: -len(SAFETENSORS_SUFFIX)] if name.endswith(SAFETENSORS_SUFFIX) else name


def snapshot_names(location: Location) -> tuple[Location, Location]:
    """The two names of the snapshot ``location`` names (either of them): the single file
    ``NAME.safetensors`` and the index ``NAME.safetensors.index.json``. Nothing is read."""
    if not is_index_name(location.path):
        return location, location.with_suffix(INDEX_SUFFIX)
    cut = len(INDEX_SUFFIX)
    return Location(location.url[:-cut], location.path[:-cut], location.fs), location


def committed_file(location: Location, *, regular: bool = False) -> Committed | None:
    """The file that commits the snapshot ``location`` names, as :func:`resolve` would find
    it: for ``NAME.safetensors`` that file when something is there (a regular file with
    ``regular``), else its index when that is a regular file; for an index name, the index.
    ``None`` when there is none. At most two ``stat`` calls; a name that cannot be looked at
    counts as absent."""
    single, index = snapshot_names(location)
    candidates = (single, index) if location is single else (index,)
    for candidate in candidates:
        found = _look(candidate, indexed=candidate is index)
        named = candidate is location
        if found is not None and (_is_regular(found) or (named and not regular)):
            return found
    return None


def _look(location: Location, *, indexed: bool) -> Committed | None:
    """One ``stat`` (fsspec: ``info``) of ``location``; ``None`` when it cannot be had."""
    try:
        return _stat(location, indexed)
    except (OSError, SnapshotIOError):
        return None


def _stat(location: Location, indexed: bool) -> Committed | None:
    """One ``stat`` (fsspec: ``info``) of ``location``; ``None`` when nothing is there. Raises
    ``OSError`` (local) or :class:`SnapshotIOError` (fsspec) when it cannot tell."""
    if location.is_local:
        try:
            status = os.stat(location.path)
        except FileNotFoundError:
            return None
        return Committed(location, indexed, status, status.st_size)
    try:
        info = location.fs.info(location.path)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise SnapshotIOError(
            f"cannot check whether it exists ({error})", file=location.url
        ) from error
    regular = info.get("type") == "file"
    return Committed(location, indexed, None, int(info.get("size") or 0) if regular else None)


def _is_regular(found: Committed) -> bool:
    if found.status is not None:
        return stat.S_ISREG(found.status.st_mode)
    return found.size is not None


def resolve(location: Location) -> Resolved:
    """Which form the snapshot ``location`` names is stored in, and its data files.

    A name ending ``.index.json`` is read as an index; otherwise one ``stat`` looks for the
    single file, and only when nothing is there is the index read. Anything at the single
    file's name is that form (opening it refuses what is not a regular file); a name that
    cannot be looked at is left to the open to report. Raises :class:`SnapshotIOError` from
    ``FileNotFoundError`` when neither name is there, and what :func:`read_index` raises for an
    index that is not one.
    """
    if location.path.endswith(INDEX_SUFFIX):
        return _indexed(location, location)
    if location.is_local:
        try:
            # On the warm path of every restore: one stat, no object but the answer.
            return Resolved(Form.SINGLE, location, (location,), status=os.stat(location.path))
        except FileNotFoundError:
            pass  # no single file under that name: a sharded or parted index, below
        except OSError:
            return Resolved(Form.SINGLE, location, (location,))  # the open says why
    elif _stat(location, indexed=False) is not None:
        return Resolved(Form.SINGLE, location, (location,))
    try:
        return _indexed(location, location.with_suffix(INDEX_SUFFIX))
    except SnapshotIOError as error:
        if isinstance(error.__cause__, FileNotFoundError):
            raise SnapshotIOError("no such file", file=location.url) from error.__cause__
        raise


def _indexed(location: Location, index_location: Location) -> Resolved:
    raw, status, directory = _read_index_file(index_location, keep_atime=False)
    index = _parse_index(raw, index_location.url)
    form = Form.PARTED if isinstance(index, fmt.PartsIndex) else Form.SHARDED
    members = tuple(index_location.sibling(name) for name in _member_names(index))
    return Resolved(form, location, members, index_location, index, status, directory)


def read_index(
    index_location: Location, *, keep_atime: bool = False
) -> fmt.ShardIndex | fmt.PartsIndex:
    """The index at ``index_location`` read (one open, one ``fstat``, one read), parsed and
    checked, sharded or parted. ``keep_atime`` reads without moving its access time where
    this process may (``O_NOATIME``: it owns the file), so listing a store does not make a
    parted chunk look used. Raises :class:`SnapshotIOError` (from ``FileNotFoundError`` when
    it is not there), :class:`NotASnapshotError` for anything but a regular file of at most
    :data:`kvsnap.format.MAX_INDEX_BYTES`, and the decoders' errors."""
    raw, _, _ = _read_index_file(index_location, keep_atime=keep_atime)
    return _parse_index(raw, index_location.url)


def index_members(index_location: Location) -> tuple[str, ...] | None:
    """The file names the index at ``index_location`` lists (shards or parts), in order;
    ``()`` for an index that cannot be read or is no index, ``None`` when there is none."""
    try:
        return _member_names(read_index(index_location))
    except KVSnapError as error:
        return None if _vanished(error) else ()


def _member_names(index: fmt.ShardIndex | fmt.PartsIndex) -> tuple[str, ...]:
    if isinstance(index, fmt.PartsIndex):
        return tuple(part.file for part in index.parts)
    return index.files


def _parse_index(raw: bytes, url: str) -> fmt.ShardIndex | fmt.PartsIndex:
    if fmt.is_parts_index(raw):
        return fmt.decode_parts_index(raw, file=url)
    return fmt.decode_index(raw, file=url)


def _read_index_file(
    location: Location, *, keep_atime: bool
) -> tuple[bytes, os.stat_result | None, str | None]:
    """The bytes of the index at ``location``, its ``fstat`` and its real directory (local
    files), refusing anything larger than :data:`kvsnap.format.MAX_INDEX_BYTES`."""
    limit = fmt.MAX_INDEX_BYTES
    try:
        if location.is_local:
            fd, status, directory = _open_index(location, keep_atime)
            with os.fdopen(fd, "rb") as handle:
                if status.st_size > limit:
                    raise NotASnapshotError(
                        f"{status.st_size} bytes is too large for an index", file=location.url
                    )
                return handle.read(limit + 1), status, directory
        size = location.fs.size(location.path)
        if size is not None and size > limit:
            raise NotASnapshotError(f"{size} bytes is too large for an index", file=location.url)
        return bytes(location.fs.cat_file(location.path)), None, None
    except FileNotFoundError as error:
        raise SnapshotIOError("no such file", file=location.url) from error
    except OSError as error:
        raise io_error("reading", location.url, error) from error


def _open_index(location: Location, keep_atime: bool) -> tuple[int, os.stat_result, str]:
    """The local index ``location`` open, its ``fstat``, and the real directory its members
    must resolve into: the directory of the index's name (an index names files beside it)."""
    try:
        fd, status = open_regular(location, keep_atime=keep_atime, follow=False)
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        # The index is a symbolic link: its members lie beside the link, not its target.
        fd, status = open_regular(location, keep_atime=keep_atime)
        return fd, status, os.path.realpath(os.path.dirname(location.path))
    # Not a link: the descriptor tells its directory without an lstat per path component.
    return fd, status, real_directory(fd, location.path)


def open_retrying(
    location: Location,
    attempt: Callable[[Resolved], _T],
    *,
    attempts: int = OPEN_ATTEMPTS,
    pause_s: float = 0.0,
    missing: Callable[[Exception], bool] | None = None,
) -> _T:
    """``attempt(resolve(location))``, from the start again (up to ``attempts`` times in all)
    when a file it was about to open vanished: the snapshot was replaced meanwhile, and the
    replacement's index (or single file) names only files that exist. ``attempt`` closes
    whatever it opened before it raises. A member still missing at the last attempt makes the
    snapshot incomplete (:func:`~kvsnap.store.files.location.missing_member`).

    The package's one retry loop: a caller that expects a missing file back (a chunk a pruner
    set aside for an instant) passes ``pause_s`` to wait between attempts, and ``missing``,
    which errors mean a file is not there (default: a :class:`SnapshotIOError` caused by
    ``FileNotFoundError``)."""
    vanished = _vanished if missing is None else missing
    for number in range(1, attempts + 1):
        try:
            return attempt(resolve(location))
        except Exception as error:
            if not vanished(error):
                raise
            if number == attempts:
                if not isinstance(error, SnapshotIOError):
                    raise
                raise missing_member(error, *snapshot_names(location)) from error.__cause__
            if pause_s:
                time.sleep(pause_s)
    raise AssertionError("unreachable: the last attempt returns or raises")


def _vanished(error: Exception) -> bool:
    """Whether ``error`` says a file was not there (it vanished, or never was)."""
    return isinstance(error, SnapshotIOError) and isinstance(error.__cause__, FileNotFoundError)
