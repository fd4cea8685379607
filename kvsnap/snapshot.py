"""The facade users hold: :func:`capture`, and :class:`Snapshot` (open, verify, compare, restore).

It owns no mechanism: capture and restore run on :class:`~kvsnap.pipeline.Pipeline` (the
staging loop over slots that span tensors), reading and writing go through
:mod:`kvsnap.store`, and whether a snapshot fits a target is :mod:`kvsnap.format.fit`'s call.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvsnap import format as fmt
from kvsnap.format.fit import check_fits
from kvsnap.format.signing import KeyRing
from kvsnap.layout import KVGeometry, torch_dtype
from kvsnap.store import SnapshotReader, TraceHook
from kvsnap.store.head_parts import HeadPart, OpenedSnapshot, open_snapshot, whole_snapshot

if TYPE_CHECKING:
    import torch

    from kvsnap.analysis import Comparison, LayerDifference
    from kvsnap.errors import SignatureError
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


def capture(
    layout: CacheLayout | Sequence[CacheLayout],
    sequences: Sequence[SequenceBlocks],
    path: str | Path,
    *,
    source: fmt.SourceInfo | None = None,
    transfer: TransferOptions | None = None,
    staging: StagingOptions | PinnedPool | None = None,
    reproducible: bool = False,
    max_shard_bytes: int | None = None,
    direct_io: bool | None = None,
    progress: ProgressCallback | None = None,
    trace: TraceHook | None = None,
    per_rank_parts: bool = False,
    keys: KeyRing | None = None,
) -> CaptureResult:
    """Write the KV of ``sequences`` from the cache ``layout`` describes to a snapshot at ``path``.

    ``layout`` may be a list with one layout per TP rank held by this process; each rank then
    contributes the canonical fragments it is elected for, and the snapshot is the complete
    TP-free one. Blocks whose prefix hash chains coincide are stored once. ``source`` records
    where the KV came from (engine, model id, model fingerprint; default: unknown). With
    ``reproducible`` the metadata holds nothing time- or host-dependent. The snapshot is
    published atomically: on any error the previous file at ``path`` is untouched.

    ``transfer`` picks how pages move (:class:`~kvsnap.pipeline.TransferOptions`: the fused
    copy by default, or a named backend, and an SM budget); ``staging`` the host memory
    (:class:`~kvsnap.pipeline.StagingOptions`, or a :class:`~kvsnap.transfer.pinned.PinnedPool` the
    caller keeps; default: kvsnap's process-wide slots, pinned once). ``trace(kind, started,
    finished, nbytes)`` receives a span for each step (setup, slot waits, transfers, checksums,
    writes, commit phases): ``benchmarks/e2e.py --timeline`` shows what it records. Repeated
    calls are warm; a caller capturing from the same caches many times may keep a
    :class:`~kvsnap.pipeline.Pipeline` instead.

    With ``per_rank_parts`` (``layout``: one layout per TP rank) the snapshot is parted
    (docs/format.md, "Parted snapshots"): one part file per distinct head range, each written
    from the first rank holding it, then the index ``path + ".index.json"``; the result's
    ``path`` is the index (``max_shard_bytes`` and ``progress`` do not apply).

    With ``keys`` (:func:`kvsnap.store.keys.load_key_ring`) every file is signed by the first
    key: an HMAC-SHA256 over its header and checksum trailer (docs/format.md, "Signed
    snapshots"), which :meth:`Snapshot.open` checks when given the keys.
    """
    from kvsnap.layout import CacheLayout
    from kvsnap.pipeline import Pipeline
    from kvsnap.pipeline.options import staging_options

    common = {"source": source, "reproducible": reproducible, "direct_io": direct_io}
    common["keys"] = keys
    if per_rank_parts:
        from kvsnap.parted import capture_parts

        if max_shard_bytes is not None or progress is not None:
            raise ValueError(
                "per_rank_parts writes one file per head range: no shards, no progress"
            )
        layouts = [layout] if isinstance(layout, CacheLayout) else layout
        return capture_parts(
            layouts, sequences, path, transfer=transfer, staging=staging, trace=trace, **common
        )
    return Pipeline(layout, transfer=transfer).capture(
        sequences,
        path,
        staging=staging_options(staging),
        max_shard_bytes=max_shard_bytes,
        progress=progress,
        trace=trace,
        **common,
    )


class Snapshot:
    """An open snapshot: its metadata, its sequences, and what can be done with them.

    Use :meth:`open`; a ``Snapshot`` is a context manager that closes the file.
    """

    def __init__(self, reader: SnapshotReader | OpenedSnapshot, path: str) -> None:
        # A reader of one file (or shards) is a snapshot of one part holding every head.
        self._opened = (
            reader if isinstance(reader, OpenedSnapshot) else whole_snapshot(reader, path)
        )
        self.path = path

    @classmethod
    def open(
        cls, path: str | Path, *, verify: bool = True, keys: KeyRing | None = None
    ) -> Snapshot:
        """Open and strictly validate the snapshot header at ``path`` (a local path or fsspec URL).

        With ``verify`` (the default) every block read later is checked against its checksum.
        With ``keys`` (:func:`kvsnap.store.keys.load_key_ring`) every file must be signed by one
        of them: :class:`~kvsnap.errors.UnsignedSnapshotError` or
        :class:`~kvsnap.errors.BadSignatureError` otherwise.
        Raises :class:`~kvsnap.errors.KVSnapError` subclasses for anything that is not a
        readable kvsnap snapshot. A parted snapshot (its index, or the ``NAME.safetensors`` it
        was written to) opens as one snapshot of all heads (:attr:`parts`: one per part file),
        every part checked against the index.
        """
        return cls(open_snapshot(path, verify=verify, keys=keys), str(path))

    # -- metadata --------------------------------------------------------------------------

    @property
    def metadata(self) -> fmt.SnapshotMetadata:
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
        return self.metadata.geometry

    @property
    def sequences(self) -> list[fmt.SequenceRecord]:
        return self.metadata.sequences

    def sequence(self, sequence_id: str) -> fmt.SequenceRecord:
        """The sequence named ``sequence_id``; ``KeyError`` naming the known ids otherwise."""
        for record in self.sequences:
            if record.id == sequence_id:
                return record
        known = ", ".join(record.id for record in self.sequences)
        raise KeyError(f"no sequence {sequence_id!r} in {self.path} (it has: {known})")

    @property
    def num_blocks(self) -> int:
        return self.metadata.num_blocks

    @property
    def kv_bytes(self) -> int:
        """Bytes of KV data (all layer tensors)."""
        return self.num_blocks * self.geometry.bytes_per_block

    def shared_blocks(self) -> dict[str, int]:
        """Per sequence, how many of its blocks another sequence also uses."""
        users = np.zeros(self.num_blocks, dtype=np.int64)
        for record in self.sequences:
            np.add.at(users, np.unique(record.block_ids), 1)
        return {record.id: int((users[record.block_ids] > 1).sum()) for record in self.sequences}

    # -- checks ----------------------------------------------------------------------------

    def verify(self, progress: ProgressCallback | None = None) -> list[fmt.Problem]:
        """Check the structure and every checksum; an empty list means the snapshot is intact."""
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

    def signature_problems(self, keys: KeyRing) -> list[SignatureError]:
        """Why ``keys`` do not vouch for each file of the snapshot: an
        :class:`~kvsnap.errors.UnsignedSnapshotError` or a
        :class:`~kvsnap.errors.BadSignatureError` per file that fails (empty: every file is
        signed by one of the keys over exactly its header and checksum trailer)."""
        return [problem for part in self.parts for problem in part.reader.signature_problems(keys)]

    def signing_key_ids(self) -> list[str | None]:
        """Per file, the hex id of the key that signed it, as written (unchecked; ``None``
        for an unsigned file)."""
        return [key_id for part in self.parts for key_id in part.reader.signing_key_ids()]

    @property
    def reader(self) -> SnapshotReader:
        """The underlying reader (block reads, checksums)."""
        # A parted snapshot has one reader per part (``parts``); this is the first part's.
        return self.parts[0].reader

    def check_compatible(
        self, geometry: KVGeometry, *, model_fingerprint: str | None = None, force: bool = False
    ) -> None:
        """Refuse (with :class:`IncompatibleSnapshotError`) a target this snapshot does not fit;
        see :func:`kvsnap.format.fit.check_fits`."""
        check_fits(
            self.metadata,
            geometry,
            path=self.path,
            model_fingerprint=model_fingerprint,
            force=force,
        )

    # -- data ------------------------------------------------------------------------------

    def read_tensor(self, name: str) -> torch.Tensor:
        """A whole canonical tensor, ``(num_blocks, *canonical_page_shape)``, checksums verified."""
        if len(self.parts) == 1:
            return self.parts[0].reader.read_tensor(name)
        import torch

        # Parts hold head ranges: the head axis of the canonical page is the third.
        return torch.cat([part.reader.read_tensor(name) for part in self.parts], dim=2)

    def sequence_kv(self, sequence_id: str, name: str) -> torch.Tensor:
        """One sequence's KV of tensor ``name``.

        Shaped ``(num_tokens, heads, head_dim)``, or ``(num_tokens, latent_dim)`` for MLA.
        """
        import torch

        record = self.sequence(sequence_id)
        if len(self.parts) == 1:
            return _sequence_kv(self.parts[0].reader, record, name)
        return torch.cat([_sequence_kv(part.reader, record, name) for part in self.parts], dim=1)

    def compare(self, other: Snapshot, *, atol: float = 0.0, rtol: float = 0.0) -> Comparison:
        """Compare this snapshot's KV with ``other``: see :func:`kvsnap.analysis.compare`."""
        from kvsnap import analysis

        return analysis.compare(self, other, atol=atol, rtol=rtol)

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

        ``block_ids`` maps a sequence id to the target's device block ids, one per block of that
        sequence. ``layout`` may list one layout per TP rank held by this process; every rank
        receives its own heads. Everything is checked before the first byte is written: the
        geometry (see :meth:`check_compatible`), the sequence ids and the block counts and
        ranges. Only the blocks of the named sequences are read; a page failing its checksum is
        never written (:class:`~kvsnap.errors.RestoreIncompleteError` lists the target blocks
        not restored). ``transfer``, ``staging`` and ``trace`` are as for :func:`capture`.
        """
        from kvsnap.pipeline import Pipeline
        from kvsnap.pipeline.options import staging_options

        return Pipeline(layout, transfer=transfer).restore(
            self,
            block_ids,
            staging=staging_options(staging),
            model_fingerprint=model_fingerprint,
            force=force,
            progress=progress,
            trace=trace,
        )

    # -- statistics ------------------------------------------------------------------------

    def valid_tokens_per_block(self) -> np.ndarray:
        """See :func:`kvsnap.analysis.valid_tokens_per_block`."""
        from kvsnap import analysis

        return analysis.valid_tokens_per_block(self)

    def tensor_stats(self, name: str) -> dict[str, float | int]:
        """See :func:`kvsnap.analysis.tensor_stats`."""
        from kvsnap import analysis

        return analysis.tensor_stats(self, name)

    def token_norms(self, sequence_id: str) -> dict[str, np.ndarray]:
        """See :func:`kvsnap.analysis.token_norms`."""
        from kvsnap import analysis

        return analysis.token_norms(self, sequence_id)

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        self._opened.close()

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _sequence_kv(reader: SnapshotReader, record: fmt.SequenceRecord, name: str) -> torch.Tensor:
    """The KV of tensor ``name`` of the sequence ``record`` from ``reader``'s snapshot (a part
    of one: its heads), ``(num_tokens, heads, head_dim)`` or ``(num_tokens, latent_dim)``."""
    import torch

    geometry = reader.metadata.geometry
    page_bytes = reader.page_size_bytes(name)
    pages = np.empty(len(record.block_ids) * page_bytes, dtype=np.uint8)
    reader.read_pages(name, record.block_ids, pages)
    shape = geometry.canonical_page_shape
    tensor = torch.from_numpy(pages).view(torch_dtype(geometry.dtype))
    tokens = tensor.reshape(len(record.block_ids) * shape[0], *shape[1:])
    return tokens[: len(record.token_ids)]
