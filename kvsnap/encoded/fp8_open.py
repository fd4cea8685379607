"""An fp8 snapshot opened without reading its pages: what a restore into CUDA caches needs.

An fp8 file with page checks (docs/format.md, "Encoded snapshots") opens here by reading its
header and every tensor but the e4m3 values (the decoded file's header and metadata tensors,
the scales, each page's xxh3-64 and, signed, its BLAKE3-256: a few KiB per MiB of KV),
checking those against the trailer and, with keys, the signature, and the scales as a
quantizer writes them. The values are never read by the host here: a restore moves them to the
device (out of the hot tier's registered mapping of the file, or read from the descriptor) and
checks each page there against its stored digest before dequantizing it
(:mod:`kvsnap.encoded.device_restore`). Anything else (a CPU restore, reading tensors,
``verify``) decodes the whole file on the host, through the same descriptor, checked whole.

The descriptor stays open until :meth:`OpenFp8File.close`: every read, and the hot tier's
mapping, is of the very file whose header and checks were read here, however the path is
renamed or replaced meanwhile.
"""

from __future__ import annotations

import os
import stat
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import xxhash

from kvsnap import format as fmt
from kvsnap.encoded.file import EncodedInfo
from kvsnap.encoded.original import described_file
from kvsnap.encoded.read import check_signature_fields, check_signed_message, companions
from kvsnap.encoding.fp8_scales import check_scale_table
from kvsnap.errors import (
    NotASnapshotError,
    SnapshotCorruptError,
    SnapshotIOError,
    UnsupportedVersionError,
)
from kvsnap.format import encoded as enc
from kvsnap.format.hashing import decode_trailer, digest128
from kvsnap.format.signing import KeyRing
from kvsnap.store.read.members import loaded_metadata


@dataclass
class OpenFp8File(EncodedInfo):
    """An fp8 encoded file open by descriptor: its layout, every tensor but the fp8 values
    (``small``, checked), the decoded snapshot's metadata, and whether its pages are checked
    against signed digests (``signed_pages``: it was opened with keys)."""

    path: str
    fd: int
    status: os.stat_result
    layout: enc.EncodedLayout
    file: str | None
    header: bytes
    small: dict[str, np.ndarray]
    metadata: fmt.SnapshotMetadata
    signed_pages: bool
    #: Each fp8 tensor's checked scales, ``float32 (num_blocks, heads)``.
    scales: dict[str, np.ndarray] = field(default_factory=dict)

    def tensor(self, name: str) -> np.ndarray:
        """A stored tensor's bytes: any but the fp8 values (read them with :meth:`read`)."""
        array = self.small.get(name)
        if array is None:
            raise SnapshotCorruptError("not read at open", file=self.file, tensor=name)
        return array

    def read(self, begin: int, length: int) -> np.ndarray:
        """``length`` bytes of the file at ``begin``, read from the descriptor."""
        return _pread(self.fd, begin, length, self.file)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _pread(fd: int, begin: int, length: int, file: str | None) -> np.ndarray:
    out = np.empty(length, dtype=np.uint8)
    view = out.data
    done = 0
    try:
        while done < length:
            got = os.preadv(fd, [view[done:]], begin + done)
            if got == 0:
                raise SnapshotIOError(f"{file}: ends at byte {begin + done} (changed while read)")
            done += got
    except OSError as exc:
        raise SnapshotIOError(f"{file}: cannot read ({exc.strerror or exc})") from exc
    return out


