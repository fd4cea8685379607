"""Encoded snapshot files (format version 3): a snapshot stored smaller, still a safetensors file.

An encoded file holds everything needed to rebuild its *decoded file*, an ordinary version 1
snapshot (docs/format.md, "Encoded snapshots"):

* ``kvsnap.original_header`` (``U8``): the decoded file's first ``data_start`` bytes, its
  header, byte for byte;
* every tensor of the decoded file but its padding, in the decoded file's order, under the same
  name: a layer tensor as its encoding stores it (below), any other tensor as it is;
* ``kvsnap.encoded_checksums`` (``U8 (rows, 16)``): xxh3-128 of this file's header, of every
  tensor above in file order, then of those rows;
* ``kvsnap.signature`` (``U8 (48,)``, signed files only): key id and
  HMAC-SHA256(key, tag ‖ header ‖ BLAKE3-256 of every tensor above in file order, the
  checksums included). Algorithm ``encoded-hmac-sha256-blake3`` (tag
  ``"kvsnap-encoded-signature-v1\\0"``) digests every tensor whole;
  ``encoded-hmac-sha256-blake3-pages`` (tag ``"kvsnap-encoded-signature-v2\\0"``, files with
  page checks) leaves out the fp8 value tensors, whose pages the signed ``.digests`` bind one
  by one (:func:`signed_names`).

A layer tensor ``layers.{i}.{part}`` is stored as

* ``fp8``: ``layers.{i}.{part}`` ``F8_E4M3`` of the decoded tensor's shape and
  ``layers.{i}.{part}.scales`` ``F32 (num_blocks, heads)`` (:mod:`kvsnap.encoding.fp8`); in
  files whose ``encoding`` lists ``page_checks``, also ``layers.{i}.{part}.pages`` ``U64
  (num_blocks,)``, the xxh3-64 of each block's stored e4m3 bytes, and in signed ones
  ``layers.{i}.{part}.digests`` ``U8 (num_blocks, 32)``, their BLAKE3-256: a restore checks
  each page it moves on the device against them, so an open reads no page;
* ``lossless``: ``layers.{i}.{part}`` ``U8 (stored bytes,)``, its chunks back to back, and
  ``layers.{i}.{part}.chunks`` ``U64 (chunks, columns)``, the chunk table
  (:mod:`kvsnap.encoding.lossless`);
* ``raw``: ``layers.{i}.{part}`` as the decoded file holds it.

The kvsnap metadata is ``{"format_version": 3, "kvsnap_version", "encoding": {...}}``, where
``encoding`` says ``name`` (``fp8`` or ``lossless``), ``codec``, ``decoded_bytes``,
``tensors`` (per layer tensor: ``stored`` one of ``fp8``, ``lossless``, ``raw``), ``signature``
(the algorithm, or ``null``), ``error`` (fp8: the error report, or ``null``) and
``page_checks`` (``["xxh3-64"]``; signed: ``["xxh3-64", "blake3"]``; absent from files kvsnap
wrote before fp8 pages carried checks, which still read). Tensors start at multiples of
:data:`ALIGNMENT`, ``kvsnap.padding.<next>`` (``U8`` zeros) filling the gaps. The header is
padded with spaces to a multiple of :data:`ALIGNMENT`; a header with an error report, to the
length it would have with every number of the report at its widest, so a writer can place the
tensors before the error is measured (readers take any trailing spaces).

This module is the container alone, bytes in memory: names, the exact layout, a strict parse of
a header, the trailer and the signed message. :mod:`kvsnap.encoded` reads and writes files.
"""

from __future__ import annotations

import functools
import json
import math
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvsnap.errors import NotASnapshotError, SnapshotCorruptError, UnsupportedVersionError
from kvsnap.format.constants import METADATA_KEY, PADDING_PREFIX, SIGNATURE_TENSOR
from kvsnap.format.schema import dump_json

