"""Strict decoding of a snapshot file's header and the layout check against its metadata."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from kvsnap.caches import BoundedLRU
from kvsnap.dtypes import SAFETENSORS_TYPES
from kvsnap.errors import NotASnapshotError, SnapshotCorruptError
from kvsnap.format.constants import (
    DATA_ALIGNMENT,
    DIGEST_BYTES,
    HEADER_PREFIX,
    MAX_HEADER_BYTES,
    METADATA_KEY,
    PARTS_FORMAT_VERSION,
)
from kvsnap.format.container import (
    FileLayout,
    TensorEntry,
    check_declared_as,
    is_container_tensor,
    pack_file,
    specs_for,
)
from kvsnap.format.parse import (
    HeaderMetadata,
    parse_metadata_document,
)
from kvsnap.format.schema import strict_json_loads
from kvsnap.format.templates import parsed_like_known, remember

#: The start of every header kvsnap writes (any JSON whitespace allowed between tokens).
_LEADING_METADATA = re.compile(
    rb'\{\s*"__metadata__"\s*:\s*\{\s*"format"\s*:\s*"pt"\s*,\s*"kvsnap"\s*:\s*"'
)
#: One JSON string (its quotes included), escapes and all. Written as runs of plain bytes
#: between escapes (the "unrolled loop"): the regex engine then takes a run per step, not a
#: byte per alternation, 5x faster on a chunk's metadata string (~25 -> 5 us; it is found in
#: every header a process opens), with the same matches and no more backtracking on a string
#: that never closes.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
#: The trailer's entry, as kvsnap writes it; found by :func:`locate_trailer` without parsing.
_TRAILER_ENTRY = re.compile(
    rb'"kvsnap\.checksums"\s*:\s*\{\s*"dtype"\s*:\s*"U8"\s*,\s*"shape"\s*:\s*'
    rb'\[\s*([0-9]{1,12})\s*,\s*16\s*\]\s*,\s*"data_offsets"\s*:\s*'
    rb"\[\s*([0-9]{1,15})\s*,\s*([0-9]{1,15})\s*\]\s*\}"
)
#: Largest header parsed whole when it does not begin with kvsnap metadata (to say what it is).
FOREIGN_HEADER_PARSE_LIMIT = 1 << 20

#: The checked tensor entries of headers decoded lately, by the bytes that define them: the
#: header without its kvsnap metadata string (the JSON before it, and after it up to the space
#: padding), its length and the file size. Files of one layout (an engine's prefix chunks)
#: differ only in that string, so all but the first skip the parse of the whole header and of
#: every entry; the metadata string itself is parsed and checked for every file.
_CHECKED_ENTRIES: BoundedLRU[tuple[bytes, bytes, int, int], tuple[TensorEntry, ...]]
_CHECKED_ENTRIES = BoundedLRU(64)


def header_length(prefix: bytes, file_size: int, file: str | None = None) -> int:
    """The JSON length from the 8-byte prefix, checked against the limits and the file size."""
    if file_size < HEADER_PREFIX.size or len(prefix) < HEADER_PREFIX.size:
        raise NotASnapshotError(f"{file_size} bytes is too short for a safetensors file", file=file)
    (length,) = HEADER_PREFIX.unpack(prefix[: HEADER_PREFIX.size])
    if length < 2 or length > MAX_HEADER_BYTES:
        # The value is not shown: it is the file's first 8 bytes, whatever the file is.
        raise NotASnapshotError(
            f"header length is outside 2..{MAX_HEADER_BYTES}: not a safetensors file", file=file
        )
    if HEADER_PREFIX.size + length > file_size:
        raise SnapshotCorruptError(
            f"header claims {length} bytes, the file holds {file_size - HEADER_PREFIX.size} after "
            "the length prefix (truncated?)",
            file=file,
        )
    return length


def locate_trailer(header: bytes) -> tuple[int, int] | None:
    """The absolute ``[begin, end)`` of the checksum trailer that ``header`` (a file's first
    ``8 + N`` bytes) names, found by pattern, not by parsing: usable when the metadata cannot
    be trusted (to tell a damaged header from a newer format). ``None`` unless exactly one
    well-formed ``kvsnap.checksums`` entry is there."""
    found = _TRAILER_ENTRY.findall(header, HEADER_PREFIX.size)
    if len(found) != 1:
        return None
    rows, begin, end = (int(value) for value in found[0])
    if rows < 2 or end - begin != rows * DIGEST_BYTES:
        return None
    return len(header) + begin, len(header) + end


@dataclass(frozen=True)
class DecodedHeader:
    """A header that parsed as safetensors with kvsnap metadata, before layout checks."""

    metadata: HeaderMetadata
    kvsnap_json: str
    entries: tuple[TensorEntry, ...]  # file order, absolute offsets
    data_start: int


def decode_header(header: bytes, file_size: int, file: str | None = None) -> DecodedHeader:
    """Parse a file's first ``8 + N`` bytes as a kvsnap safetensors header.

    Checks, in order: ``__metadata__`` with kvsnap metadata at the start (else
    :class:`NotASnapshotError`, after a full parse only for headers up to
    :data:`FOREIGN_HEADER_PARSE_LIMIT`), format version (:class:`UnsupportedVersionError`), the
    v1 schema and its semantics, the header's entry count and size against what the metadata
    allows (before anything else is parsed, so time and memory stay bounded by the metadata),
    the whole header as strict JSON, then every tensor entry: known dtype, non-negative integer
    shape, offsets matching the shape, and tensors tiling the data region with no gap or
    overlap up to exactly the end of the file (:class:`SnapshotCorruptError`).

    A header that differs from one that passed all of this only in its kvsnap metadata string
    (the same bytes before and after that string up to the padding, the same length, the same
    file size: a file of the same layout) gets that header's checked entries
    (:data:`_CHECKED_ENTRIES`); its own metadata string is parsed and checked as above.
    """
    data_start = len(header)
    if header[HEADER_PREFIX.size : HEADER_PREFIX.size + 1] != b"{":
        raise NotASnapshotError("header does not start with '{': not a safetensors file", file=file)
    # Nothing here copies or parses the whole header before its bounds are checked.
    leading = _leading_kvsnap_json(header)
    entries_key = None
    if leading is not None:
        kvsnap_json, begin, end = leading
        metadata = _parse_kvsnap_json(kvsnap_json, file)
        _check_header_bounds(header, metadata, kvsnap_json, file)
        entries_key = _entries_key(header, begin, end, file_size)
        known = _CHECKED_ENTRIES.get(entries_key)
        # JSON is parsed token by token, so the rest of a header that once passed every check
        # passes them again around another valid string (strict UTF-8 like the whole: split
        # at ASCII quotes, the parts decode exactly when the whole does).
        if known is not None and _is_utf8(header[begin:end]):
            return DecodedHeader(metadata, kvsnap_json, known, data_start)
    elif data_start - HEADER_PREFIX.size > FOREIGN_HEADER_PARSE_LIMIT:
        raise NotASnapshotError(
            f"a header of {data_start - HEADER_PREFIX.size} bytes that does not begin with "
            "kvsnap metadata",
            file=file,
        )
    document, kvsnap_json = _header_document(header, file)
    if leading is None:
        metadata = _parse_kvsnap_json(kvsnap_json, file)
    if data_start % DATA_ALIGNMENT:
        raise SnapshotCorruptError(
            f"data starts at {data_start}, not a multiple of {DATA_ALIGNMENT}", file=file
        )
    entries = [
        _decode_entry(name, spec, data_start, file)
        for name, spec in document.items()
        if name != "__metadata__"
    ]
    entries.sort(key=lambda entry: (entry.begin, entry.end))
    _check_tiling(entries, data_start, file_size, file)
    checked = tuple(entries)
    if entries_key is not None:
        _CHECKED_ENTRIES.put(entries_key, checked)
    return DecodedHeader(metadata, kvsnap_json, checked, data_start)


def _entries_key(
    header: bytes, begin: int, end: int, file_size: int
) -> tuple[bytes, bytes, int, int]:
    """What defines a header's tensor entries besides its kvsnap metadata string (at
    ``header[begin:end]``): the bytes before it and after it up to the padding, the header's
    length and the file size (:data:`_CHECKED_ENTRIES`)."""
    return header[HEADER_PREFIX.size : begin], header[end:].rstrip(b" "), len(header), file_size


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _leading_kvsnap_json(header: bytes) -> tuple[str, int, int] | None:
    """The kvsnap metadata string, and where its JSON string lies in ``header``, when the
    header JSON begins with ``__metadata__`` and its ``format`` and ``kvsnap`` keys (as kvsnap
    writes it), found without parsing the rest."""
    match = _LEADING_METADATA.match(header, HEADER_PREFIX.size)
    if match is None:
        return None
    string = _JSON_STRING.match(header, match.end() - 1)
    if string is None:
        return None
    try:
        return json.loads(string.group()), string.start(), string.end()
    except (UnicodeDecodeError, ValueError):
        return None


def _parse_kvsnap_json(kvsnap_json: str, file: str | None) -> HeaderMetadata:
    """The checked metadata of a header's kvsnap metadata string: from the template of a
    string of its shape that passed every check, when its two per-file values pass their
    rules (:mod:`kvsnap.format.templates`), else parsed and checked whole
    (:func:`parse_kvsnap_json_whole`, which raises what is wrong)."""
    known = parsed_like_known(kvsnap_json)
    if known is not None:
        return known
    metadata = parse_kvsnap_json_whole(kvsnap_json, file)
    remember(kvsnap_json, metadata)
    return metadata


def parse_kvsnap_json_whole(kvsnap_json: str, file: str | None) -> HeaderMetadata:
    """A header's kvsnap metadata string parsed and checked whole: strict JSON, the schema, its
    semantics, and a version 2 file's part; :class:`SnapshotCorruptError` (or
    :class:`UnsupportedVersionError`) for what is wrong."""
    try:
        metadata_document = strict_json_loads(kvsnap_json)
    except ValueError as error:
        raise SnapshotCorruptError(
            f"kvsnap metadata is not valid JSON ({error})", file=file
        ) from None
    metadata = parse_metadata_document(metadata_document, file=file)
    if metadata.format_version == PARTS_FORMAT_VERSION and metadata.part is None:
        # Version 2 files are the parts of a parted snapshot (its index is no file header).
        raise SnapshotCorruptError(
            f"format_version {PARTS_FORMAT_VERSION} without a part key: version 2 files are the "
            "parts of a parted snapshot",
            file=file,
        )
    return metadata


def _check_header_bounds(
    header: bytes, metadata: HeaderMetadata, kvsnap_json: str, file: str | None
) -> None:
    """Refuse, before parsing its entries, a header with more tensor entries or more bytes than
    its metadata allows: at most two entries (the tensor and its padding) per snapshot tensor
    and for the trailer, and at most three times the bytes of the whole snapshot's header."""
    specs = specs_for(metadata)
    # Every tensor, the page digests and the trailer, each with padding, and the signature.
    most_entries = 2 * (len(specs) + 2) + 1
    # Every entry has a "data_offsets" key; JSON strings cannot hide an unescaped quote.
    entries = header.count(b'"data_offsets"', HEADER_PREFIX.size)
    if entries > most_entries:
        raise SnapshotCorruptError(
            f"the header lists {entries} tensors, its metadata allows at most {most_entries}",
            file=file,
        )
    most_bytes = 3 * len(pack_file(specs, kvsnap_json).header) + 2 * DATA_ALIGNMENT
    if len(header) > most_bytes:
        raise SnapshotCorruptError(
            f"the header has {len(header)} bytes, its metadata allows at most {most_bytes}",
            file=file,
        )


