"""Full verification of an open snapshot: every checksum, padding, prefix hash chains."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import xxhash

from kvsnap import format as fmt
from kvsnap.errors import (
    SnapshotCorruptError,
)
from kvsnap.format import Problem, TensorEntry
from kvsnap.store import tuning
from kvsnap.store.source import OpenFile


class ReaderVerification:
    """``verify()`` of :class:`~kvsnap.store.reader.SnapshotReader` (a mixin)."""

    def verify(self, progress: Callable[[int], None] | None = None) -> list[Problem]:
        """Check every checksum and the structure; ``[]`` means the snapshot is intact.

        Reads the whole snapshot once, in bounded pieces. Reports a header or index that does
        not match its checksum, each corrupt tensor, the first corrupt blocks of each layer
        tensor by index, non-zero padding, and sequences whose token ids do not hash to the
        stored prefix hashes. ``progress`` receives the KV (layer) bytes checked so far.
        """
        problems: list[Problem] = []
        for shard, open_file in enumerate(self._files):
            try:
                self._load_trailer(open_file)
                if self._index_digests is not None:
                    self._check_index_digest(shard)
            except SnapshotCorruptError as error:
                problems.append(Problem(error.tensor, error.block, str(error)))
                open_file.trailer = None
        done = 0
        for open_file in self._files:
            for entry in open_file.layout.entries:
                if entry.name in (fmt.CHECKSUMS_TENSOR, fmt.SIGNATURE_TENSOR):
                    continue  # the trailer was checked above; a signature needs the keys
                try:
                    if entry.name.startswith(fmt.PADDING_PREFIX):
                        problems += self._verify_padding(open_file, entry)
                    elif fmt.is_layer_tensor(entry.name):
                        row, trusted = self._stored_row(entry.name, problems)
                        problems += self._verify_layer(open_file, entry, row, trusted)
                        done += entry.nbytes
                        if progress is not None:
                            progress(done)
                    elif open_file.trailer is not None:
                        problems += self._verify_whole(open_file, entry)
                except SnapshotCorruptError as error:
                    problems.append(Problem(error.tensor or entry.name, error.block, str(error)))
        problems += self._verify_hash_chains()
        return problems

    def _stored_row(self, name: str, problems: list[Problem]) -> tuple[np.ndarray, bool]:
        """Layer tensor ``name``'s stored block checksums, and whether they match their own
        checksum (a trusted row). An untrusted row still names the blocks that disagree."""
        tensor = self._tensor_index[name]
        open_file, entry = self._locate_tensor(fmt.BLOCK_CHECKSUMS_TENSOR)
        row_bytes = self._num_blocks * 8
        raw = open_file.source.read(
            entry.begin + tensor * row_bytes, row_bytes, tensor=fmt.BLOCK_CHECKSUMS_TENSOR
        )
        row = np.frombuffer(raw, dtype="<u8")
        layer_file, _ = self._locate_tensor(name)
        expected = self._expected_digest(layer_file, name)
        trusted = expected is not None and fmt.layer_tensor_digest(row) == expected
        if expected is not None and not trusted:
            problems.append(
                Problem(
                    fmt.BLOCK_CHECKSUMS_TENSOR,
                    None,
                    f"{open_file.source.url}: the stored block checksums of {name} do not match "
                    "their xxh3-128 checksum",
                )
            )
        return row, trusted

    def _verify_padding(self, open_file: OpenFile, entry: TensorEntry) -> list[Problem]:
        raw = open_file.source.read(entry.begin, entry.nbytes, tensor=entry.name)
        if any(raw):
            url = open_file.source.url
            return [Problem(entry.name, None, f"{url}: padding {entry.name} is not all zero")]
        return []

    def _verify_whole(self, open_file: OpenFile, entry: TensorEntry) -> list[Problem]:
        expected = self._expected_digest(open_file, entry.name)
        hasher = xxhash.xxh3_128()
        buffer = np.empty(min(entry.nbytes, tuning.SUBCHUNK_BYTES), dtype=np.uint8)
        for offset in range(entry.begin, entry.end, tuning.SUBCHUNK_BYTES):
            view = memoryview(buffer)[: min(tuning.SUBCHUNK_BYTES, entry.end - offset)]
            open_file.source.read_into(offset, view, tensor=entry.name)
            hasher.update(view)
        if hasher.digest() != expected:
            url = open_file.source.url
            return [
                Problem(
                    entry.name, None, f"{url}: {entry.name} does not match its xxh3-128 checksum"
                )
            ]
        return []

    def _verify_layer(
        self, open_file: OpenFile, entry: TensorEntry, stored: np.ndarray, trusted: bool
    ) -> list[Problem]:
        name = entry.name
        url = open_file.source.url
        page = self._page_bytes

        def digest_piece(piece: tuple[int, int, int]) -> np.ndarray:
            block, count, _ = piece
            buffer = np.empty(count * page, dtype=np.uint8)
            open_file.source.read_into(entry.begin + block * page, memoryview(buffer), tensor=name)
            return fmt.block_digests(buffer, page)

        pieces = self._pieces(np.arange(self._num_blocks, dtype=np.int64))
        parts = self._run(digest_piece, pieces, open_file.source.concurrent, entry.nbytes)
        computed = np.concatenate(parts) if parts else np.empty(0, dtype=np.uint64)
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
            problems.append(
                Problem(blamed, None, f"{url}: tensor {name}: {more} more corrupt blocks")
            )
        return problems

    def _verify_hash_chains(self) -> list[Problem]:
        problems = []
        block_size = self.metadata.geometry.block_size
        referenced = np.zeros(self._num_blocks, dtype=bool)
        for index, record in enumerate(self.metadata.sequences):
            referenced[record.block_ids] = True
            chain = fmt.prefix_hash_chain(record.token_ids, block_size)
            for position, (got, stored) in enumerate(zip(chain, record.prefix_hashes, strict=True)):
                if got != stored:
                    block = int(record.block_ids[position])
                    problems.append(
                        Problem(
                            f"sequences.{index}.token_ids",
                            None,
                            f"{self.url}: sequence {record.id!r}: its tokens hash to {got} at "
                            f"block position {position}, {fmt.BLOCK_HASHES_TENSOR} holds "
                            f"{stored} for snapshot block {block}",
                        )
                    )
                    break
        unreferenced = np.flatnonzero(~referenced)
        if len(unreferenced):
            open_file, entry = self._locate_tensor(fmt.BLOCK_HASHES_TENSOR)
            hashes = open_file.source.read(
                entry.begin, entry.nbytes, tensor=fmt.BLOCK_HASHES_TENSOR
            )
            nonzero = [int(b) for b in unreferenced.tolist() if any(hashes[16 * b : 16 * b + 16])]
            for block in nonzero[: tuning.MAX_PROBLEMS_PER_TENSOR]:
                problems.append(
                    Problem(
                        fmt.BLOCK_HASHES_TENSOR,
                        block,
                        f"{self.url}: block {block} belongs to no sequence but has a prefix hash",
                    )
                )
        return problems