#: The format version of encoded files.
ENCODED_FORMAT_VERSION = 3
#: The decoded file's header bytes.
ORIGINAL_HEADER_TENSOR = "kvsnap.original_header"
#: The encoded file's checksum trailer.
ENCODED_CHECKSUMS_TENSOR = "kvsnap.encoded_checksums"
#: Suffixes of a layer tensor's companion: its fp8 scales, its lossless chunk table.
SCALES_SUFFIX = ".scales"
CHUNKS_SUFFIX = ".chunks"
#: Every tensor starts at a multiple of this many bytes (the header is padded to it too).
ALIGNMENT = 64
#: The largest header an encoded file may declare.
MAX_HEADER_BYTES = 16 << 20
#: The signature algorithm of signed encoded files, and what its HMAC starts with.
SIGNATURE_ALGORITHM = "encoded-hmac-sha256-blake3"
SIGNATURE_TAG = b"kvsnap-encoded-signature-v1\0"
#: The signature of files with page checks: fp8 pages bound one by one by their digests.
PAGES_SIGNATURE_ALGORITHM = "encoded-hmac-sha256-blake3-pages"
PAGES_SIGNATURE_TAG = b"kvsnap-encoded-signature-v2\0"
#: Suffixes of an fp8 layer tensor's page checks: xxh3-64 per page, BLAKE3-256 per page.
PAGES_SUFFIX = ".pages"
DIGESTS_SUFFIX = ".digests"
#: What ``page_checks`` may list.
PAGE_CHECKS = ("xxh3-64", "blake3")
#: The layer dtypes fp8 pages decode into.
FP8_DECODED_DTYPES = ("BF16", "F16", "F32")
#: Encodings, and what a layer tensor may be stored as.
ENCODINGS = ("lossless", "fp8")
STORED_KINDS = ("lossless", "fp8", "raw")
#: safetensors dtype names and their sizes.
ITEM_BYTES = {
    "BF16": 2,
    "F16": 2,
    "F32": 4,
    "F64": 8,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I8": 1,
    "U8": 1,
    "I64": 8,
    "U64": 8,
}


