"""The snapshot reader: strict header checks, coalesced verified reads, queued reads."""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from kvsnap import format as fmt
from kvsnap.dtypes import SAFETENSORS_TYPES
from kvsnap.errors import (
    NotASnapshotError,
    SignatureError,
    SnapshotCorruptError,
    SnapshotIOError,
)
from kvsnap.format import SnapshotMetadata, TensorEntry
from kvsnap.format.signing import KeyRing
from kvsnap.store import slot_reads, tuning
from kvsnap.store.completion import Completion
from kvsnap.store.location import INDEX_SUFFIX, Location, locate
from kvsnap.store.opening import decoded_header
from kvsnap.store.resolve import Form, Resolved, open_retrying
from kvsnap.store.signatures import signature_problem, signing_key_id
from kvsnap.store.slot_reads import SlotReading
from kvsnap.store.source import OpenFile, Source, check_blocks
from kvsnap.store.tracing import TraceHook, traced
from kvsnap.store.verify import ReaderVerification

if TYPE_CHECKING:
    import torch


class SnapshotReader(ReaderVerification, SlotReading):
    """Reads a snapshot (single file or sharded index) from a local path or fsspec URL.

    The constructor validates every header strictly before allocating anything (header size
    limit, offsets inside the file with no overlap or gap, dtypes and shapes against the
    layout, the metadata against the JSON schema) and loads the sequences. With ``verify``
    (the default) it also checks the header and metadata tensors against their checksums, and
    every later read checks each block against its checksum.

    ``url`` may name the ``.safetensors`` file, a sharded snapshot's ``.index.json``, or the
    ``.safetensors`` name a sharded snapshot was written to. With ``keys`` every file must be
    signed by one of them (:class:`~kvsnap.errors.SignatureError` otherwise, before anything
    but its header is read).
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        verify: bool = True,
        io_threads: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        keys: KeyRing | None = None,
    ) -> None:
        location = locate(url, storage_options)
        self._start(location.url, verify, io_threads, keys)
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
    ) -> SnapshotReader:
        """A reader of the snapshot ``resolved`` describes (single or sharded), opened without
        resolving it again; a file that vanished meanwhile raises, for the caller's
        :func:`~kvsnap.store.resolve.open_retrying` to start over."""
        reader = cls.__new__(cls)
        reader._start(resolved.location.url, verify, io_threads, keys)
        try:
            reader._open_members(resolved)
            reader._finish_open()
        except BaseException:
            reader.close()
            raise
        return reader

    def _start(self, url: str, verify: bool, io_threads: int | None, keys: KeyRing | None) -> None:
        self.url = url
        self._verify = verify
        self._keys = keys
        self._threads = io_threads or max(2, min(8, os.cpu_count() or 1))
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._files: list[OpenFile] = []
        self._rows: dict[int, np.ndarray] = {}
        self._table: np.ndarray | None = None
        self._tensor_extents: slot_reads.TensorExtents | None = None
        self._index_digests: tuple[str, ...] | None = None

    def _finish_open(self) -> None:
        self._where = {
            entry.name: (index, entry)
            for index, open_file in enumerate(self._files)
            for entry in open_file.layout.entries
            if not fmt.is_container_tensor(entry.name)
        }
        geometry = self._header_metadata.geometry
        self._names = geometry.tensor_names()
        self._tensor_index = {name: index for index, name in enumerate(self._names)}
        self._page_bytes = geometry.canonical_page_size_bytes
        self._num_blocks = self._header_metadata.num_blocks
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
                self._open_single(resolved)
            else:
                self._open_sharded(resolved)
        except BaseException:
            for open_file in self._files:
                open_file.source.close()
            self._files = []
            self._index_digests = None
            raise

    def _open_single(self, resolved: Resolved) -> None:
        (location,) = resolved.members
        open_file, header = self._open_file(location, resolved.directory)
        self._files.append(open_file)
        if header.metadata.shard is not None:
            index, count = header.metadata.shard
            raise NotASnapshotError(
                f"this is shard {index} of {count} of a sharded snapshot: open its {INDEX_SUFFIX}",
                file=location.url,
            )
        self._header_metadata = header.metadata

    def _open_file(
        self, location: Location, directory: str | None
    ) -> tuple[OpenFile, fmt.DecodedHeader]:
        source = Source(location, inside=directory)
        try:
            prefix = source.read(0, min(8, source.size))
            length = fmt.header_length(prefix, source.size, file=source.url)
            header_bytes = prefix + source.read(8, length)
            header, layout = decoded_header(source, header_bytes)
            open_file = OpenFile(source, layout)
            if self._keys is not None:
                problem = signature_problem(open_file, self._keys)
                if problem is not None:
                    raise problem
            if self._verify:
                self._load_trailer(open_file)
        except BaseException:
            source.close()
            raise
        return open_file, header

    def _open_sharded(self, resolved: Resolved) -> None:
        index = resolved.index
        assert isinstance(index, fmt.ShardIndex) and resolved.index_location is not None
        self._header_metadata = index.metadata
        self._index_digests = index.trailer_digests
        specs = fmt.specs_for(index.metadata)
        position = 0
        count = len(index.files)
        for number, location in enumerate(resolved.members, start=1):
            open_file, header = self._open_file(location, resolved.directory)
            self._files.append(open_file)
            if header.metadata.shard != (number, count):
                raise SnapshotCorruptError(
                    f"claims to be shard {header.metadata.shard}, "
                    f"the index lists it as {number} of {count}",
                    file=location.url,
                )
            if header.metadata.unsharded_document() != index.metadata.document:
                raise SnapshotCorruptError("metadata differs from the index's", file=location.url)
            held = [entry.name for entry in open_file.layout.checksummed()]
            expected = [spec.name for spec in specs[position : position + len(held)]]
            if held != expected or any(index.weight_map[name] != location.name for name in held):
                raise SnapshotCorruptError(
                    "holds other tensors than the index assigns it", file=location.url
                )
            position += len(held)
            if self._verify:
                self._check_index_digest(number - 1)
        if position != len(specs):
            raise SnapshotCorruptError(
                f"the shards hold {position} of {len(specs)} tensors",
                file=resolved.index_location.url,
            )

    def _load_trailer(self, open_file: OpenFile) -> None:
        layout = open_file.layout
        entry = layout.by_name[fmt.CHECKSUMS_TENSOR]
        raw = open_file.source.read(entry.begin, entry.nbytes, tensor=fmt.CHECKSUMS_TENSOR)
        digests = fmt.decode_trailer(raw, file=open_file.source.url)
        if digests[0] != fmt.digest128(layout.header):
            # The trailer checked out, so the header bytes are what changed.
            raise SnapshotCorruptError(
                "header does not match its checksum (trailer row 0)", file=open_file.source.url
            )
        open_file.trailer = digests
        open_file.row_of = {
            item.name: row for row, item in enumerate(layout.checksummed(), start=1)
        }

    def _check_index_digest(self, shard: int) -> None:
        assert self._index_digests is not None
        open_file = self._files[shard]
        entry = open_file.layout.by_name[fmt.CHECKSUMS_TENSOR]
        raw = open_file.source.read(entry.begin, entry.nbytes, tensor=fmt.CHECKSUMS_TENSOR)
        if xxhash.xxh3_128_hexdigest(raw) != self._index_digests[shard]:
            raise SnapshotCorruptError(
                "shard does not match the index (a shard of another snapshot, or a partly "
                "published overwrite)",
                file=open_file.source.url,
                tensor=fmt.CHECKSUMS_TENSOR,
            )

    def _load_metadata(self) -> SnapshotMetadata:
        header = self._header_metadata
        names = [
            f"sequences.{index}.{part}"
            for index in range(len(header.sequences))
            for part in ("token_ids", "block_ids")
        ]
        tensors: dict[str, np.ndarray] = {}
        for name in [*names, fmt.BLOCK_HASHES_TENSOR]:
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

    # -- helpers ---------------------------------------------------------------------------

    def _locate_tensor(self, name: str) -> tuple[OpenFile, TensorEntry]:
        try:
            index, entry = self._where[name]
        except KeyError:
            raise KeyError(f"no tensor {name!r} in {self.url}") from None
        return self._files[index], entry

    def _expected_digest(self, open_file: OpenFile, name: str) -> bytes | None:
        if open_file.trailer is None or open_file.row_of is None:
            return None
        return open_file.trailer[open_file.row_of[name]]

    def _read_checked(self, name: str) -> bytes:
        """A whole non-layer tensor's bytes, checked against the trailer when verifying."""
        open_file, entry = self._locate_tensor(name)
        raw = open_file.source.read(entry.begin, entry.nbytes, tensor=name)
        expected = self._expected_digest(open_file, name) if self._verify else None
        if expected is not None and fmt.digest128(raw) != expected:
            raise SnapshotCorruptError(
                "does not match its xxh3-128 checksum", file=open_file.source.url, tensor=name
            )
        return raw

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self._threads, thread_name_prefix="kvsnap-read"
            )
        return self._pool

    def _ensure_trailers(self) -> None:
        for open_file in self._files:
            if open_file.trailer is None:
                self._load_trailer(open_file)

    def _block_checksum_row(self, tensor: int) -> np.ndarray:
        """Stored xxh3-64 of every block of layer tensor ``tensor``, checked against the trailer."""
        row = self._rows.get(tensor)
        if row is not None:
            return row
        self._ensure_trailers()
        open_file, entry = self._locate_tensor(fmt.BLOCK_CHECKSUMS_TENSOR)
        num_blocks = self._num_blocks
        raw = open_file.source.read(
            entry.begin + tensor * num_blocks * 8, num_blocks * 8, tensor=fmt.BLOCK_CHECKSUMS_TENSOR
        )
        row = np.frombuffer(raw, dtype="<u8")
        name = self._names[tensor]
        layer_file, _ = self._locate_tensor(name)
        if fmt.layer_tensor_digest(row) != self._expected_digest(layer_file, name):
            raise SnapshotCorruptError(
                f"the stored block checksums of {name} do not match their xxh3-128 checksum",
                file=open_file.source.url,
                tensor=fmt.BLOCK_CHECKSUMS_TENSOR,
            )
        self._rows[tensor] = row
        return row

    def _layer(self, name: str) -> tuple[int, OpenFile, TensorEntry]:
        tensor = self._tensor_index.get(name)
        if tensor is None:
            raise KeyError(
                f"{name!r} is not a layer tensor of {self.url} (they are {self._names[0]}, ...)"
            )
        open_file, entry = self._locate_tensor(name)
        return tensor, open_file, entry

    def _pieces(self, block_ids: np.ndarray) -> list[tuple[int, int, int]]:
        """Coalesced reads ``(first_block, num_blocks, output_page)``: runs of consecutive ids,
        cut at about tuning.SUBCHUNK_BYTES so threads share large runs."""
        if not len(block_ids):
            return []
        breaks = np.flatnonzero(np.diff(block_ids) != 1) + 1
        starts = np.concatenate(([0], breaks))
        stops = np.concatenate((breaks, [len(block_ids)]))
        per = max(1, tuning.SUBCHUNK_BYTES // self._page_bytes)
        pieces = []
        for start, stop in zip(starts.tolist(), stops.tolist(), strict=True):
            for position in range(start, stop, per):
                count = min(per, stop - position)
                pieces.append((int(block_ids[position]), count, position))
        return pieces

    def _run(
        self, work: Callable[[Any], Any], items: Sequence[Any], concurrent_ok: bool, nbytes: int
    ) -> list[Any]:
        if concurrent_ok and len(items) > 1 and nbytes > tuning.SUBCHUNK_BYTES:
            return list(self._executor().map(work, items))
        return [work(item) for item in items]

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
        open_file, entry = self._locate_tensor(name)
        return open_file.source.url, entry

    def page_size_bytes(self, name: str) -> int:
        """Bytes of one block of layer tensor ``name``."""
        self._layer(name)
        return self._page_bytes

    def tensor_names(self) -> list[str]:
        """Layer tensor names, in file order."""
        return list(self._names)

    def block_checksums(self, name: str) -> np.ndarray:
        """The stored xxh3-64 of every block of layer tensor ``name`` (checked against the
        trailer; :class:`SnapshotCorruptError` if they do not match it)."""
        tensor, _, _ = self._layer(name)
        return self._block_checksum_row(tensor)

    def read_pages(self, name: str, block_ids: np.ndarray | Sequence[int], out: np.ndarray) -> None:
        """Read blocks ``block_ids`` of layer tensor ``name``, in that order, into ``out``.

        ``out`` is a C-contiguous uint8 array of at least ``len(block_ids) * page_bytes``
        bytes; page ``i`` lands at ``[i*page_bytes, (i+1)*page_bytes)``. Consecutive ids are
        read as one range and only the blocks asked for are read. With ``verify`` every block
        is checked against its xxh3-64 (:class:`SnapshotCorruptError` naming the block).
        """
        read_piece, pieces, concurrent_ok = self._piece_reader(name, block_ids, out, None)
        nbytes = sum(count for _, count, _ in pieces) * self._page_bytes
        # Small reads stay on the calling thread: a handoff costs more than it saves.
        if concurrent_ok and len(pieces) > 1 and nbytes > tuning.SUBCHUNK_BYTES:
            self._submit_pieces(read_piece, pieces).result()
        else:
            for piece in pieces:
                read_piece(piece)

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
        read_piece, pieces, _ = self._piece_reader(name, block_ids, out, trace)
        return self._submit_pieces(read_piece, pieces)

    def _submit_pieces(
        self, read_piece: Callable[[tuple[int, int, int]], None], pieces: list[tuple[int, int, int]]
    ) -> concurrent.futures.Future[None]:
        done = Completion(
            len(pieces),
            cancelled=lambda: SnapshotIOError("skipped after an earlier failure", file=self.url),
        )
        executor = self._executor()
        for piece in pieces:
            done.watch(executor.submit(read_piece, piece))
        return done.future

    def _piece_reader(
        self,
        name: str,
        block_ids: np.ndarray | Sequence[int],
        out: np.ndarray,
        trace: TraceHook | None,
    ) -> tuple[Callable[[tuple[int, int, int]], None], list[tuple[int, int, int]], bool]:
        """Check a read of ``block_ids`` into ``out``; the function that reads (and verifies)
        one piece, the pieces, and whether pieces may run concurrently."""
        tensor, open_file, entry = self._layer(name)
        ids = np.asarray(block_ids)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise ValueError("block_ids must be a one-dimensional integer array")
        ids = ids.astype(np.int64, copy=False)
        num_blocks = self._num_blocks
        if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
            raise IndexError(
                f"{name}: block ids must lie in [0, {num_blocks}), got {ids.min()}..{ids.max()}"
            )
        if not isinstance(out, np.ndarray) or out.dtype != np.uint8 or not out.flags.c_contiguous:
            raise TypeError("out must be a C-contiguous uint8 numpy array")
        page = self._page_bytes
        needed = len(ids) * page
        if out.nbytes < needed:
            raise ValueError(f"out holds {out.nbytes} bytes, {len(ids)} pages need {needed}")
        flat = out.reshape(-1)
        row = self._block_checksum_row(tensor) if self._verify else None
        source = open_file.source

        def read_piece(piece: tuple[int, int, int]) -> None:
            block, count, position = piece
            view = flat[position * page : (position + count) * page]
            with traced(trace, "read", view.nbytes):
                source.read_into(entry.begin + block * page, memoryview(view), tensor=name)
            if row is not None:
                with traced(trace, "verify", view.nbytes):
                    check_blocks(view, page, row, block, source.url, name)

        return read_piece, self._pieces(ids), source.concurrent

    def read_tensor(self, name: str) -> torch.Tensor:
        """A whole tensor (layer, sequence or ``kvsnap.*``) with its dtype and shape, verified
        when the reader verifies."""
        import torch  # not at module level: verifying and inspecting a snapshot need no torch

        _, entry = self._locate_tensor(name)
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
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> SnapshotReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