def _header_document(header: bytes, file: str | None) -> tuple[dict[str, Any], str]:
    """The header's JSON object and its kvsnap metadata string; :class:`NotASnapshotError` for
    anything that is not safetensors with kvsnap metadata."""
    try:
        document = strict_json_loads(header[HEADER_PREFIX.size :].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise NotASnapshotError(f"header is not valid JSON ({error})", file=file) from None
    if not isinstance(document, dict):
        raise NotASnapshotError("header is not a JSON object", file=file)
    extra = document.get("__metadata__")
    if not isinstance(extra, dict) or not isinstance(extra.get(METADATA_KEY), str):
        raise NotASnapshotError("a safetensors file without kvsnap metadata", file=file)
    if set(extra) != {"format", METADATA_KEY} or extra["format"] != "pt":
        raise SnapshotCorruptError(f"unexpected __metadata__ keys {sorted(extra)}", file=file)
    return document, extra[METADATA_KEY]


def _check_tiling(
    entries: list[TensorEntry], data_start: int, file_size: int, file: str | None
) -> None:
    """Sorted ``entries`` must tile ``[data_start, file_size)`` with no gap or overlap."""
    position = data_start
    for entry in entries:
        if entry.begin != position:
            kind = (
                "overlaps the previous tensor"
                if entry.begin < position
                else "leaves a gap before it"
            )
            raise SnapshotCorruptError(
                f"starts at {entry.begin}: {kind} (expected {position})",
                file=file,
                tensor=entry.name,
            )
        position = entry.end
    if position != file_size:
        if position > file_size:
            message = f"tensors end at byte {position}, the file has {file_size} bytes (truncated)"
        else:
            message = (
                f"tensors end at byte {position}, the file has {file_size} bytes (trailing data)"
            )
        raise SnapshotCorruptError(message, file=file)


def _decode_entry(name: str, spec: Any, data_start: int, file: str | None) -> TensorEntry:
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise SnapshotCorruptError(
            "entry must have exactly dtype, shape and data_offsets", file=file, tensor=name
        )
    dtype = spec["dtype"]
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_TYPES:
        raise SnapshotCorruptError(
            f"dtype {dtype!r} is not one kvsnap writes", file=file, tensor=name
        )
    shape = spec["shape"]
    if not isinstance(shape, list) or not all(
        isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0 for dim in shape
    ):
        raise SnapshotCorruptError(
            f"shape {shape!r} is not a list of non-negative integers", file=file, tensor=name
        )
    offsets = spec["data_offsets"]
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(value, int) and not isinstance(value, bool) for value in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise SnapshotCorruptError(
            f"data_offsets {offsets!r} are not [begin, end] with begin <= end",
            file=file,
            tensor=name,
        )
    nbytes = math.prod(shape) * SAFETENSORS_TYPES[dtype].size
    if offsets[1] - offsets[0] != nbytes:
        raise SnapshotCorruptError(
            f"data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, "
            f"{dtype} {tuple(shape)} needs {nbytes}",
            file=file,
            tensor=name,
        )
    return TensorEntry(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def expected_layout(
    decoded: DecodedHeader, file: str | None = None, *, header: bytes | None = None
) -> tuple[FileLayout, int, int]:
    """The layout this file must have, recomputed from its metadata; checked against the header.

    The file's snapshot tensors must be a contiguous run of :func:`specs_for` (all of them
    for an unsharded file). Repacking that run with the file's own metadata string must give
    back the header byte for byte, so any header this module did not write is refused.
    Returns ``(layout, first, stop)``: the run is ``specs_for(metadata)[first:stop]``.

    ``header``: the bytes ``decoded`` was decoded from. An unsharded file's header equal to
    the repacking of all its specs is then accepted without comparing its entries one by one:
    entries decoded from the format's own bytes are the format's entries, so none of those
    checks could fail (the caller still compares the bytes). Any other header gets them all.
    """
    metadata = decoded.metadata
    specs = specs_for(metadata)
    signature, blocks = metadata.signature, int(metadata.num_blocks)
    if header is not None and metadata.shard is None:
        whole = pack_file(specs, decoded.kvsnap_json, signature, blocks)
        if whole.header == header:
            return whole, 0, len(specs)
    position = {spec.name: index for index, spec in enumerate(specs)}
    held = [entry for entry in decoded.entries if not is_container_tensor(entry.name)]
    unknown = [entry.name for entry in held if entry.name not in position]
    if unknown:
        raise SnapshotCorruptError(
            "unexpected tensor (the metadata implies no such tensor)", file=file, tensor=unknown[0]
        )
    first = position[held[0].name] if held else 0
    stop = first + len(held)
    run = specs[first:stop]
    for entry, spec in zip(held, run, strict=False):
        if entry.name != spec.name:
            raise SnapshotCorruptError(
                f"out of place: expected {spec.name} here", file=file, tensor=entry.name
            )
    if len(run) != len(held):
        raise SnapshotCorruptError("more tensors than the metadata implies", file=file)
    if metadata.shard is None and (first, stop) != (0, len(specs)):
        missing = specs[stop].name if stop < len(specs) else specs[0].name
        raise SnapshotCorruptError("missing (the metadata implies it)", file=file, tensor=missing)
    layout = pack_file(run, decoded.kvsnap_json, signature, blocks)
    found = {entry.name: entry for entry in decoded.entries}
    for entry in layout.entries:
        actual = found.get(entry.name)
        if actual is None:
            raise SnapshotCorruptError(
                "missing (the metadata implies it)", file=file, tensor=entry.name
            )
        check_declared_as(actual, entry, file)
        if (actual.begin, actual.end) != (entry.begin, entry.end):
            raise SnapshotCorruptError(
                f"lies at [{actual.begin}, {actual.end}), "
                f"the format puts it at [{entry.begin}, {entry.end})",
                file=file,
                tensor=entry.name,
            )
    if len(found) != len(layout.entries):
        extra = sorted(set(found) - set(layout.by_name))
        raise SnapshotCorruptError(
            "unexpected tensor", file=file, tensor=extra[0] if extra else None
        )
    return layout, first, stop
