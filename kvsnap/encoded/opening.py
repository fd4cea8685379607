"""An encoded snapshot opened as the ordinary snapshot it stands for (:class:`EncodedSnapshot`,
what ``kvsnap.Snapshot`` holds): an fp8 file with page checks opened without reading a page
(:mod:`kvsnap.encoded.fp8_open`; a restore into CUDA caches needs no more), any other use of it,
and any other encoded file, decoded into an array that kvsnap's readers open as a file held in
memory (:func:`~kvsnap.store.read.head_parts.open_held`: served from that array, not a copy),
dropped again on close."""

from __future__ import annotations

import os
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from kvsnap import format as fmt
from kvsnap.encoded.file import EncodedFile, EncodedInfo
from kvsnap.encoded.fp8_open import OpenFp8File, open_fp8_file
from kvsnap.encoded.original import read_local
from kvsnap.encoded.read import check_signature, decode, is_encoded, parse_encoded
from kvsnap.errors import SignatureError, SnapshotCorruptError
from kvsnap.format.constants import KEY_ID_BYTES, SIGNATURE_TENSOR
from kvsnap.format.signing import KeyRing
from kvsnap.store.read.head_parts import HeadPart, OpenedSnapshot, open_held

#: Threads decoding lossless chunks.
DECODE_THREADS = 2


def _local_path(path: str | os.PathLike[str]) -> str | None:
    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        return None
    return text.removeprefix("file://")


def open_decoded(
    path: str | os.PathLike[str], keys: KeyRing | None = None
) -> tuple[np.ndarray, EncodedFile] | None:
    """``(the decoded file's bytes, the encoded file)`` when ``path`` is a local encoded
    snapshot (checked, with ``keys`` its signature), else ``None``."""
    local = _local_path(path)
    if local is None or not os.path.isfile(local):
        return None
    with open(local, "rb") as stream:
        prefix = stream.read(4096)
    if not _may_be_encoded(prefix):
        return None
    data = read_local(local)
    if not is_encoded(data):
        return None
    return _decoded(data, local, keys)


def _decoded(data: np.ndarray, local: str, keys: KeyRing | None) -> tuple[np.ndarray, EncodedFile]:
    """The encoded file held in ``data`` checked whole and decoded, read-only: the readers
    serve the decoded file from this array, so nothing may write it while it is open."""
    encoded = parse_encoded(data, local, keys)
    with ThreadPoolExecutor(DECODE_THREADS) as executor:
        decoded = decode(encoded, executor)
    decoded.flags.writeable = False
    return decoded, encoded


def _may_be_encoded(prefix: bytes) -> bool:
    """A cheap first look: does the header's kvsnap metadata start with version 3?"""
    return b'format_version\\":3' in prefix


@dataclass(frozen=True)
class DecodedSnapshot:
    """An encoded snapshot opened as the ordinary one it decodes to."""

    #: The decoded file, opened (held in memory: closing it drops the decoded bytes).
    opened: OpenedSnapshot
    #: The encoded file it was decoded from.
    encoded: EncodedFile


def _opened_decoded(
    decoded: np.ndarray, encoded: EncodedFile, local: str, verify: bool
) -> DecodedSnapshot:
    """The decoded file ``decoded`` opened under the name of the encoded file ``local`` it
    was decoded from: its errors and ``part_files`` name the file the caller opened."""
    return DecodedSnapshot(open_held(decoded, local, verify=verify), encoded)


