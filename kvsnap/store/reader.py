"""The snapshot reader: strict header checks, coalesced verified reads, queued reads.

:class:`SnapshotReader` opens the files (one resolution, one open each) and owns them; the
jobs around them are objects and functions of their own that reach the reader through its
named accessors: :class:`~kvsnap.store.checksums.Checksums` (trailers, block-checksum rows),
:class:`~kvsnap.store.page_reads.PageReads` (one tensor's pages), :mod:`~kvsnap.store.
slot_reads` (many tensors' pages per staging slot) and :mod:`~kvsnap.store.verify` (the full
check).
"""

from __future__ import annotations

import concurrent.futures
import functools
import operator
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from kvsnap import format as fmt
from kvsnap.caches import BoundedLRU, register_cache_clear
from kvsnap.dtypes import SAFETENSORS_TYPES
from kvsnap.errors import NotASnapshotError, SignatureError, SnapshotCorruptError
from kvsnap.format import Problem, SnapshotMetadata, TensorEntry
from kvsnap.format.signing import KeyRing
from kvsnap.layout import KVGeometry
from kvsnap.store import slot_reads
from kvsnap.store.checksums import Checksums
from kvsnap.store.location import INDEX_SUFFIX, Location, locate
from kvsnap.store.opening import decoded_header
from kvsnap.store.page_reads import PageReads
from kvsnap.store.resolve import Form, Resolved, open_retrying
from kvsnap.store.signatures import checked_page_digests, signature_problem, signing_key_id
from kvsnap.store.source import OpenFile, Source
from kvsnap.store.tracing import TraceHook
from kvsnap.store.verify import verify_snapshot

if TYPE_CHECKING:
    import torch


