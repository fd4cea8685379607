"""Full verification of an open snapshot: every checksum, padding, prefix hash chains.

:func:`verify_snapshot` is :meth:`SnapshotReader.verify <kvsnap.store.reader.SnapshotReader.
verify>`; it reaches the reader through its named accessors (``open_files``, ``checksums``,
``placement``, ``page_reads``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from kvsnap import format as fmt
from kvsnap.errors import SnapshotCorruptError
from kvsnap.format import Problem, TensorEntry
from kvsnap.store import tuning
from kvsnap.store.held_verify import verified_held
from kvsnap.store.source import OpenFile

if TYPE_CHECKING:
    from kvsnap.store.reader import SnapshotReader


def verify_snapshot(
    reader: SnapshotReader, progress: Callable[[int], None] | None = None
) -> list[Problem]:
    """Every checksum and the structure of ``reader``'s snapshot checked, reading it once in
    bounded pieces; ``[]`` means intact (see :meth:`SnapshotReader.verify`). A file read
    whole as it opened is checked in one pass over its bytes first
    (:func:`~kvsnap.store.held_verify.verified_held`); only one that does not pass it (or is of
    a shape it does not cover) is walked here, entry by entry, to name its problems."""
    if verified_held(reader, progress):
        return []
    problems = _check_trailers(reader)
    checksums = reader.checksums
    layers = _LayerBatches(reader, problems, progress)
    for position, open_file in enumerate(reader.open_files):
        for entry in open_file.layout.entries:
            if entry.name in (fmt.CHECKSUMS_TENSOR, fmt.SIGNATURE_TENSOR):
                continue  # the trailer was checked above; a signature needs the keys
            if fmt.is_layer_tensor(entry.name):
                layers.add(open_file, entry)
                continue
            try:
                if entry.name.startswith(fmt.PADDING_PREFIX):
                    problems += _verify_padding(open_file, entry)
                elif checksums.has_trailer(position) and not checksums.held_match(
                    position, entry.name
                ):
                    problems += _verify_whole(reader, position, entry)
            except SnapshotCorruptError as error:
                problems.append(Problem(error.tensor or entry.name, error.block, str(error)))
        layers.flush()
    problems += _verify_hash_chains(reader)
    return problems


#: Consecutive layer tensors of one file are read and hashed together up to this many bytes: a
#: prefix chunk of a small model is dozens of tensors of a few pages each, where a read and a
#: digest call per tensor cost more than the bytes (a 12-layer chunk: 24 tensors of 64 KiB).
#: A larger tensor is read on its own, in pieces on the reader's threads.
LAYER_BATCH_BYTES = 8 << 20
#: Tensors this close apart (the alignment padding between them) are read as one run, the
#: padding with them (it is checked on its own as well).
LAYER_BATCH_GAP_BYTES = 64 << 10


class _LayerBatches:
    """Layer tensors verified in batches: a run of tensors that follow each other in one file
    is one read, one digest pass and one read of their stored checksum rows."""

    def __init__(
        self,
        reader: SnapshotReader,
        problems: list[Problem],
        progress: Callable[[int], None] | None,
    ) -> None:
        self._reader = reader
        self._problems = problems
        self._progress = progress
        self._index = {name: tensor for tensor, name in enumerate(reader.layer_names)}
        self._file: OpenFile | None = None
        self._entries: list[TensorEntry] = []
        self._done = 0

    def add(self, open_file: OpenFile, entry: TensorEntry) -> None:
        """Verify ``entry`` of ``open_file`` with the run it continues, or start a new run."""
        if self._entries:
            last = self._entries[-1]
            follows = (
                open_file is self._file
                and 0 <= entry.begin - last.end <= LAYER_BATCH_GAP_BYTES
                and self._index[entry.name] == self._index[last.name] + 1
            )
            size = entry.end - self._entries[0].begin
            if not follows or size > LAYER_BATCH_BYTES:
                self.flush()
        whole = entry.nbytes == self._reader.num_blocks * self._reader.page_bytes
        if entry.nbytes > LAYER_BATCH_BYTES or not whole:
            self._verify_alone(open_file, entry)
            return
        self._file = open_file
        self._entries.append(entry)

    def flush(self) -> None:
        """Verify the run collected so far."""
        entries, self._entries = self._entries, []
        if not entries:
            return
        assert self._file is not None
        try:
            self._problems += _verify_run(self._reader, self._file, entries, self._index)
        except SnapshotCorruptError as error:
            first = entries[0].name
            self._problems.append(Problem(error.tensor or first, error.block, str(error)))
        self._advance(sum(entry.nbytes for entry in entries))

    def _verify_alone(self, open_file: OpenFile, entry: TensorEntry) -> None:
        try:
            row, trusted = _stored_row(self._reader, entry.name, self._problems)
            self._problems += _verify_layer(self._reader, open_file, entry, row, trusted)
        except SnapshotCorruptError as error:
            self._problems.append(Problem(error.tensor or entry.name, error.block, str(error)))
        self._advance(entry.nbytes)

    def _advance(self, nbytes: int) -> None:
        self._done += nbytes
        if self._progress is not None:
            self._progress(self._done)


def _verify_run(
    reader: SnapshotReader,
    open_file: OpenFile,
    entries: list[TensorEntry],
    index: dict[str, int],
) -> list[Problem]:
    """Layer tensors ``entries`` (in tensor order, close together in ``open_file``) checked
    against their stored block checksums with one read of their bytes (and the padding between
    them) and one of their rows; tensors that follow each other with no padding (a small
    model's chunk: every layer) are hashed as one buffer and compared as one array."""
    checksums = reader.checksums
    first = index[entries[0].name]
    rows = checksums.stored_rows(first, len(entries))
    low = entries[0].begin
    # A file read whole is hashed where it lies; otherwise read the run.
    buffer = open_file.source.held(low, entries[-1].end - low)
    if buffer is None:
        buffer = np.empty(entries[-1].end - low, dtype=np.uint8)
        open_file.source.read_into(low, memoryview(buffer), tensor=entries[0].name)
    page = reader.page_bytes
    bound = reader.page_digest_table
    digest = fmt.block_digests if bound is None else fmt.page_digests
    shape = (len(entries), reader.num_blocks, 1 if bound is None else fmt.PAGE_DIGEST_BYTES)
    if all(entry.begin == before.end for before, entry in itertools.pairwise(entries)):
        computed = digest(buffer, page).reshape(shape)
    else:
        computed = np.stack(
            [digest(buffer[entry.begin - low : entry.end - low], page) for entry in entries]
        ).reshape(shape)
    # Signed with BLAKE3 page digests and opened with keys: the pages are checked against
    # those (they catch all xxh3-64 would), the block checksums' rows against the trailer.
    stored = rows[:, :, None] if bound is None else bound[first : first + len(entries)]
    differs = (computed != stored).any(axis=(1, 2))
    verdicts = checksums.rows_trusted(first, rows)
    every_row_trusted = all(verdicts)
    if every_row_trusted:
        checksums.remember_rows(first, rows)
    problems: list[Problem] = []
    for offset, entry in enumerate(entries):
        trusted = verdicts[offset]
        if trusted is False:
            problems.append(_untrusted_row(reader, entry.name))
        elif trusted and not every_row_trusted:
            checksums.remember_row(first + offset, rows[offset])
        if differs[offset]:
            url = open_file.source.url
            if bound is not None:
                problems += _digest_problems(url, entry.name, computed[offset], stored[offset])
                continue
            problems += _block_problems(
                url, entry.name, computed[offset, :, 0], rows[offset], bool(trusted)
            )
    return problems


def _check_trailers(reader: SnapshotReader) -> list[Problem]:
    """Every file's trailer read again and checked (and against the index, sharded); a file
    whose trailer fails has its tensors' digests unknown from then on. A trailer loaded from
    the bytes a file was read whole into is not read again: it would be those bytes."""
    checksums = reader.checksums
    problems = []
    for position in range(len(reader.open_files)):
        try:
            if not checksums.trailer_held(position):
                checksums.load_trailer(position)
            if checksums.sharded:
                checksums.check_index_digest(position)
        except SnapshotCorruptError as error:
            problems.append(Problem(error.tensor, error.block, str(error)))
            checksums.forget_trailer(position)
    return problems


def _stored_row(
    reader: SnapshotReader, name: str, problems: list[Problem]
) -> tuple[np.ndarray, bool]:
    """Layer tensor ``name``'s stored block checksums, and whether they match their own
    checksum (a trusted row). An untrusted row still names the blocks that disagree."""
    tensor = reader.layer_names.index(name)
    row = reader.checksums.stored_row(tensor)
    trusted = reader.checksums.row_trusted(tensor, row)
    if trusted is False:
        problems.append(_untrusted_row(reader, name))
    return row, bool(trusted)


def _untrusted_row(reader: SnapshotReader, name: str) -> Problem:
    """The problem of layer tensor ``name``'s stored block checksums not matching the trailer."""
    position, _ = reader.placement(fmt.BLOCK_CHECKSUMS_TENSOR)
    url = reader.open_files[position].source.url
    return Problem(
        fmt.BLOCK_CHECKSUMS_TENSOR,
        None,
        f"{url}: the stored block checksums of {name} do not match their xxh3-128 checksum",
    )


def _verify_padding(open_file: OpenFile, entry: TensorEntry) -> list[Problem]:
    held = open_file.source.held(entry.begin, entry.nbytes)
    if held is None:
        raw = open_file.source.read(entry.begin, entry.nbytes, tensor=entry.name)
        held = np.frombuffer(raw, dtype=np.uint8)
    if held.any():
        url = open_file.source.url
        return [Problem(entry.name, None, f"{url}: padding {entry.name} is not all zero")]
    return []


def _verify_whole(reader: SnapshotReader, position: int, entry: TensorEntry) -> list[Problem]:
    open_file = reader.open_files[position]
    expected = reader.checksums.digest(entry.name, position)
    if _digest128(open_file, entry) != expected:
        url = open_file.source.url
        return [
            Problem(entry.name, None, f"{url}: {entry.name} does not match its xxh3-128 checksum")
        ]
    return []


def _digest128(open_file: OpenFile, entry: TensorEntry) -> bytes:
    """xxh3-128 of ``entry``'s bytes: where they lie in a file read whole, else read in pieces
    of at most ``SUBCHUNK_BYTES``."""
    held = open_file.source.held(entry.begin, entry.nbytes)
    if held is not None:
        return fmt.digest128(held)
    hasher = xxhash.xxh3_128()
    buffer = np.empty(min(entry.nbytes, tuning.SUBCHUNK_BYTES), dtype=np.uint8)
    for offset in range(entry.begin, entry.end, tuning.SUBCHUNK_BYTES):
        view = memoryview(buffer)[: min(tuning.SUBCHUNK_BYTES, entry.end - offset)]
        open_file.source.read_into(offset, view, tensor=entry.name)
        hasher.update(view)
    return hasher.digest()


def _verify_layer(
    reader: SnapshotReader,
    open_file: OpenFile,
    entry: TensorEntry,
    stored: np.ndarray,
    trusted: bool,
) -> list[Problem]:
    name = entry.name
    page = reader.page_bytes

    bound = reader.page_digest_table
    digest = fmt.block_digests if bound is None else fmt.page_digests

    def digest_piece(piece: tuple[int, int, int]) -> np.ndarray:
        block, count, _ = piece
        buffer = np.empty(count * page, dtype=np.uint8)
        open_file.source.read_into(entry.begin + block * page, memoryview(buffer), tensor=name)
        return digest(buffer, page)

    pieces = reader.page_reads.pieces(np.arange(reader.num_blocks, dtype=np.int64))
    parts = reader.page_reads.run(digest_piece, pieces, open_file.source.concurrent, entry.nbytes)
    url = open_file.source.url
    if bound is not None:
        tensor = reader.layer_names.index(name)
        computed = np.concatenate(parts) if parts else bound[tensor, :0]
        return _digest_problems(url, name, computed, bound[tensor])
    computed = np.concatenate(parts) if parts else np.empty(0, dtype=np.uint64)
    return _block_problems(url, name, computed, stored, trusted)


def _block_problems(
    url: str, name: str, computed: np.ndarray, stored: np.ndarray, trusted: bool
) -> list[Problem]:
    """The blocks of layer tensor ``name`` whose digest ``computed`` differs from ``stored``."""
    bad = np.flatnonzero(computed != stored)
    # With a trusted row the data is wrong; otherwise the data or its stored checksum is.
    blamed = name if trusted else fmt.BLOCK_CHECKSUMS_TENSOR
    problems = [
        Problem(
            blamed,
            block,
            f"{url}: tensor {name}, block {block}: xxh3-64 {int(computed[block]):016x}, "
            f"stored {int(stored[block]):016x}",
        )
        for block in bad[: tuning.MAX_PROBLEMS_PER_TENSOR].tolist()
    ]
    if len(bad) > tuning.MAX_PROBLEMS_PER_TENSOR:
        more = len(bad) - tuning.MAX_PROBLEMS_PER_TENSOR
        problems.append(Problem(blamed, None, f"{url}: tensor {name}: {more} more corrupt blocks"))
    return problems


def _digest_problems(
    url: str, name: str, computed: np.ndarray, stored: np.ndarray
) -> list[Problem]:
    """The blocks of layer tensor ``name`` whose BLAKE3 digest ``computed`` differs from the
    signed one, ``stored`` (``(blocks, 32)`` each): pages changed after signing."""
    bad = np.flatnonzero((computed != stored).any(axis=1))
    problems = [
        Problem(
            name,
            block,
            f"{url}: tensor {name}, block {block}: BLAKE3 {computed[block].tobytes().hex()}, "
            f"signed {stored[block].tobytes().hex()}",
        )
        for block in bad[: tuning.MAX_PROBLEMS_PER_TENSOR].tolist()
    ]
    if len(bad) > tuning.MAX_PROBLEMS_PER_TENSOR:
        more = len(bad) - tuning.MAX_PROBLEMS_PER_TENSOR
        problems.append(Problem(name, None, f"{url}: tensor {name}: {more} more corrupt blocks"))
    return problems


def _verify_hash_chains(reader: SnapshotReader) -> list[Problem]:
    problems = []
    metadata = reader.metadata
    block_size = metadata.geometry.block_size
    referenced = np.zeros(reader.num_blocks, dtype=bool)
    for index, record in enumerate(metadata.sequences):
        referenced[record.block_ids] = True
        chain = fmt.prefix_hash_chain(record.token_ids, block_size)
        for position, (got, stored) in enumerate(zip(chain, record.prefix_hashes, strict=True)):
            if got != stored:
                block = int(record.block_ids[position])
                problems.append(
                    Problem(
                        f"sequences.{index}.token_ids",
                        None,
                        f"{reader.url}: sequence {record.id!r}: its tokens hash to {got} at "
                        f"block position {position}, {fmt.BLOCK_HASHES_TENSOR} holds "
                        f"{stored} for snapshot block {block}",
                    )
                )
                break
    unreferenced = np.flatnonzero(~referenced)
    if len(unreferenced):
        problems += _unreferenced_hashes(reader, unreferenced)
    return problems


def _unreferenced_hashes(reader: SnapshotReader, unreferenced: np.ndarray) -> list[Problem]:
    """Blocks no sequence references that carry a prefix hash anyway."""
    position, entry = reader.placement(fmt.BLOCK_HASHES_TENSOR)
    source = reader.open_files[position].source
    hashes = source.read(entry.begin, entry.nbytes, tensor=fmt.BLOCK_HASHES_TENSOR)
    nonzero = [int(b) for b in unreferenced.tolist() if any(hashes[16 * b : 16 * b + 16])]
    return [
        Problem(
            fmt.BLOCK_HASHES_TENSOR,
            block,
            f"{reader.url}: block {block} belongs to no sequence but has a prefix hash",
        )
        for block in nonzero[: tuning.MAX_PROBLEMS_PER_TENSOR]
    ]
