"""The facade users hold: ``capture``, and ``Snapshot`` (open, verify, compare, restore).

``capture`` lives in :mod:`kvsnap.snapshot_capture`, the methods that read KV back as tensors in
:mod:`kvsnap.snapshot_tensors` (``SnapshotTensors``, which ``Snapshot`` inherits). It owns no
mechanism: capture and restore run on ``kvsnap.pipeline.Pipeline``, reading and writing go
through ``kvsnap.store``, and whether a snapshot fits a target is ``kvsnap.format.fit``'s call.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvsnap import format as fmt
from kvsnap.encoded.file import EncodedInfo
from kvsnap.encoded.opening import EncodedSnapshot, open_encoded, open_known_encoded
from kvsnap.errors import UnknownSequenceError, UnsupportedVersionError
from kvsnap.format.fit import check_fits
from kvsnap.format.signing import KeyRing
from kvsnap.layout import KVGeometry
from kvsnap.snapshot_capture import capture
from kvsnap.snapshot_signatures import SnapshotSignatures
from kvsnap.snapshot_tensors import SnapshotTensors
from kvsnap.store import SnapshotReader, TraceHook
from kvsnap.store.read.head_parts import HeadPart, OpenedSnapshot, open_snapshot, whole_snapshot

if TYPE_CHECKING:
    from kvsnap.analysis import Comparison, LayerDifference
    from kvsnap.layout import CacheLayout
    from kvsnap.pipeline import (
        CaptureResult,
        ProgressCallback,
        RestoreResult,
        SequenceBlocks,
        StagingOptions,
        TransferOptions,
    )
    from kvsnap.transfer.pinned import PinnedPool

#: Names this module re-exports from modules that import torch, imported on first use: opening,
#: inspecting and verifying a snapshot need no torch (the CLI's ``inspect`` and ``verify``
#: start without it). For the same reason the methods that capture, restore or analyse import
#: :mod:`kvsnap.pipeline`, :mod:`kvsnap.parted` and :mod:`kvsnap.analysis` when called.
_REEXPORTS = {
    "Comparison": "kvsnap.analysis",
    "LayerDifference": "kvsnap.analysis",
    "CaptureResult": "kvsnap.pipeline",
    "ProgressCallback": "kvsnap.pipeline",
    "RestoreResult": "kvsnap.pipeline",
    "SequenceBlocks": "kvsnap.pipeline",
}


def __getattr__(name: str) -> Any:
    module = _REEXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "CaptureResult",
    "Comparison",
    "LayerDifference",
    "RestoreResult",
    "SequenceBlocks",
    "Snapshot",
    "capture",
]


class Snapshot(SnapshotSignatures, SnapshotTensors):
    """An open snapshot: its metadata, its sequences, and what can be done with them.

    Made by ``Snapshot.open``, never directly; a ``Snapshot`` is a context manager that
    closes its files. ``metadata``, ``geometry``, ``sequences``, ``num_blocks`` and
    ``kv_bytes`` describe it without reading any KV.

    Example:
        >>> import kvsnap
        >>> with kvsnap.Snapshot.open("prefix.safetensors") as snap:
        ...     print(snap.geometry.describe())
        ...     print([(record.id, len(record.token_ids)) for record in snap.sequences])
        ...     print(snap.num_blocks, snap.kv_bytes)
        2 layers, 2 KV heads x head dim 64, 16 tokens/block, float32
        [('seq-0', 40)]
        3 98304
    """

    def __init__(
        self, reader: SnapshotReader | OpenedSnapshot | EncodedSnapshot, path: str
    ) -> None:
        # A reader of one file (or shards) is a snapshot of one part holding every head.
        self._opened = (
            reader
            if isinstance(reader, OpenedSnapshot | EncodedSnapshot)
            else whole_snapshot(reader, path)
        )
        self.path = path

    @property
    def encoded(self) -> EncodedInfo | None:
        """The encoded file this snapshot stands for (``None``: an ordinary file)."""
        return self._opened.encoded if isinstance(self._opened, EncodedSnapshot) else None

    @classmethod
    def open(
        cls, path: str | Path, *, verify: bool = True, keys: KeyRing | None = None
    ) -> Snapshot:
        """Open the snapshot at ``path`` and strictly validate its header.

        A parted snapshot (its index, or the ``NAME.safetensors`` it was written to) opens as
        one snapshot of all heads (``parts``: one per part file), every part checked against
        the index. Only the header is read here; KV is read on demand.

        Args:
            path: A local path or an fsspec URL.
            verify: Check every block read later against its checksum. Default ``True``.
            keys: Require every file to be signed by one of these keys
                (``kvsnap.store.files.keys.load_key_ring``), checked here; a snapshot signed with
                BLAKE3 page digests then has every page read, verified or restored checked
                against its signed digest (``page_binding``). Default ``None``: signatures
                are not checked.

        Returns:
            The open ``Snapshot``; close it, or use it as a context manager.

        Raises:
            SnapshotIOError: The file is missing or cannot be read.
            NotASnapshotError: The file is no kvsnap snapshot (empty, garbage, foreign).
            UnsupportedVersionError: The snapshot is of a newer format than this kvsnap reads.
            SnapshotCorruptError: Its header or structure is damaged.
            UnsignedSnapshotError: ``keys`` were given and a file carries no signature.
            BadSignatureError: ``keys`` were given and a file's signature is not one of theirs.

        Example:
            >>> import kvsnap
            >>> with kvsnap.Snapshot.open("prefix.safetensors") as snap:
            ...     snap.format_version, snap.num_blocks
            (1, 3)
            >>> kvsnap.Snapshot.open("no-such.safetensors")
            Traceback (most recent call last):
            ...
            kvsnap.errors.SnapshotIOError: no-such.safetensors: no such file...
        """
        known = open_known_encoded(path, keys, verify=verify)  # skips the ordinary open's try
        if known is not None:
            return cls(known, str(path))
        try:
            return cls(open_snapshot(path, verify=verify, keys=keys), str(path))
        except UnsupportedVersionError as unsupported:
            refused = unsupported  # an encoded file's own errors are not raised inside this one
        # An encoded snapshot (format version 3) opens as the ordinary one it stands for.
        encoded = open_encoded(path, keys, verify=verify)
        if encoded is None:
            raise refused
        return cls(encoded, str(path))

    # -- metadata --------------------------------------------------------------------------

    @property
    def metadata(self) -> fmt.SnapshotMetadata:
        """Everything the header records: geometry, source, sequences, blocks, version."""
        return self._opened.metadata

    @property
    def format_version(self) -> int:
        """The format version the snapshot was written in."""
        return self._opened.format_version

    @property
    def parts(self) -> tuple[HeadPart, ...]:
        """The snapshot's head-range parts, in head order: each a reader and the KV heads
        ``[first_head, first_head + num_heads)`` it holds. A single-file or sharded snapshot
        is one part holding every head; a parted snapshot one part per file (its reader's
        metadata is the part's: only its heads). Block reads and checksums of a part go
        through its ``reader``."""
        return self._opened.parts

    @property
    def index(self) -> fmt.PartsIndex | None:
        """A parted snapshot's index (its parts' files, heads and trailer digests); ``None``
        for a single-file or sharded snapshot."""
        return self._opened.index

    def part_files(self) -> list[str]:
        """The part files, in head order (a single-file or sharded snapshot: the one file or
        index it was opened through)."""
        return [part.path for part in self.parts]

    @property
    def geometry(self) -> KVGeometry:
        """The KV geometry: layers, block size, dtype, KV heads and head size (or MLA latent)."""
        return self.metadata.geometry

    @property
    def sequences(self) -> list[fmt.SequenceRecord]:
        """The sequences, in snapshot order: ids, token ids, snapshot blocks, prefix hashes."""
        return self.metadata.sequences

    def sequence(self, sequence_id: str) -> fmt.SequenceRecord:
        """The record of the sequence named ``sequence_id``.

        Args:
            sequence_id: The id the sequence was captured under.

        Returns:
            Its ``SequenceRecord``: the id, token ids, snapshot block ids and prefix hashes.

        Raises:
            UnknownSequenceError: The snapshot holds no such sequence (a ``KeyError``; the
                message names the ids it holds).

        Example:
            >>> import kvsnap
            >>> snap = kvsnap.Snapshot.open("prefix.safetensors")
            >>> snap.sequence("seq-0").block_ids.tolist()
            [0, 1, 2]
            >>> try:
            ...     snap.sequence("seq-9")
            ... except KeyError as error:  # an UnknownSequenceError
            ...     print(error)
            prefix.safetensors: no sequence 'seq-9' (it has: 'seq-0')
            >>> snap.close()
        """
        for record in self.sequences:
            if record.id == sequence_id:
                return record
        known = [record.id for record in self.sequences]
        raise UnknownSequenceError(sequence_id, known, file=self.path)

    @property
    def num_blocks(self) -> int:
        """The number of blocks stored (each block once, however many sequences share it)."""
        return self.metadata.num_blocks

    @property
    def kv_bytes(self) -> int:
        """Bytes of KV data (all layer tensors)."""
        return self.num_blocks * self.geometry.bytes_per_block

    def shared_blocks(self) -> dict[str, int]:
        """Per sequence, how many of its blocks another sequence also uses.

        Returns:
            A dict from sequence id to the number of its blocks shared with another sequence
            (a common prefix is stored once).

        Example:
            >>> import kvsnap
            >>> with kvsnap.Snapshot.open("prefix.safetensors") as snap:
            ...     snap.shared_blocks()
            {'seq-0': 0}
        """
        users = np.zeros(self.num_blocks, dtype=np.int64)
        for record in self.sequences:
            np.add.at(users, np.unique(record.block_ids), 1)
        return {record.id: int((users[record.block_ids] > 1).sum()) for record in self.sequences}

    # -- checks ----------------------------------------------------------------------------

    def verify(self, progress: ProgressCallback | None = None) -> list[fmt.Problem]:
        """Check the structure and every checksum, reading the whole snapshot once.

        Beyond checksums it checks that padding is zero, that every sequence's token ids hash
        to its stored prefix hashes, and that unused blocks carry no hash. A snapshot opened
        with ``keys`` and signed with BLAKE3 page digests has every page checked against its
        signed digest instead of its xxh3-64 (a page changed after signing is named).

        Args:
            progress: ``progress(done_bytes, total_bytes)``, called as data is read. Default
                ``None``.

        Returns:
            The problems found, each a ``Problem(tensor, block, message)``; an empty list
            means the snapshot is intact.

        Raises:
            SnapshotIOError: Reading failed (damage is reported, not raised).

        Example:
            >>> import kvsnap
            >>> with kvsnap.Snapshot.open("prefix.safetensors") as snap:
            ...     snap.verify()
            []
        """
        # Every part fully, each problem naming its file; a parted index's own checks (heads
        # tiling, trailer digests, parts agreeing on sequences and geometry) ran at open.
        total = self.kv_bytes
        problems: list[fmt.Problem] = []
        done = 0
        for part in self.parts:
            callback = (
                None if progress is None else (lambda n, base=done: progress(base + n, total))
            )
            problems += part.reader.verify(progress=callback)
            done += self.num_blocks * part.reader.metadata.geometry.bytes_per_block
        return problems

    @property
    def reader(self) -> SnapshotReader:
        """The first part's reader (block reads, checksums): internal, for kvsnap's engines; a
        parted snapshot has one reader per part, and ``parts`` holds them all."""
        return self.parts[0].reader

    def check_compatible(
        self, geometry: KVGeometry, *, model_fingerprint: str | None = None, force: bool = False
    ) -> None:
        """Refuse a target cache this snapshot does not fit, before anything is written.

        The layers, KV heads, head size (or MLA latent width), dtype, block size and attention
        types must match (``kvsnap.format.fit.check_fits``).

        Args:
            geometry: The target cache's geometry (``layout.geometry``).
            model_fingerprint: The target model's fingerprint; a snapshot recording another
                one is refused. Default ``None``: not checked.
            force: Skip the fingerprint check (the geometry is still checked). Default
                ``False``.

        Raises:
            IncompatibleSnapshotError: The snapshot does not fit; the message names each
                differing field, ``snapshot`` and ``target`` describe both sides.

        Example:
            >>> import torch, kvsnap
            >>> four_heads = kvsnap.vllm_split_layout([torch.zeros(8, 2, 16, 4, 64)] * 2)
            >>> with kvsnap.Snapshot.open("prefix.safetensors") as snap:
            ...     snap.check_compatible(snap.geometry)  # fits: nothing happens
            ...     snap.check_compatible(four_heads.geometry)
            Traceback (most recent call last):
            ...
            kvsnap.errors.IncompatibleSnapshotError: ... (num_kv_heads: snapshot 2, target 4)...
        """
        check_fits(
            self.metadata,
            geometry,
            path=self.path,
            model_fingerprint=model_fingerprint,
            force=force,
        )

    # -- data ------------------------------------------------------------------------------

    def restore(
        self,
        layout: CacheLayout | Sequence[CacheLayout],
        block_ids: Mapping[str, np.ndarray | Sequence[int]],
        *,
        transfer: TransferOptions | None = None,
        staging: StagingOptions | PinnedPool | None = None,
        model_fingerprint: str | None = None,
        force: bool = False,
        progress: ProgressCallback | None = None,
        trace: TraceHook | None = None,
    ) -> RestoreResult:
        """Write the KV of the sequences named in ``block_ids`` into the target cache.

        Everything is checked before the first byte is written: the geometry (see
        ``check_compatible``), the sequence ids, and the block counts and ranges. Only the
        blocks of the named sequences are read; a page failing its checksum is never written,
        every other page is.

        Args:
            layout: The target cache's layout, or one layout per TP rank held by this
                process (every rank receives its own heads).
            block_ids: Per sequence id, the target's device block ids, one per block of that
                sequence.
            transfer: How pages move, as for ``capture``. Default ``None``: the fused copy.
            staging: Host staging memory, as for ``capture``. Default ``None``: kvsnap's
                process-wide slots.
            model_fingerprint: The target model's fingerprint, checked against the one
                recorded. Default ``None``: not checked.
            force: Skip the fingerprint check. Default ``False``.
            progress: ``progress(done_bytes, total_bytes)``, called as data moves. Default
                ``None``.
            trace: Per-step spans, as for ``capture``. Default ``None``.

        Returns:
            A ``RestoreResult``: the numbers of sequences, tokens, blocks and bytes, the
            seconds taken and the copy backend used.

        Raises:
            UnknownSequenceError: A sequence id the snapshot does not hold.
            IncompatibleSnapshotError: The snapshot does not fit the target, or the block
                ids do not fit the sequences or the cache.
            ValueError: Block ids that are not integers.
            RestoreIncompleteError: Some pages failed their checksums and were not written;
                ``failed_block_ids`` lists the target blocks to recompute.
            TransferFailedError: A copy into the cache failed.

        Example:
            >>> import torch, kvsnap
            >>> target = [torch.zeros(8, 2, 16, 2, 64) for _ in range(2)]
            >>> with kvsnap.Snapshot.open("prefix.safetensors") as snap:
            ...     result = snap.restore(kvsnap.vllm_split_layout(target), {"seq-0": [0, 2, 5]})
            >>> result.num_tokens, result.num_blocks
            (40, 3)
        """
        from kvsnap.pipeline import Pipeline
        from kvsnap.pipeline.options import staging_options

        if self.encoded is not None:
            from kvsnap.encoded.device_restore import restore_fp8

            restored = restore_fp8(self, layout, block_ids, model_fingerprint, force)
            if restored is not None:
                return restored
        return Pipeline(layout, transfer=transfer).restore(
            self,
            block_ids,
            staging=staging_options(staging),
            model_fingerprint=model_fingerprint,
            force=force,
            progress=progress,
            trace=trace,
        )

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Close the snapshot's files (a ``with`` block does this on leaving).

        Closing twice is harmless.

        Example:
            >>> import kvsnap
            >>> snap = kvsnap.Snapshot.open("prefix.safetensors")
            >>> snap.close()
        """
        self._opened.close()

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