class SnapshotReader:
    """Reads a snapshot (single file or sharded index) from a local path or fsspec URL.

    The constructor validates every header strictly before allocating anything (header size
    limit, offsets inside the file with no overlap or gap, dtypes and shapes against the
    layout, the metadata against the JSON schema) and loads the sequences. With ``verify``
    (the default) it also checks the header and metadata tensors against their checksums, and
    every later read checks each block against its checksum.

    ``url`` may name the ``.safetensors`` file, a sharded snapshot's ``.index.json``, or the
    ``.safetensors`` name a sharded snapshot was written to. With ``keys`` every file must be
    signed by one of them (:class:`~kvsnap.errors.SignatureError` otherwise, before anything
    but its header and the bytes the signature covers is read); a file signed with BLAKE3 page
    digests then has every page it reads, verifies or hands to a restore checked against its
    BLAKE3 digest (``page_digest_table``), whatever ``verify`` says, and every later read
    of the bytes its signature covers is served from the bytes it was checked over. A local
    file of at most ``read_whole_max_bytes`` is read whole,
    with one read, as it opens, and every later read of it is a copy out of those bytes: for a
    caller about to read all of a small snapshot (a checked chunk: docs/benchmarks.md).
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        verify: bool = True,
        io_threads: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        keys: KeyRing | None = None,
        read_whole_max_bytes: int = 0,
    ) -> None:
        location = locate(url, storage_options)
        self._start(location.url, verify, io_threads, keys, read_whole_max_bytes)
        try:
            open_retrying(location, self._open_members)
            self._finish_open()
        except BaseException:
            self.close()
            raise

    @classmethod
    def opened(
        cls,
        resolved: Resolved,
        *,
        verify: bool = True,
        io_threads: int | None = None,
        keys: KeyRing | None = None,
        read_whole_max_bytes: int = 0,
    ) -> SnapshotReader:
        """A reader of the snapshot ``resolved`` describes (single or sharded), opened without
        resolving it again; a file that vanished meanwhile raises, for the caller's
        :func:`~kvsnap.store.resolve.open_retrying` to start over. A local file of at most
        ``read_whole_max_bytes`` is read whole as it opens, and every read of it (header,
        trailer, metadata, pages) is served from those bytes (:class:`~kvsnap.store.source.
        Source`)."""
        reader = cls.__new__(cls)
        reader._start(resolved.location.url, verify, io_threads, keys, read_whole_max_bytes)
        try:
            reader._open_members(resolved)
            reader._finish_open()
        except BaseException:
            reader.close()
            raise
        return reader

    def _start(
        self,
        url: str,
        verify: bool,
        io_threads: int | None,
        keys: KeyRing | None,
        read_whole_max_bytes: int = 0,
    ) -> None:
        self.url = url
        self._read_whole_max_bytes = read_whole_max_bytes
        self._verify = verify
        self._keys = keys
        self._page_reads = PageReads(self, io_threads)
        self._files: list[OpenFile] = []
        self._checksums: Checksums  # made as the files open: a sharded one's knows the index
        self._extents: slot_reads.TensorExtents | None = None
        # Per file opened with keys, the BLAKE3 page digests its signature covers (None for
        # an older file); joined into one table once every file is open.
        self._file_digests: list[np.ndarray | None] = []
        #: The BLAKE3-256 of every page, ``(layer tensors, blocks, 32)`` uint8, as the files'
        #: signatures cover them, for a reader opened with keys of a snapshot signed with
        #: BLAKE3 page digests: every page this reader (and a restore from it) reads is then
        #: checked against these, not against its xxh3-64. ``None`` otherwise (no keys, or an
        #: older signed file: its pages are bound by xxh3-64 only). An attribute, not a
        #: property: every slot of a restore asks.
        self.page_digest_table: np.ndarray | None = None

    def _finish_open(self) -> None:
        geometry = self._header_metadata.geometry
        self._where, self._names, self._tensor_index = _placements(
            tuple(open_file.layout for open_file in self._files), geometry
        )
        self._page_bytes = geometry.canonical_page_size_bytes
        self._num_blocks = self._header_metadata.num_blocks
        if self._keys is not None:
            tensors = len(self._names)
            self.page_digest_table = _joined_digests(self._file_digests, tensors, self.url)
        self.metadata: SnapshotMetadata = self._load_metadata()

    # -- opening ---------------------------------------------------------------------------

    def _open_members(self, resolved: Resolved) -> None:
        """Open the files of ``resolved``, each once, checking each against the index; on any
        error close those opened."""
        try:
            if resolved.form is Form.PARTED:
                assert resolved.index_location is not None
                raise NotASnapshotError(
                    "is the index of a parted snapshot (one file per head range): open it with "
                    "kvsnap.Snapshot.open, or open one part file",
                    file=resolved.index_location.url,
                )
            if resolved.form is Form.SINGLE:
                self._checksums = Checksums(self)
                self._open_single(resolved)
            else:
                assert isinstance(resolved.index, fmt.ShardIndex)
                self._checksums = Checksums(self, resolved.index.trailer_digests)
                self._open_sharded(resolved)
        except BaseException:
            for open_file in self._files:
                open_file.source.close()
            self._files = []
            self._file_digests = []
            raise

    def _open_single(self, resolved: Resolved) -> None:
        (location,) = resolved.members
        header = self._open_file(location, resolved.directory)
        if header.metadata.shard is not None:
            index, count = header.metadata.shard
            raise NotASnapshotError(
                f"this is shard {index} of {count} of a sharded snapshot: open its {INDEX_SUFFIX}",
                file=location.url,
            )
        self._header_metadata = header.metadata

    def _open_file(self, location: Location, directory: str | None) -> fmt.DecodedHeader:
        """Open ``location`` (inside ``directory``), check its header and, with keys, its
        signature; append it to the files and, verifying, load its trailer. Its header."""
        source = Source(location, inside=directory, read_whole_max_bytes=self._read_whole_max_bytes)
        try:
            prefix = source.read(0, min(8, source.size))
            length = fmt.header_length(prefix, source.size, file=source.url)
            header_bytes = prefix + source.read(8, length)
            header, layout = decoded_header(source, header_bytes)
            open_file = OpenFile(source, layout)
            if self._keys is not None:
                self._file_digests.append(checked_page_digests(open_file, self._keys))
        except BaseException:
            source.close()
            raise
        self._files.append(open_file)
        if self._verify:
            self._checksums.load_trailer(len(self._files) - 1)
        return header

    def _open_sharded(self, resolved: Resolved) -> None:
        index = resolved.index
        assert isinstance(index, fmt.ShardIndex) and resolved.index_location is not None
        self._header_metadata = index.metadata
        specs = fmt.specs_for(index.metadata)
        position = 0
        count = len(index.files)
        for number, location in enumerate(resolved.members, start=1):
            header = self._open_file(location, resolved.directory)
            if header.metadata.shard != (number, count):
                raise SnapshotCorruptError(
                    f"claims to be shard {header.metadata.shard}, "
                    f"the index lists it as {number} of {count}",
                    file=location.url,
                )
            if header.metadata.unsharded_document() != index.metadata.document:
                raise SnapshotCorruptError("metadata differs from the index's", file=location.url)
            held = [entry.name for entry in self._files[-1].layout.layer_entries]
            expected = [spec.name for spec in specs[position : position + len(held)]]
            if held != expected or any(index.weight_map[name] != location.name for name in held):
                raise SnapshotCorruptError(
                    "holds other tensors than the index assigns it", file=location.url
                )
            position += len(held)
            if self._verify:
                self._checksums.check_index_digest(number - 1)
        if position != len(specs):
            raise SnapshotCorruptError(
                f"the shards hold {position} of {len(specs)} tensors",
                file=resolved.index_location.url,
            )

    def _load_metadata(self) -> SnapshotMetadata:
        header = self._header_metadata
        names = _metadata_names(len(header.sequences))
        tensors: dict[str, np.ndarray] = {}
        for name in names:
            raw = self._read_checked(name)
            dtype = np.dtype("<i8") if name.startswith("sequences.") else np.dtype(np.uint8)
            array = np.frombuffer(raw, dtype=dtype)
            tensors[name] = (
                array.reshape(-1, fmt.DIGEST_BYTES) if name == fmt.BLOCK_HASHES_TENSOR else array
            )
        return header.with_tensors(tensors, file=self.url)

    # -- signatures ------------------------------------------------------------------------

    def signature_problems(self, keys: KeyRing) -> list[SignatureError]:
        """Why ``keys`` do not vouch for each file of the snapshot (empty: every file is signed
        by one of them over exactly its header and trailer)."""
        found = (signature_problem(open_file, keys) for open_file in self._files)
        return [problem for problem in found if problem is not None]

    def signing_key_ids(self) -> list[str | None]:
        """Per file, the hex id of the key that signed it, unchecked (``None``: unsigned)."""
        return [signing_key_id(open_file) for open_file in self._files]

    # -- what the store's modules reach the reader through ------------------------------------

    @property
    def open_files(self) -> Sequence[OpenFile]:
        """The open data files, in order (one, or the shards)."""
        return self._files

    @property
    def checksums(self) -> Checksums:
        """The snapshot's stored checksums (:class:`~kvsnap.store.checksums.Checksums`)."""
        return self._checksums

    @property
    def page_reads(self) -> PageReads:
        """The reader's page reads and its threads (:class:`~kvsnap.store.page_reads.
        PageReads`)."""
        return self._page_reads

    def placement(self, name: str) -> tuple[int, TensorEntry]:
        """Which of :attr:`open_files` holds tensor ``name``, and its entry there."""
        try:
            return self._where[name]
        except KeyError:
            raise KeyError(f"no tensor {name!r} in {self.url}") from None

    def layer(self, name: str) -> tuple[int, OpenFile, TensorEntry]:
        """Layer tensor ``name``'s number (its index in :attr:`layer_names`), file and entry."""
        tensor = self._tensor_index.get(name)
        if tensor is None:
            raise KeyError(
                f"{name!r} is not a layer tensor of {self.url} (they are {self._names[0]}, ...)"
            )
        position, entry = self.placement(name)
        return tensor, self._files[position], entry

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Layer tensor names, in file order."""
        return self._names

    @property
    def num_blocks(self) -> int:
        """Blocks of every layer tensor."""
        return self._num_blocks

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of a layer tensor (one canonical page)."""
        return self._page_bytes

    def extents(self) -> slot_reads.TensorExtents:
        """Where each layer tensor's pages lie, worked out once."""
        if self._extents is None:
            sources = [open_file.source for open_file in self._files]
            located = [self._where[name] for name in self._names]
            self._extents = slot_reads.tensor_extents(sources, located, self._page_bytes)
        return self._extents

    def _read_checked(self, name: str) -> bytes:
        """A whole non-layer tensor's bytes, checked against the trailer when verifying."""
        position, entry = self.placement(name)
        source = self._files[position].source
        raw = source.read(entry.begin, entry.nbytes, tensor=name)
        expected = self._checksums.digest(name, position) if self._verify else None
        if expected is not None:
            if fmt.digest128(raw) != expected:
                raise SnapshotCorruptError(
                    "does not match its xxh3-128 checksum", file=source.url, tensor=name
                )
            if source.holds_whole:
                self._checksums.note_held_match(position, name)
        return raw

    # -- public API ------------------------------------------------------------------------

    @property
    def format_version(self) -> int:
        """The snapshot format version the file was written in."""
        return int(self._header_metadata.document["format_version"])

    def trailer_digest(self) -> str:
        """xxh3-128 (32 hex digits) of a single-file snapshot's checksum trailer, read from the
        file: what a parted snapshot's index records for each part."""
        if len(self._files) != 1:
            raise ValueError("trailer_digest is defined for a single-file snapshot")
        open_file = self._files[0]
        entry = open_file.layout.by_name[fmt.CHECKSUMS_TENSOR]
        raw = open_file.source.read(entry.begin, entry.nbytes, tensor=fmt.CHECKSUMS_TENSOR)
        return xxhash.xxh3_128_hexdigest(raw)

    @property
    def files(self) -> list[str]:
        """The data files, in order (one, or the shards)."""
        return [open_file.source.url for open_file in self._files]

    def locate(self, name: str) -> tuple[str, TensorEntry]:
        """The file holding tensor ``name`` and its entry (absolute file offsets)."""
        position, entry = self.placement(name)
        return self._files[position].source.url, entry

    def page_size_bytes(self, name: str) -> int:
        """Bytes of one block of layer tensor ``name``."""
        self.layer(name)
        return self._page_bytes

    def tensor_names(self) -> list[str]:
        """Layer tensor names, in file order."""
        return list(self._names)

    @property
    def verifies(self) -> bool:
        """Whether this reader checks the pages it reads: against their stored checksums
        (``verify``), or, opened with keys, against their signed BLAKE3 digests
        (``page_digest_table``)."""
        return self._verify or self.page_digest_table is not None

    def block_checksums(self, name: str) -> np.ndarray:
        """The stored xxh3-64 of every block of layer tensor ``name`` (checked against the
        trailer; :class:`SnapshotCorruptError` if they do not match it)."""
        tensor, _, _ = self.layer(name)
        return self._checksums.row(tensor)

    def stored_checksums(self, page_tensors: np.ndarray, page_blocks: np.ndarray) -> np.ndarray:
        """The stored xxh3-64 of page ``i`` (block ``page_blocks[i]`` of tensor
        ``page_tensors[i]``), as uint64; :class:`SnapshotCorruptError` if the stored
        checksums themselves are damaged."""
        return self._checksums.table()[page_tensors, page_blocks]

    def verify(self, progress: Callable[[int], None] | None = None) -> list[Problem]:
        """Check every checksum and the structure; ``[]`` means the snapshot is intact.

        Reads the whole snapshot once, in bounded pieces. Reports a header or index that does
        not match its checksum, each corrupt tensor, the first corrupt blocks of each layer
        tensor by index, non-zero padding, and sequences whose token ids do not hash to the
        stored prefix hashes. ``progress`` receives the KV (layer) bytes checked so far.
        """
        return verify_snapshot(self, progress)

    def read_pages(self, name: str, block_ids: np.ndarray | Sequence[int], out: np.ndarray) -> None:
        """Read blocks ``block_ids`` of layer tensor ``name``, in that order, into ``out``.

        ``out`` is a C-contiguous uint8 array of at least ``len(block_ids) * page_bytes``
        bytes; page ``i`` lands at ``[i*page_bytes, (i+1)*page_bytes)``. Consecutive ids are
        read as one range and only the blocks asked for are read. With ``verify`` every block
        is checked against its xxh3-64 (:class:`SnapshotCorruptError` naming the block).
        """
        self._page_reads.read(name, block_ids, out)

    def read_pages_async(
        self,
        name: str,
        block_ids: np.ndarray | Sequence[int],
        out: np.ndarray,
        *,
        trace: TraceHook | None = None,
    ) -> concurrent.futures.Future[None]:
        """:meth:`read_pages` on the reader's threads; the arguments are checked before it returns.

        The future completes once no thread touches ``out`` any more: with ``None``, or the
        first error (the pieces not started yet are then skipped). Calls queue behind each
        other, so a caller that keeps the next buffer's call queued keeps the disk busy while
        it consumes the previous buffer. ``trace`` receives a ``read`` and a ``verify`` span
        per piece.
        """
        return self._page_reads.read_async(name, block_ids, out, trace)

    def read_slot_async(
        self,
        page_tensors: np.ndarray,
        page_blocks: np.ndarray,
        page_offsets: np.ndarray,
        out: np.ndarray,
        *,
        verify: bool = True,
        trace: TraceHook | None = None,
        inline: bool = False,
    ) -> concurrent.futures.Future[np.ndarray]:
        """Read many tensors' pages into one buffer; see :func:`kvsnap.store.slot_reads.
        read_slot_async` (the future gives the pages that failed their checksum). ``verify``
        False skips the checksums here (a caller that checks the pages itself, on the device,
        against :meth:`stored_checksums`); a reader opened without verification never checks.
        ``inline``: the caller may wait for the read, which a small slot then gets on this
        thread (:data:`~kvsnap.store.tuning.INLINE_READ_MAX_BYTES`).

        ``page_tensors`` index :meth:`tensor_names`; the arrays must be int64 and in range
        (``IndexError`` otherwise), ``out`` large enough (``ValueError``).
        """
        return slot_reads.read_reader_slot(
            self,
            page_tensors,
            page_blocks,
            page_offsets,
            out,
            verify=verify,
            trace=trace,
            inline=inline,
        )

    def page_runs(
        self, page_tensors: np.ndarray, page_blocks: np.ndarray, page_offsets: np.ndarray
    ) -> slot_reads.PageRuns:
        """Where a slot's pages lie in this snapshot's files (see :func:`kvsnap.store.
        slot_reads.page_runs`); a run's file indexes :meth:`local_files`."""
        return slot_reads.page_runs(self.extents(), page_tensors, page_blocks, page_offsets)

    def held_file(self) -> np.ndarray | None:
        """The bytes of a one-file snapshot read whole as it opened (``read_whole_max_bytes``;
        valid while the reader is open; page ``b`` of layer tensor ``t`` lies at
        ``extents().begin[t] + b * page_bytes``); ``None`` for a snapshot of several files or
        one not read whole."""
        if len(self._files) != 1:
            return None
        source = self._files[0].source
        return source.held(0, source.size)

    def local_files(self) -> list[tuple[str, int, os.stat_result]] | None:
        """Per file of the snapshot (the order :meth:`page_runs` uses): its path, the open
        descriptor this reader checked it through, and that descriptor's ``fstat``; ``None``
        unless every file is local."""
        files = []
        for open_file in self._files:
            entry = open_file.source.local_file()
            if entry is None:
                return None
            files.append(entry)
        return files

    def read_tensor(self, name: str) -> torch.Tensor:
        """A whole tensor (layer, sequence or ``kvsnap.*``) with its dtype and shape, verified
        when the reader verifies."""
        import torch  # not at module level: verifying and inspecting a snapshot need no torch

        _, entry = self.placement(name)
        dtype = SAFETENSORS_TYPES[entry.dtype].torch
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=dtype)
        buffer = np.empty(entry.nbytes, dtype=np.uint8)
        if name in self._tensor_index:
            self.read_pages(name, np.arange(self._num_blocks), buffer)
        else:
            buffer[:] = np.frombuffer(self._read_checked(name), dtype=np.uint8)
        return torch.from_numpy(buffer).view(dtype).reshape(entry.shape)

    def close(self) -> None:
        """Close every file and stop the reader's threads."""
        for open_file in self._files:
            open_file.source.close()
        self._page_reads.close()

    def __enter__(self) -> SnapshotReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _joined_digests(per_file: list[np.ndarray | None], tensors: int, url: str) -> np.ndarray | None:
    """One table of every layer tensor's page digests (files hold their tensors in order), or
    ``None`` unless every file has one."""
    if not per_file or any(digests is None for digests in per_file):
        return None
    tables = [digests for digests in per_file if digests is not None]
    table = tables[0] if len(tables) == 1 else np.concatenate(tables)
    if len(table) != tensors:
        raise SnapshotCorruptError("the page digests do not cover every layer tensor", file=url)
    return table


