"""The stored checksums of one open snapshot, and the one place they are checked.

Every file ends with its trailer (``kvsnap.checksums``: the xxh3-128 of its header and of every
tensor it holds); a sharded snapshot's index records the xxh3-128 of each shard's trailer; the
``kvsnap.block_checksums`` tensor holds one row of xxh3-64 block checksums per layer tensor,
each row committed to by that tensor's trailer digest. :class:`Checksums` loads and checks
these for an open snapshot (:class:`~kvsnap.store.read.opened.OpenedFiles`), keeps the rows it
checked, and keeps the whole table of rows process-wide (by the files' trailers, which commit
to it), so an engine opening the same stored prefix again skips the read and the checks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import xxhash

from kvsnap import format as fmt
from kvsnap.caches import BoundedLRU
from kvsnap.errors import SnapshotCorruptError

if TYPE_CHECKING:
    from kvsnap.format import TensorEntry
    from kvsnap.store.read.opened import OpenedFiles
    from kvsnap.store.read.source import OpenFile

#: Checked block-checksum tables by the digest of their files' trailers, least recently used
#: first; tables above ``_MAX_CACHED_TABLE_BYTES`` (snapshots of many blocks) are not kept.
_TABLES: BoundedLRU[bytes, np.ndarray] = BoundedLRU(256)
_MAX_CACHED_TABLE_BYTES = 256 << 10
#: Decoded trailers by their exact bytes (read from the file on every open): a trailer
#: decoded and checked once is one dictionary lookup the next time, not a digest and a slice
#: per tensor. Keyed by the bytes themselves, so only identical bytes are served.
_DECODED: BoundedLRU[bytes, tuple[bytes, ...]] = BoundedLRU(256)


class Checksums:
    """The trailers, the index's trailer digests and the block-checksum rows of the open
    snapshot ``files`` (its ``open_files``, ``placement``, ``layer_names``, ``num_blocks``
    and, sharded, ``index_digests``: per shard, the xxh3-128 of its trailer as the index
    records it)."""

    def __init__(self, files: OpenedFiles) -> None:
        self._files = files
        self._trailers: dict[int, tuple[bytes, ...]] = {}  # by file position
        self._rows_of: dict[int, dict[str, int]] = {}
        # Files whose trailer came from bytes read whole as they opened, and the tensors of
        # those bytes already found equal to their trailer digest: a second look at the same
        # bytes can only give the same answer.
        self._held_trailers: set[int] = set()
        self._held_matches: set[tuple[int, str]] = set()
        self._rows: dict[int, np.ndarray] = {}  # checked rows, by layer tensor
        self._table: np.ndarray | None = None

    # -- trailers ----------------------------------------------------------------------------

    def load_trailer(self, position: int) -> None:
        """Read file ``position``'s trailer and check it against itself and its header
        (:class:`SnapshotCorruptError` otherwise); from then on its tensors' digests are
        known."""
        open_file = self._files.open_files[position]
        layout = open_file.layout
        entry = layout.by_name[fmt.CHECKSUMS_TENSOR]
        raw = open_file.source.read(entry.begin, entry.nbytes, tensor=fmt.CHECKSUMS_TENSOR)
        digests = _DECODED.get(raw)
        if digests is None:
            digests = tuple(fmt.decode_trailer(raw, file=open_file.source.url))
            _DECODED.put(raw, digests)
        if digests[0] != fmt.digest128(layout.header):
            # The trailer checked out, so the header bytes are what changed.
            raise SnapshotCorruptError(
                "header does not match its checksum (trailer row 0)", file=open_file.source.url
            )
        self._trailers[position] = digests
        self._rows_of[position] = layout.checksum_rows
        if open_file.source.holds_whole:
            self._held_trailers.add(position)

    def forget_trailer(self, position: int) -> None:
        """Drop file ``position``'s trailer (it failed a check): its tensors' digests are
        unknown again."""
        self._trailers.pop(position, None)
        self._rows_of.pop(position, None)
        self._held_trailers.discard(position)
        self._held_matches = {key for key in self._held_matches if key[0] != position}

    def has_trailer(self, position: int) -> bool:
        return position in self._trailers

    def trailer_held(self, position: int) -> bool:
        """Whether file ``position``'s trailer is loaded and was read from the bytes its
        source read whole as it opened: reading it again would read those same bytes, which
        :meth:`load_trailer` already checked."""
        return position in self._held_trailers

    def note_held_match(self, position: int, name: str) -> None:
        """Record that tensor ``name``'s bytes, held whole by file ``position``'s source,
        matched their trailer digest (:meth:`held_match`)."""
        if position in self._held_trailers:
            self._held_matches.add((position, name))

    def held_match(self, position: int, name: str) -> bool:
        """Whether tensor ``name`` of file ``position`` was found equal to its trailer digest
        in the bytes its source holds whole (:meth:`note_held_match`): hashing them again
        would hash the same bytes against the same digest."""
        return (position, name) in self._held_matches

    def held_matches(self, position: int, names: frozenset[str]) -> bool:
        """Whether every tensor of ``names`` passed :meth:`held_match` for file ``position``."""
        return names <= {name for at, name in self._held_matches if at == position}

    def trailer(self, position: int) -> tuple[bytes, ...] | None:
        """File ``position``'s trailer rows as loaded and checked (row 0 the header's), or
        ``None`` while it is not loaded."""
        return self._trailers.get(position)

    def ensure_trailers(self) -> None:
        """Load the trailers not loaded yet (a reader opened without verification)."""
        for position in range(len(self._files.open_files)):
            if position not in self._trailers:
                self.load_trailer(position)

    @property
    def sharded(self) -> bool:
        """Whether an index records the files' trailer digests."""
        return self._files.index_digests is not None

    def check_index_digest(self, position: int) -> None:
        """Check shard ``position``'s trailer against the digest the index records for it."""
        assert self._files.index_digests is not None
        open_file = self._files.open_files[position]
        entry = open_file.layout.by_name[fmt.CHECKSUMS_TENSOR]
        raw = open_file.source.read(entry.begin, entry.nbytes, tensor=fmt.CHECKSUMS_TENSOR)
        if xxhash.xxh3_128_hexdigest(raw) != self._files.index_digests[position]:
            raise SnapshotCorruptError(
                "shard does not match the index (a shard of another snapshot, or a partly "
                "published overwrite)",
                file=open_file.source.url,
                tensor=fmt.CHECKSUMS_TENSOR,
            )

    def digest(self, name: str, position: int | None = None) -> bytes | None:
        """The stored xxh3-128 of tensor ``name`` (a row of the trailer of the file at
        ``position``, looked up when not given); ``None`` while that trailer is not loaded."""
        if position is None:
            position, _ = self._files.placement(name)
        trailer = self._trailers.get(position)
        if trailer is None:
            return None
        return trailer[self._rows_of[position][name]]

    # -- block-checksum rows -----------------------------------------------------------------

    def stored_row(self, tensor: int) -> np.ndarray:
        """Layer tensor ``tensor``'s stored block checksums as read, unchecked."""
        open_file, entry = self._block_checksums()
        row_bytes = self._files.num_blocks * 8
        raw = open_file.source.read(
            entry.begin + tensor * row_bytes, row_bytes, tensor=fmt.BLOCK_CHECKSUMS_TENSOR
        )
        return np.frombuffer(raw, dtype="<u8")

    def stored_rows(self, first: int, count: int) -> np.ndarray:
        """The stored block checksums of layer tensors ``first .. first + count`` as read,
        unchecked, ``(count, blocks)``: one read."""
        open_file, entry = self._block_checksums()
        row_bytes = self._files.num_blocks * 8
        raw = open_file.source.read(
            entry.begin + first * row_bytes, count * row_bytes, tensor=fmt.BLOCK_CHECKSUMS_TENSOR
        )
        return np.frombuffer(raw, dtype="<u8").reshape(count, self._files.num_blocks)

    def rows_trusted(self, first: int, rows: np.ndarray) -> list[bool | None]:
        """:meth:`row_trusted` of each row of ``rows``, the stored checksums of layer tensors
        ``first, first + 1, ...`` (as :meth:`stored_rows` gives them), in one pass."""
        names = self._files.layer_names
        verdicts: list[bool | None] = []
        for offset in range(len(rows)):
            expected = self.digest(names[first + offset])
            row = rows[offset]
            verdicts.append(None if expected is None else _row_digest(row) == expected)
        return verdicts

    def row_trusted(self, tensor: int, row: np.ndarray) -> bool | None:
        """Whether ``row`` matches layer tensor ``tensor``'s digest in the trailer; ``None``
        when that trailer is not loaded (nothing to check it against)."""
        expected = self.digest(self._files.layer_names[tensor])
        return None if expected is None else fmt.layer_tensor_digest(row) == expected

    def row(self, tensor: int) -> np.ndarray:
        """Layer tensor ``tensor``'s stored block checksums, checked against the trailer
        (:class:`SnapshotCorruptError` if they do not match it) and kept."""
        row = self._rows.get(tensor)
        if row is None:
            self.ensure_trailers()
            row = self._checked(tensor, self.stored_row(tensor))
        return row

    def table(self) -> np.ndarray:
        """Every layer tensor's stored block checksums, ``(tensors, blocks)``, read at once
        (one read, not one per tensor: a restore touches every tensor) and checked row by row;
        kept process-wide by the files' trailers, which commit to these rows."""
        if self._table is None:
            self.ensure_trailers()
            key = self._table_key()
            self._table = _TABLES.get(key)
            if self._table is None:
                self._table = _keep_table(key, self._read_table())
        return self._table

    def remember_row(self, tensor: int, row: np.ndarray) -> None:
        """Keep ``row``, which the caller found to match layer tensor ``tensor``'s trailer
        digest (:meth:`row_trusted`); once every row is kept, the table is kept process-wide
        as :meth:`table` keeps it (a full verify leaves it for the restore that follows)."""
        self._rows[tensor] = row
        tensors = len(self._files.layer_names)
        every_trailer = len(self._trailers) == len(self._files.open_files)
        if self._table is None and every_trailer and len(self._rows) == tensors:
            table = np.stack([self._rows[index] for index in range(tensors)])
            self._table = _keep_table(self._table_key(), table)

    def remember_rows(self, first: int, rows: np.ndarray) -> None:
        """:meth:`remember_row` of each row of ``rows`` (layer tensors ``first, first + 1,
        ...``, every one found trusted); the whole table when ``rows`` is all of it."""
        tensors = len(self._files.layer_names)
        for offset in range(len(rows)):
            self._rows[first + offset] = rows[offset]
        every_trailer = len(self._trailers) == len(self._files.open_files)
        if self._table is None and every_trailer and len(self._rows) == tensors:
            whole = first == 0 and len(rows) == tensors and rows.dtype == np.dtype("<u8")
            table = rows if whole else np.stack([self._rows[index] for index in range(tensors)])
            self._table = _keep_table(self._table_key(), table)

    def _table_key(self) -> bytes:
        """The digest of every file's trailer (all loaded), which commit to the table."""
        trailers = [self._trailers[position] for position in range(len(self._files.open_files))]
        return fmt.digest128(b"".join(map(b"".join, trailers)))

    def _read_table(self) -> np.ndarray:
        open_file, entry = self._block_checksums()
        raw = open_file.source.read(entry.begin, entry.nbytes, tensor=fmt.BLOCK_CHECKSUMS_TENSOR)
        names = self._files.layer_names
        table = np.frombuffer(raw, dtype="<u8").reshape(len(names), self._files.num_blocks)
        return np.stack([self._checked(tensor, table[tensor]) for tensor in range(len(names))])

    def _checked(self, tensor: int, row: np.ndarray) -> np.ndarray:
        """``row`` kept as layer tensor ``tensor``'s, once it matches the trailer."""
        if not self.row_trusted(tensor, row):
            open_file, _ = self._block_checksums()
            raise SnapshotCorruptError(
                f"the stored block checksums of {self._files.layer_names[tensor]} do not "
                "match their xxh3-128 checksum",
                file=open_file.source.url,
                tensor=fmt.BLOCK_CHECKSUMS_TENSOR,
            )
        self._rows[tensor] = row
        return row

    def _block_checksums(self) -> tuple[OpenFile, TensorEntry]:
        position, entry = self._files.placement(fmt.BLOCK_CHECKSUMS_TENSOR)
        return self._files.open_files[position], entry


def _row_digest(row: np.ndarray) -> bytes:
    """:func:`kvsnap.format.layer_tensor_digest` of a row already little-endian uint64 and
    contiguous (as read), without a copy."""
    if row.dtype == np.dtype("<u8") and row.flags.c_contiguous:
        return xxhash.xxh3_128_digest(row)
    return fmt.layer_tensor_digest(row)


def _keep_table(key: bytes, table: np.ndarray) -> np.ndarray:
    """``table`` made read-only and, if small enough, kept under ``key``."""
    table.flags.writeable = False
    if table.nbytes <= _MAX_CACHED_TABLE_BYTES:
        _TABLES.put(key, table)
    return table