class EncodedSnapshot:
    """An encoded snapshot as ``kvsnap.Snapshot`` holds it (and ``Pipeline.restore`` of its
    path restores it: :mod:`kvsnap.encoded.path_restore`): the path it was opened by, the
    metadata of the ordinary snapshot it stands for, and that snapshot's parts, decoded on
    first need.

    An fp8 file with page checks opens without reading a page (``fp8_file``): a restore into
    CUDA caches moves its pages as they are stored, and only another use (a CPU restore,
    reading tensors, ``verify``) decodes it, reading the whole file through the descriptor
    opened first, so it is the same file. Any other encoded file is decoded at open."""

    def __init__(
        self,
        path: str,
        keys: KeyRing | None,
        verify: bool,
        *,
        fp8_file: OpenFp8File | None = None,
        decoded: DecodedSnapshot | None = None,
    ) -> None:
        #: The path it was opened by, as the caller gave it (what a restore's errors name).
        self.path = path
        self._keys = keys
        self._verify = verify
        self.fp8_file = fp8_file
        self._decoded = decoded

    def decoded(self) -> DecodedSnapshot:
        """The decoded snapshot, decoded now if it was not yet."""
        if self._decoded is None:
            assert self.fp8_file is not None
            whole = self.fp8_file.read(0, self.fp8_file.layout.file_size)
            decoded, encoded = _decoded(whole, self.fp8_file.path, self._keys)
            if encoded.layout.document != self.fp8_file.layout.document:
                raise SnapshotCorruptError("changed since it was opened", file=encoded.file)
            self._decoded = _opened_decoded(decoded, encoded, self.fp8_file.path, self._verify)
        return self._decoded

    @property
    def encoded(self) -> EncodedInfo:
        """The encoded file: opened by pages (``OpenFp8File``) or read whole."""
        if self.fp8_file is not None:
            return self.fp8_file
        return self.decoded().encoded

    @property
    def metadata(self) -> fmt.SnapshotMetadata:
        if self.fp8_file is not None:
            return self.fp8_file.metadata
        return self.decoded().opened.metadata

    @property
    def format_version(self) -> int:
        if self.fp8_file is not None:
            # The decoded file is one ordinary file: its version follows from its metadata,
            # which the open read (no page need be decoded for it).
            return self.fp8_file.metadata.format_version
        return self.decoded().opened.format_version

    @property
    def parts(self) -> tuple[HeadPart, ...]:
        return self.decoded().opened.parts

    @property
    def index(self) -> fmt.PartsIndex | None:
        return None

    @property
    def signature_algorithm(self) -> str | None:
        """The encoded file's own signature algorithm (``None``: unsigned): its decoded file
        is unsigned by design, the encoded file's signature covers it."""
        algorithm = self.encoded.encoding.get("signature")
        return None if algorithm is None else str(algorithm)

    def signing_key_ids(self) -> list[str | None]:
        """The hex id of the key that signed the encoded file, unchecked, as a list of one
        (``[None]``: unsigned)."""
        if self.signature_algorithm is None:
            return [None]
        stored = self.fp8_file if self.fp8_file is not None else self.decoded().encoded
        return [stored.tensor(SIGNATURE_TENSOR)[:KEY_ID_BYTES].tobytes().hex()]

    def signature_problems(self, keys: KeyRing) -> list[SignatureError]:
        """Why ``keys`` do not vouch for the encoded file (empty when they do): its own
        signature, which covers the decoded file (unsigned itself)."""
        encoded = self.decoded().encoded
        try:
            check_signature(encoded, encoded.data[: encoded.layout.data_start].tobytes(), keys)
        except SignatureError as error:
            return [error]
        return []

    def close(self) -> None:
        if self._decoded is not None:
            self._decoded.opened.close()
        if self.fp8_file is not None:
            self.fp8_file.close()


#: Files an encoded open succeeded on, by identity (device, inode, size, modification time):
#: :func:`open_known_encoded` opens them as encoded first, without the ordinary open's try.
_KNOWN: OrderedDict[tuple[int, int, int, int], None] = OrderedDict()
_KNOWN_MAX = 256


def _identity(status: os.stat_result) -> tuple[int, int, int, int]:
    return (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)


def open_known_encoded(
    path: str | os.PathLike[str], keys: KeyRing | None, *, verify: bool
) -> EncodedSnapshot | None:
    """:func:`open_encoded` of ``path`` when that very file (by identity) opened as an fp8
    snapshot before in this process (an engine's hits), else ``None`` at the cost of one
    ``stat`` (none while no encoded file was opened)."""
    local = _local_path(path) if _KNOWN else None
    if local is None:
        return None
    try:
        identity = _identity(os.stat(local))
    except OSError:
        return None
    if identity not in _KNOWN:
        return None
    return open_encoded(path, keys, verify=verify)


def open_encoded(
    path: str | os.PathLike[str], keys: KeyRing | None, *, verify: bool
) -> EncodedSnapshot | None:
    """``path`` opened as an :class:`EncodedSnapshot` when it is a local encoded snapshot (its
    signature checked with ``keys``), else ``None``."""
    local = _local_path(path)
    if local is None:
        return None
    fp8_file = open_fp8_file(local, keys)
    if fp8_file is not None:
        _KNOWN[_identity(fp8_file.status)] = None
        if len(_KNOWN) > _KNOWN_MAX:
            _KNOWN.popitem(last=False)
        return EncodedSnapshot(os.fspath(path), keys, verify, fp8_file=fp8_file)
    decoded = open_decoded(path, keys)
    if decoded is None:
        return None
    opened = _opened_decoded(*decoded, local, verify)
    return EncodedSnapshot(os.fspath(path), keys, verify, decoded=opened)