def open_fp8_file(path: str, keys: KeyRing | None) -> OpenFp8File | None:
    """The local file ``path`` opened as above when it is an fp8 snapshot with page checks
    whose every layer tensor is stored fp8; ``None`` for any other file (which opens the usual
    way). Refuses (``SnapshotCorruptError``, signature errors) what it reads and finds wrong."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None  # the usual open says why
    try:
        opened = _open_fd(path, fd, keys)
    except BaseException:
        os.close(fd)
        raise
    if opened is None:
        os.close(fd)
    return opened


def _open_fd(path: str, fd: int, keys: KeyRing | None) -> OpenFp8File | None:
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode) or status.st_size < 8:
        return None
    length = int(_pread(fd, 0, 8, path).view("<u8")[0])
    if length > enc.MAX_HEADER_BYTES or 8 + length > status.st_size:
        return None
    header = _pread(fd, 0, 8 + length, path).tobytes()
    try:
        layout = enc.parse_header(header, status.st_size, path)
    except (NotASnapshotError, UnsupportedVersionError):
        return None  # not an encoded file: the usual open says what it is
    kinds = layout.encoding["tensors"]
    if (
        layout.encoding["name"] != "fp8"
        or not layout.page_checks
        or any(kind != "fp8" for kind in kinds.values())
    ):
        return None
    values = set(layout.fp8_names())
    small, digest = _read_small(fd, layout, values, path)
    key = (header, digest, None if keys is None else tuple(k.key_id for k in keys.keys))
    with _VERIFIED_LOCK:
        metadata = _VERIFIED.get(key)
    checked_before = metadata is not None
    if metadata is None:
        _check_trailer(layout, header, small, values, path)
        check_signature_fields(layout, path)
        if keys is not None:
            check_signed_message(layout, header, small.__getitem__, keys, path)
        metadata = _decoded_metadata(layout, small, path)
    opened = OpenFp8File(
        path, fd, status, layout, path, header, small, metadata, signed_pages=keys is not None
    )
    opened.scales.update(_checked_scales(opened, checked=checked_before))
    with _VERIFIED_LOCK:
        _VERIFIED[key] = metadata
        _VERIFIED.move_to_end(key)
        if len(_VERIFIED) > _VERIFIED_MAX:
            _VERIFIED.popitem(last=False)
    return opened


#: What an open checked, by (header, xxh3-128 of every tensor read, the keys' ids): the same
#: bytes opened again (an engine's hits) are not checked again, only read and digested. The
#: checks are functions of those bytes alone, so a hit can only be bytes that passed them.
_VERIFIED: OrderedDict[tuple[bytes, bytes, tuple[str, ...] | None], fmt.SnapshotMetadata] = (
    OrderedDict()
)
_VERIFIED_MAX = 64
_VERIFIED_LOCK = threading.Lock()


def _read_small(
    fd: int, layout: enc.EncodedLayout, values: set[str], path: str
) -> tuple[dict[str, np.ndarray], bytes]:
    """Every tensor but padding and the fp8 ``values``, read in one pread per run of tensors
    between two value tensors (an 8B-shape file: 65 reads, not 200), and the xxh3-128 of all
    the bytes read."""
    small: dict[str, np.ndarray] = {}
    digest = xxhash.xxh3_128()
    run: list[enc.StoredTensor] = []
    for tensor in (*layout.tensors, None):
        if tensor is not None and tensor.name not in values:
            run.append(tensor)
            continue
        if run:
            begin = run[0].begin
            span = _pread(fd, begin, run[-1].end - begin, path)
            digest.update(span)
            for stored in run:
                if not enc.is_padding(stored.name):
                    small[stored.name] = span[stored.begin - begin : stored.end - begin]
            run = []
    return small, digest.digest()


def _check_trailer(
    layout: enc.EncodedLayout,
    header: bytes,
    small: dict[str, np.ndarray],
    values: set[str],
    path: str,
) -> None:
    """The trailer's rows of the header and of every tensor read (the values' rows are not
    checked: each page is, against its stored digest, where a restore moves it)."""
    checked = layout.checksummed
    rows = decode_trailer(small[enc.ENCODED_CHECKSUMS_TENSOR].tobytes(), path)
    if len(rows) != len(checked) + 1 or rows[0] != digest128(header):
        raise SnapshotCorruptError("header checksum mismatch", file=path)
    for row, stored in zip(rows[1:], checked, strict=True):
        if stored.name not in values and digest128(small[stored.name]) != row:
            raise SnapshotCorruptError("checksum mismatch", file=path, tensor=stored.name)


def _decoded_metadata(
    layout: enc.EncodedLayout, small: dict[str, np.ndarray], path: str
) -> fmt.SnapshotMetadata:
    """The decoded snapshot's metadata: its header (stored whole) and metadata tensors (stored
    as they are), each layer tensor's shape and dtype matching what is stored for it."""
    original_header = small[enc.ORIGINAL_HEADER_TENSOR].tobytes()
    decoded = described_file(original_header, layout.encoding["decoded_bytes"], path)
    expected = [enc.ORIGINAL_HEADER_TENSOR]
    by_name = layout.by_name
    for entry in decoded.entries:
        if enc.is_padding(entry.name):
            continue
        if entry.name not in layout.encoding["tensors"]:
            expected.append(entry.name)
            continue
        if entry.dtype not in enc.FP8_DECODED_DTYPES:
            raise SnapshotCorruptError(
                f"fp8 pages cannot decode into {entry.dtype}", file=path, tensor=entry.name
            )
        for name, dtype, shape in companions(entry.name, entry.shape, layout.page_checks):
            stored = by_name.get(name)
            if stored is None or (stored.dtype, stored.shape) != (dtype, shape):
                found = "missing" if stored is None else f"stored as {stored.dtype} {stored.shape}"
                raise SnapshotCorruptError(
                    f"{found}, expected {dtype} {shape}", file=path, tensor=name
                )
            expected.append(name)
    present = [t.name for t in layout.checksummed]
    if present != expected:
        raise SnapshotCorruptError(
            f"holds tensors {present[:4]}..., expected {expected[:4]}...", file=path
        )
    return loaded_metadata(decoded.metadata, lambda name: small[name].tobytes(), path)


def _checked_scales(opened: OpenFp8File, checked: bool = False) -> dict[str, np.ndarray]:
    """Each fp8 tensor's scales, ``float32 (num_blocks, heads)``, all checked at once (unless
    ``checked``: these bytes passed before)."""
    scales = {}
    for name in opened.layout.fp8_names():
        shape = opened.layout.by_name[name].shape
        heads = shape[2] if len(shape) == 4 else 1
        scales[name] = opened.small[name + enc.SCALES_SUFFIX].view("<f4").reshape(shape[0], heads)
    tables = list(scales.values())
    if checked:
        return scales
    every = np.concatenate(tables).astype(np.float32) if tables else np.ones((0, 1), np.float32)
    try:
        check_scale_table(every)
    except SnapshotCorruptError:
        for name, table in scales.items():  # which tensor: the error names it
            check_scale_table(table.astype(np.float32), tensor=name, file=opened.file)
        raise
    return scales
