"""A header kvsnap wrote, taken as the packing of its own metadata string.

:func:`canonical_header` is what a reader tries before :func:`kvsnap.format.header.
decode_header`: an unsharded file's header that is exactly the format's packing of its kvsnap
metadata string needs no parse of its entries, only that one comparison. The packings of one
metadata shape are kept (:data:`_PACKINGS`), so per file only its two per-file values are
escaped again (:mod:`kvsnap.format.templates`).
"""

from __future__ import annotations

from kvsnap.caches import BoundedLRU
from kvsnap.format.constants import DATA_ALIGNMENT, HEADER_PREFIX
from kvsnap.format.container import FileLayout, TensorEntry, pack_file, specs_for
from kvsnap.format.header import DecodedHeader, _leading_kvsnap_json, _parse_kvsnap_json
from kvsnap.format.schema import dump_json
from kvsnap.format.templates import Cut, split_metadata


def canonical_header(
    header: bytes, file_size: int, file: str | None = None
) -> tuple[DecodedHeader, FileLayout] | None:
    """The decoded header and layout of a file whose header is exactly the format's packing
    of its own kvsnap metadata string (every header kvsnap writes for an unsharded file) and
    whose size is that layout's end; ``None`` for any other header, which
    :func:`decode_header` and :func:`expected_layout` then decode and check the general way
    (refusing it, or accepting a shard).

    For such a header every check of the general decode holds by construction: the packing
    is strict JSON with unique names and ``__metadata__`` as the format writes it, its entries
    have known dtypes, shapes matching their offsets, and tile ``[data_start, file_size)``
    exactly (the size is checked), the data start is aligned, its entry count and size are
    within the metadata's bounds, and the layout check's fast path is this very comparison.
    What varies per file is checked here as there: the metadata string is parsed and checked
    (strict JSON, the schema, its semantics), raising exactly what :func:`decode_header`
    raises for it. One packing per shape (:func:`pack_file`), one comparison of bytes, not
    a parse of every entry (tests/format/test_header.py: the same result or the same error as
    the general decode on fuzzed headers)."""
    if header[HEADER_PREFIX.size : HEADER_PREFIX.size + 1] != b"{":
        return None
    leading = _leading_kvsnap_json(header)
    if leading is None:
        return None
    kvsnap_json = leading[0]
    metadata = _parse_kvsnap_json(kvsnap_json, file)
    if metadata.shard is not None:
        return None
    found = split_metadata(kvsnap_json)
    layout = _packed_like_known(header, file_size, kvsnap_json, found)
    if layout is None:
        layout = pack_file(
            specs_for(metadata), kvsnap_json, metadata.signature, int(metadata.num_blocks)
        )
        if layout.header != header or layout.file_size != file_size:
            return None
        _remember_packing(layout, found)
    return DecodedHeader(metadata, kvsnap_json, layout.entries, len(header)), layout


#: Headers that were their metadata's packing, by the text of their metadata string around
#: its two per-file values (:func:`kvsnap.format.templates.split_metadata`), the file size and
#: the header's length: the header's bytes before the creation time's escaped value (length
#: prefix included), between the two values and after the id's (up to the padding), and the
#: layout's entries. That text fixes the specs and so the packing; the escaped values are the
#: only bytes of the JSON that differ (escaping is per character).
_PACKINGS: BoundedLRU[tuple[Cut, int, int], tuple[bytes, bytes, bytes, tuple[TensorEntry, ...]]]
_PACKINGS = BoundedLRU(16)


def _escaped(token: str) -> bytes:
    """A metadata string's piece as the header's JSON string holds it (without quotes)."""
    return dump_json(token)[1:-1].encode("ascii")


def _packed_like_known(
    header: bytes, file_size: int, kvsnap_json: str, found: tuple[Cut, str, str] | None
) -> FileLayout | None:
    """The layout :func:`pack_file` gives for ``kvsnap_json`` when ``header`` is that
    packing, found from a kept packing of a string cut into the same text (``found``),
    escaping only the two per-file values; ``None`` when none is kept or the bytes differ
    (the caller packs it)."""
    if found is None:
        return None
    cut, created, sequence_id = found
    kept = _PACKINGS.get((cut, file_size, len(header)))
    if kept is None:
        return None
    before, between, after, entries = kept
    unpadded = b"".join((before, _escaped(created), between, _escaped(sequence_id), after))
    data_start = -(-len(unpadded) // DATA_ALIGNMENT) * DATA_ALIGNMENT
    if data_start != len(header) or header != unpadded + b" " * (data_start - len(unpadded)):
        return None
    return FileLayout(header, entries, kvsnap_json)


def _remember_packing(layout: FileLayout, found: tuple[Cut, str, str] | None) -> None:
    """Keep ``layout`` (a header equal to its metadata string's packing) for
    :func:`_packed_like_known`, cut around the string's two per-file values."""
    if found is None:
        return
    cut, created, sequence_id = found
    pieces = [_escaped(piece) for piece in (cut[0], created, cut[1], sequence_id, cut[2])]
    start = layout.header.find(b'"kvsnap":"') + len(b'"kvsnap":"')
    end = start + sum(len(piece) for piece in pieces)
    if start < len(b'"kvsnap":"') or layout.header[start:end] != b"".join(pieces):
        return
    before = layout.header[:start] + pieces[0]
    after = pieces[4] + layout.header[end:].rstrip(b" ")
    key = (cut, layout.file_size, len(layout.header))
    _PACKINGS.put(key, (before, pieces[2], after, layout.entries))
