"""Checking a file's signature as it is opened (:mod:`kvsnap.format.signing` says what is
signed).

A file signed with ``"hmac-sha256-blake3"`` signs its header and every byte but its pages and
padding: the tensors before the first layer tensor (token ids, block ids, prefix hashes) and
those after the last (block checksums, page digests, trailer, signature). They are read once,
as at most two ranges, checked, and kept by the file's :class:`~kvsnap.store.source.Source`:
every later read of them (the metadata, the trailer, the checksum rows) is served from the
bytes the signature was checked over, so no read after the check can see other bytes. The
page digests they hold are what every page read later is checked against. An older file
(``"hmac-sha256"``) signs its header and trailer, which lie beside the signature at the end.
"""

from __future__ import annotations

import numpy as np

from kvsnap import format as fmt
from kvsnap.errors import BadSignatureError, SignatureError, UnsignedSnapshotError
from kvsnap.format import TensorEntry
from kvsnap.format.signing import KeyRing
from kvsnap.store.source import OpenFile


def file_algorithm(open_file: OpenFile) -> str | None:
    """The signature algorithm of the opened file, from its checked layout: its header names
    it (the layout follows from the metadata), ``None`` for an unsigned file."""
    by_name = open_file.layout.by_name
    if fmt.SIGNATURE_TENSOR not in by_name:
        return None
    if fmt.PAGE_DIGESTS_TENSOR in by_name:
        return fmt.SIGNATURE_ALGORITHM
    return fmt.SIGNATURE_ALGORITHM_V1


def checked_page_digests(open_file: OpenFile, keys: KeyRing) -> np.ndarray | None:
    """Check the opened file's signature under ``keys`` and return the BLAKE3 digests of its
    pages it signs, ``(layer tensors of the file, blocks, 32)`` (``None`` for an older file
    whose pages are bound by xxh3-64 only); :class:`UnsignedSnapshotError` for a file without
    a signature, :class:`BadSignatureError` for one made with another key or over other
    bytes."""
    layout = open_file.layout
    url = open_file.source.url
    algorithm = file_algorithm(open_file)
    if algorithm is None:
        raise UnsignedSnapshotError("unsigned: written without a signing key", file=url)
    signature = layout.by_name[fmt.SIGNATURE_TENSOR]
    signed = fmt.signed_entries(layout, algorithm)
    held = _read_ranges(open_file, [*signed, signature])
    parts = [memoryview(layout.header), *(held(entry) for entry in signed)]
    problem = keys.problem(parts, bytes(held(signature)), algorithm)
    if problem is not None:
        raise BadSignatureError(f"bad signature: {problem}", file=url)
    if algorithm != fmt.SIGNATURE_ALGORITHM:
        return None
    entry = layout.by_name[fmt.PAGE_DIGESTS_TENSOR]
    return np.frombuffer(held(entry), dtype=np.uint8).reshape(entry.shape)


def signature_problem(open_file: OpenFile, keys: KeyRing) -> SignatureError | None:
    """Why ``keys`` do not vouch for the opened file (``None`` when they do): see
    :func:`checked_page_digests`."""
    try:
        checked_page_digests(open_file, keys)
    except SignatureError as error:
        return error
    return None


def signing_key_id(open_file: OpenFile) -> str | None:
    """The hex id of the key that signed the opened file, unchecked (``None``: unsigned)."""
    signature = open_file.layout.by_name.get(fmt.SIGNATURE_TENSOR)
    if signature is None:
        return None
    raw = open_file.source.read(signature.begin, fmt.KEY_ID_BYTES, tensor=fmt.SIGNATURE_TENSOR)
    return raw.hex()


def _read_ranges(open_file: OpenFile, entries: list[TensorEntry]) -> _Held:
    """The bytes of ``entries`` (in file order), read as few ranges as they allow (entries
    apart only by padding or nothing are one range) and kept by the file's source, so that
    later reads of them are served from these bytes; a function giving each entry's bytes."""
    source = open_file.source
    ranges: list[list[int]] = []
    gaps = _padding_between(open_file)
    for entry in entries:
        if ranges and gaps.get(ranges[-1][1], ranges[-1][1]) >= entry.begin:
            ranges[-1][1] = entry.end
        else:
            ranges.append([entry.begin, entry.end])
    starts: list[int] = []
    views: list[memoryview] = []
    for begin, end in ranges:
        held = source.held(begin, end - begin)
        if held is None:
            data = source.read(begin, end - begin, tensor=entries[0].name)
            source.keep(begin, data)
            views.append(memoryview(data))
        else:
            views.append(memoryview(held))
        starts.append(begin)
    return _Held(starts, views)


def _padding_between(open_file: OpenFile) -> dict[int, int]:
    """Where each padding entry of the file ends, by where it begins: signed entries apart by
    padding only are read as one range, the padding with them."""
    return {
        entry.begin: entry.end
        for entry in open_file.layout.entries
        if entry.name.startswith(fmt.PADDING_PREFIX)
    }


class _Held:
    """Signed entries' bytes, as views of the ranges they were read in."""

    def __init__(self, starts: list[int], views: list[memoryview]) -> None:
        self._starts = starts
        self._views = views

    def __call__(self, entry: TensorEntry) -> memoryview:
        for start, view in zip(self._starts, self._views, strict=True):
            if start <= entry.begin and entry.end <= start + len(view):
                return view[entry.begin - start : entry.end - start]
        raise AssertionError(f"{entry.name} was not read")  # every signed entry is in a range