@dataclass(frozen=True)
class StoredTensor:
    """A tensor of an encoded file: name, safetensors dtype, shape, absolute byte range."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class EncodedLayout:
    """An encoded file's metadata (``document``: the kvsnap JSON object), its tensors in file
    order (padding included), where its data starts and its size."""

    document: dict[str, Any]
    tensors: tuple[StoredTensor, ...]
    data_start: int
    file_size: int

    @functools.cached_property
    def by_name(self) -> dict[str, StoredTensor]:
        return {tensor.name: tensor for tensor in self.tensors}

    @property
    def checksummed(self) -> list[StoredTensor]:
        """The tensors the trailer covers: every one but padding, the trailer and the
        signature, in file order."""
        skipped = (ENCODED_CHECKSUMS_TENSOR, SIGNATURE_TENSOR)
        return [t for t in self.tensors if t.name not in skipped and not is_padding(t.name)]

    @property
    def encoding(self) -> dict[str, Any]:
        return dict(self.document["encoding"])

    @property
    def page_checks(self) -> tuple[str, ...]:
        """The page checks an fp8 tensor carries (``()``: a file written before them)."""
        return tuple(self.document["encoding"].get("page_checks") or ())

    def fp8_names(self) -> list[str]:
        """The layer tensors stored as fp8, in file order."""
        kinds = self.document["encoding"]["tensors"]
        return [t.name for t in self.tensors if kinds.get(t.name) == "fp8"]


def is_padding(name: str) -> bool:
    return name.startswith(PADDING_PREFIX)


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def build_layout(
    document: dict[str, Any], specs: Sequence[tuple[str, str, tuple[int, ...]]]
) -> tuple[bytes, EncodedLayout]:
    """The header bytes and layout of an encoded file whose metadata is ``document`` and whose
    tensors are ``specs`` (name, dtype, shape) in file order; padding is added before every
    tensor that would not start at a multiple of :data:`ALIGNMENT`. Strict JSON: a NaN or an
    infinity anywhere in ``document`` is a ``ValueError`` (a reader would refuse the file)."""
    placed: list[tuple[str, str, tuple[int, ...], int, int]] = []
    offset = 0
    for name, dtype, shape in specs:
        start = _aligned(offset)
        if start > offset:
            placed.append((PADDING_PREFIX + name, "U8", (start - offset,), offset, start))
        nbytes = math.prod(shape) * ITEM_BYTES[dtype]
        placed.append((name, dtype, tuple(shape), start, start + nbytes))
        offset = start + nbytes
    entries: dict[str, Any] = {
        "__metadata__": {
            "format": "pt",
            METADATA_KEY: dump_json(document),
        }
    }
    for name, dtype, shape, begin, end in placed:
        entries[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}
    text = dump_json(entries).encode()
    length = _aligned(8 + _reserved_header_text(entries, document, len(text))) - 8
    header = struct.pack("<Q", length) + text + b" " * (length - len(text))
    data_start = 8 + length
    tensors = tuple(
        StoredTensor(name, dtype, shape, data_start + begin, data_start + end)
        for name, dtype, shape, begin, end in placed
    )
    return header, EncodedLayout(document, tensors, data_start, data_start + offset)


#: The widest a number of an error report is written (floats keep 6 significant digits, and
#: Python writes those between 1e15 and 1e16 in full): what a header reserves room for.
WIDEST_REPORT_FLOAT = -1.23457e15
WIDEST_REPORT_INT = -(2**63)


def _widest(value: Any) -> Any:
    """``value`` (an error report, or part of one) with every number at its widest."""
    if isinstance(value, dict):
        return {key: _widest(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_widest(item) for item in value]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    return WIDEST_REPORT_INT if isinstance(value, int) else WIDEST_REPORT_FLOAT


def _reserved_header_text(entries: dict[str, Any], document: dict[str, Any], length: int) -> int:
    """How many bytes of JSON the header of ``entries`` makes room for: ``length`` (the JSON's
    own) for a file without an error report, else the length it would have with every number
    of the report at its widest. A writer can then place the tensors before the error is
    measured, and every writer pads the same header to the same length."""
    encoding = document.get("encoding")
    error = encoding.get("error") if isinstance(encoding, dict) else None
    if not isinstance(error, dict):
        return length
    widest = {**document, "encoding": {**encoding, "error": _widest(error)}}
    metadata = {**entries["__metadata__"]}
    metadata[METADATA_KEY] = dump_json(widest)
    text = dump_json({**entries, "__metadata__": metadata})
    return max(length, len(text.encode()))


def header_length(prefix: bytes, file_size: int, file: str | None = None) -> int:
    """The header length ``N`` from a file's first 8 bytes, bounded by the file and by
    :data:`MAX_HEADER_BYTES`."""
    if len(prefix) < 8:
        raise NotASnapshotError("shorter than a safetensors header", file=file)
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > MAX_HEADER_BYTES or 8 + length > file_size:
        raise NotASnapshotError(f"declares a {length}-byte header", file=file)
    return length


def peek_version(header: bytes) -> int | None:
    """The kvsnap ``format_version`` a safetensors header declares, or ``None`` when it is no
    kvsnap header (never raises: for telling an encoded file from an ordinary one)."""
    try:
        document = json.loads(header[8:].decode("utf-8"))
        version = json.loads(document["__metadata__"][METADATA_KEY])["format_version"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None
    return version if isinstance(version, int) else None


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("a JSON object repeats a key")
    return dict(pairs)


#: Layouts parsed, by (header, file size): a process reopening a file (an engine's hits)
#: parses its header once. Layouts are immutable; the bound keeps the memory small.
_PARSED: OrderedDict[tuple[bytes, int], EncodedLayout] = OrderedDict()
_PARSED_MAX = 64
_PARSED_LOCK = threading.Lock()


def parse_header(header: bytes, file_size: int, file: str | None = None) -> EncodedLayout:
    """The layout of an encoded file from its header (its first ``8 + N`` bytes), strictly:
    a version 3 kvsnap document with an ``encoding`` object, known dtypes, shapes that match
    their byte ranges, and tensors that tile the data exactly (no gap, no overlap, nothing
    past the file). A header parsed before (the same bytes, the same file size) is not parsed
    again."""
    key = (header, file_size)
    with _PARSED_LOCK:
        layout = _PARSED.get(key)
    if layout is None:
        layout = _parse_header(header, file_size, file)
        with _PARSED_LOCK:
            _PARSED[key] = layout
            if len(_PARSED) > _PARSED_MAX:
                _PARSED.popitem(last=False)
    return layout


def _parse_header(header: bytes, file_size: int, file: str | None) -> EncodedLayout:
    try:
        entries = json.loads(header[8:].decode("utf-8"), object_pairs_hook=_refuse_duplicates)
        document = json.loads(
            entries.pop("__metadata__")[METADATA_KEY], object_pairs_hook=_refuse_duplicates
        )
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        raise SnapshotCorruptError(f"encoded header is not valid: {exc}", file=file) from None
    _check_document(document, file)
    data_start = len(header)
    tensors = []
    position = data_start
    for name, spec in entries.items():
        tensor = _entry(name, spec, data_start, file)
        if tensor.begin != position:
            raise SnapshotCorruptError(
                f"starts at byte {tensor.begin}, not {position}", file=file, tensor=name
            )
        position = tensor.end
        tensors.append(tensor)
    if position != file_size:
        raise SnapshotCorruptError(
            f"the tensors end at byte {position}, the file at {file_size}", file=file
        )
    return EncodedLayout(document, tuple(tensors), data_start, file_size)


def _check_document(document: Any, file: str | None) -> None:
    if not isinstance(document, dict) or "format_version" not in document:
        raise NotASnapshotError("no kvsnap metadata", file=file)
    version = document["format_version"]
    if version != ENCODED_FORMAT_VERSION:
        raise UnsupportedVersionError(
            f"format version {version!r} is not an encoded snapshot's", file=file
        )
    encoding = document.get("encoding")
    if not isinstance(encoding, dict) or encoding.get("name") not in ENCODINGS:
        raise SnapshotCorruptError("encoded metadata without a known encoding", file=file)
    stored = encoding.get("tensors")
    if not isinstance(stored, dict) or any(kind not in STORED_KINDS for kind in stored.values()):
        raise SnapshotCorruptError("encoded metadata: tensors must map to a stored kind", file=file)
    checks = encoding.get("page_checks", [])
    if not isinstance(checks, list) or checks not in ([], ["xxh3-64"], list(PAGE_CHECKS)):
        raise SnapshotCorruptError(f"encoded metadata: page_checks {checks!r}", file=file)
    decoded = encoding.get("decoded_bytes")
    if not isinstance(decoded, int) or isinstance(decoded, bool) or decoded <= 0:
        raise SnapshotCorruptError("encoded metadata: decoded_bytes must be positive", file=file)


def _entry(name: str, spec: Any, data_start: int, file: str | None) -> StoredTensor:
    try:
        dtype, shape, (begin, end) = spec["dtype"], spec["shape"], spec["data_offsets"]
        if set(spec) != {"dtype", "shape", "data_offsets"} or dtype not in ITEM_BYTES:
            raise ValueError(f"dtype {dtype!r}")
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
            raise ValueError(f"shape {shape!r}")
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in (begin, end)):
            raise ValueError("offsets")
    except (KeyError, TypeError, ValueError) as exc:
        raise SnapshotCorruptError(f"bad tensor entry ({exc})", file=file, tensor=name) from None
    if end - begin != math.prod(shape) * ITEM_BYTES[dtype] or begin < 0:
        raise SnapshotCorruptError(
            f"{end - begin} bytes for {dtype} {tuple(shape)}", file=file, tensor=name
        )
    return StoredTensor(name, dtype, tuple(shape), data_start + begin, data_start + end)


def signed_message(header: bytes, blake3_digests: Sequence[bytes]) -> list[bytes]:
    """What a signed encoded file's HMAC covers after its tag: its header, then the BLAKE3-256
    of every tensor :func:`signed_names` lists, in that order."""
    return [header, *blake3_digests]


def signed_names(layout: EncodedLayout, algorithm: str) -> list[str]:
    """The tensors whose BLAKE3-256 a signature of ``algorithm`` covers, in file order: every
    checksummed tensor and the trailer; with :data:`PAGES_SIGNATURE_ALGORITHM`, not the fp8
    value tensors (their signed ``.digests`` bind each page)."""
    skipped = set(layout.fp8_names()) if algorithm == PAGES_SIGNATURE_ALGORITHM else set()
    names = [t.name for t in layout.checksummed if t.name not in skipped]
    return [*names, ENCODED_CHECKSUMS_TENSOR]