@functools.lru_cache(maxsize=16)
def _metadata_names(sequences: int) -> tuple[str, ...]:
    """The metadata tensors of a snapshot of ``sequences`` sequences, in file order."""
    parts = ("token_ids", "block_ids")
    per_sequence = [f"sequences.{index}.{part}" for index in range(sequences) for part in parts]
    return (*per_sequence, fmt.BLOCK_HASHES_TENSOR)


register_cache_clear(_metadata_names.cache_clear)


#: A reader's placements of a snapshot's layer tensors: by name, their file and entry; their
#: names in order; by name, their number.
Placements = tuple[dict[str, tuple[int, TensorEntry]], tuple[str, ...], dict[str, int]]
#: Placements per tuple of the files' entries, by identity (the layouts of one shape share
#: their entries: :func:`kvsnap.format.container.pack_file`), and geometry: worked out once
#: per shape, not on every open of a new file (~1 us a tensor).
_PLACEMENTS: BoundedLRU[
    tuple[int, ...], tuple[tuple[tuple[TensorEntry, ...], ...], KVGeometry, Placements]
]
_PLACEMENTS = BoundedLRU(64)


def _placements(layouts: tuple[fmt.FileLayout, ...], geometry: KVGeometry) -> Placements:
    """Where each layer tensor of the files ``layouts`` lies (file position and entry), the
    layer names of ``geometry`` in order, and each name's number; shared by every reader of
    files with these entries (do not change them)."""
    entries = tuple(layout.entries for layout in layouts)
    key = tuple(map(id, entries))
    known = _PLACEMENTS.get(key)
    # The kept entries are held, so no other object can have their ids meanwhile.
    if known is not None and known[1] == geometry and all(map(operator.is_, known[0], entries)):
        return known[2]
    where = {
        entry.name: (index, entry)
        for index, layout in enumerate(layouts)
        for entry in layout.layer_entries
    }
    names = tuple(geometry.tensor_names())
    placements = (where, names, {name: index for index, name in enumerate(names)})
    _PLACEMENTS.put(key, (entries, geometry, placements))
    return placements
