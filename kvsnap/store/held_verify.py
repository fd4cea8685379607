"""``verify`` of a one-file snapshot read whole as it opened, in one pass over its bytes.

A vLLM prefix chunk is a file of a few hundred KiB that the scheduler reads whole
(``read_whole_max_bytes``) and verifies before it offers it. The general
:func:`~kvsnap.store.verify.verify_snapshot` walks such a file entry by entry, batching layer
tensors, checking rows one by one against the trailer, through the reader's accessors: most of
its time went to that walk, not to the bytes. Here everything a file's *shape* fixes (where
its run of layer tensors lies, its checksum table, its padding, their trailer rows) is worked
out once per entries tuple (:class:`HeldShape`: the layouts of one shape share that tuple,
which the format derives from the specs the metadata implies), and per file only what differs
is checked, each in one pass over the held bytes:

- the xxh3-64 of every page of every layer tensor, against the stored checksum table (opened
  with keys, a file signed with BLAKE3 page digests: the BLAKE3 digest of every page, against
  the signed digests, and the digests against their trailer row);
- every row of that table against its layer tensor's trailer digest, and the table as a whole
  against its own;
- every padding byte zero;
- each sequence's prefix hash chain against its stored prefix hashes, and every block
  referenced by a sequence.

The trailer and the metadata tensors (token ids, block ids, prefix hashes) were checked against
the trailer from these same bytes as the file opened (:meth:`~kvsnap.store.checksums.Checksums.
held_match`), as the general verify also takes them. A file that passes gives what the general
verify gives, no problem, and leaves the checked table for the restore that follows, as it
does. This path only ever accepts: a file it does not find exactly right (or of a shape it
does not cover: several files, layer tensors with padding between them, a block no sequence
references) goes to the general verify, which names the problems
(tests/store/test_held_verify.py: the same verdict on every byte flipped, a file cut short).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from kvsnap import format as fmt
from kvsnap.caches import BoundedLRU
from kvsnap.format import TensorEntry

if TYPE_CHECKING:
    from kvsnap.store.reader import SnapshotReader


@dataclass(frozen=True, slots=True)
class HeldShape:
    """Where one file's entries put what a verify of its held bytes checks: the run of layer
    tensors ``[layers_begin, layers_end)`` (back to back, in :attr:`SnapshotReader.layer_names`
    order), the block-checksum table ``[table_begin, table_end)`` and its trailer row, the
    trailer rows ``[first_row, first_row + count)`` of the layer tensors, and the padding."""

    layers_begin: int
    layers_end: int
    table_begin: int
    table_end: int
    table_row: int
    first_row: int
    count: int
    paddings: tuple[tuple[int, int], ...]
    #: The tensors the open checked from the held bytes (``held_match``): the rest.
    metadata_tensors: frozenset[str]
    #: A signed file's page digests ``[begin, end)`` and their trailer row (``None``: none).
    page_digests: tuple[int, int, int] | None = None


#: Shapes by the entries tuple they were worked out from (kept with it, so its id is not reused
#: meanwhile) and the layer names and page size they were checked against.
_SHAPES: BoundedLRU[int, tuple[tuple[TensorEntry, ...], tuple[str, ...], int, HeldShape | None]]
_SHAPES = BoundedLRU(64)


def held_shape(
    entries: tuple[TensorEntry, ...], rows: dict[str, int], names: tuple[str, ...], page: int
) -> HeldShape | None:
    """The :class:`HeldShape` of a file with ``entries`` (trailer rows ``rows``) whose layer
    tensors are ``names`` of ``page``-byte pages; ``None`` when its layer tensors do not lie
    back to back in that order, whole pages each (the general verify takes such a file).
    Worked out once per entries tuple."""
    known = _SHAPES.get(id(entries))
    if known is not None and known[0] is entries and known[1] == names and known[2] == page:
        return known[3]
    shape = _work_out(entries, rows, names, page)
    _SHAPES.put(id(entries), (entries, names, page, shape))
    return shape


def _work_out(
    entries: tuple[TensorEntry, ...], rows: dict[str, int], names: tuple[str, ...], page: int
) -> HeldShape | None:
    by_name = {entry.name: entry for entry in entries}
    layers = [by_name.get(name) for name in names]
    table = by_name.get(fmt.BLOCK_CHECKSUMS_TENSOR)
    if not layers or table is None or any(entry is None for entry in layers):
        return None
    placed = [entry for entry in layers if entry is not None]
    row_numbers = [rows[entry.name] for entry in placed]
    back_to_back = all(before.end == after.begin for before, after in itertools.pairwise(placed))
    in_row_order = row_numbers == list(range(row_numbers[0], row_numbers[0] + len(placed)))
    if not back_to_back or not in_row_order or any(entry.nbytes % page for entry in placed):
        return None
    other = {
        fmt.CHECKSUMS_TENSOR,
        fmt.SIGNATURE_TENSOR,
        fmt.BLOCK_CHECKSUMS_TENSOR,
        fmt.PAGE_DIGESTS_TENSOR,
        *names,
    }
    digests = by_name.get(fmt.PAGE_DIGESTS_TENSOR)
    return HeldShape(
        layers_begin=placed[0].begin,
        layers_end=placed[-1].end,
        table_begin=table.begin,
        table_end=table.end,
        table_row=rows[table.name],
        first_row=row_numbers[0],
        count=len(placed),
        paddings=tuple(
            (entry.begin, entry.end)
            for entry in entries
            if entry.name.startswith(fmt.PADDING_PREFIX) and entry.nbytes
        ),
        metadata_tensors=frozenset(
            entry.name
            for entry in entries
            if entry.name not in other and not entry.name.startswith(fmt.PADDING_PREFIX)
        ),
        page_digests=None
        if digests is None
        else (digests.begin, digests.end, rows[fmt.PAGE_DIGESTS_TENSOR]),
    )


def verified_held(reader: SnapshotReader, progress: Callable[[int], None] | None = None) -> bool:
    """Whether ``reader``'s snapshot, one file read whole as it opened, passes every check
    :func:`~kvsnap.store.verify.verify_snapshot` makes (see the module's docstring), checked in
    one pass over its held bytes; then its checksum table is kept as the general verify keeps
    it, and ``progress`` receives the layer bytes checked. ``False`` when anything is not
    exactly right, or the file is not of a shape this covers: the caller runs the general
    verify, which names the problems."""
    checksums = reader.checksums
    files = reader.open_files
    if len(files) != 1 or checksums.sharded or not checksums.trailer_held(0):
        return False
    open_file = files[0]
    layout = open_file.layout
    whole = open_file.source.held(0, open_file.source.size)
    trailer = checksums.trailer(0)
    page = reader.page_bytes
    shape = held_shape(layout.entries, layout.checksum_rows, reader.layer_names, page)
    if whole is None or trailer is None or shape is None:
        return False
    if not checksums.held_matches(0, shape.metadata_tensors):
        return False
    table_bytes = whole[shape.table_begin : shape.table_end]
    table = table_bytes.view("<u8").reshape(shape.count, reader.num_blocks)
    pages = whole[shape.layers_begin : shape.layers_end]
    bound = reader.page_digest_table
    if bound is None:
        pages_hold = np.array_equal(fmt.block_digests(pages, page), table.reshape(-1))
    else:
        # Opened with keys, signed with BLAKE3 page digests: every page against its signed
        # digest (which catches all its xxh3-64 would).
        digests = fmt.page_digests(pages, page)
        pages_hold = np.array_equal(digests, bound.reshape(-1, fmt.PAGE_DIGEST_BYTES))
    rows_expected = b"".join(trailer[shape.first_row : shape.first_row + shape.count])
    signed = shape.page_digests  # a signed file's page digests, against their trailer row
    if (
        not pages_hold
        or (
            signed is not None and fmt.digest128(whole[signed[0] : signed[1]]) != trailer[signed[2]]
        )
        or b"".join(map(xxhash.xxh3_128_digest, table)) != rows_expected
        or fmt.digest128(table_bytes) != trailer[shape.table_row]
        or any(whole[begin:end].any() for begin, end in shape.paddings)
        or not _chains_hold(reader)
    ):
        return False
    # A copy: the table is kept process-wide, the held bytes only while the file is open.
    checksums.remember_rows(0, table.copy())
    if progress is not None:
        progress(shape.layers_end - shape.layers_begin)
    return True


def _chains_hold(reader: SnapshotReader) -> bool:
    """Whether every sequence's token ids hash to its stored prefix hashes and every block of
    the snapshot belongs to a sequence (the general verify also accepts an unreferenced block
    whose stored hash is zero: it is left to it)."""
    metadata = reader.metadata
    block_size = metadata.geometry.block_size
    referenced = np.zeros(reader.num_blocks, dtype=bool)
    for record in metadata.sequences:
        referenced[record.block_ids] = True
        chain = fmt.prefix_hash_chain(record.token_ids, block_size)
        if tuple(chain) != record.prefix_hashes:
            return False
    return bool(referenced.all())
