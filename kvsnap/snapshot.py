"""The facade users hold: :func:`capture`, and :class:`Snapshot` (open, verify, compare, restore).

It owns no mechanism: capture and restore run on :class:`~kvsnap.pipeline.Pipeline` (the
staging loop over slots that span tensors), reading and writing go through
:mod:`kvsnap.store`, and whether a snapshot fits a target is :mod:`kvsnap.format.fit`'s call.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvsnap import format as fmt
from kvsnap.errors import UnknownSequenceError
from kvsnap.format.signing import KeyRing
from kvsnap.layout import KVGeometry, torch_dtype
from kvsnap.store import SnapshotReader, TraceHook

if TYPE_CHECKING:
    import torch

    from kvsnap.analysis import Comparison, LayerDifference
    from kvsnap.errors import SignatureError
    from kvsnap.layout import CacheLayout
    from kvsnap.pipeline import (
        CaptureResult,
        RestoreResult,
        SequenceBlocks,
        StagingOptions,
        TransferOptions,
    )
    from kvsnap.transfer.pinned import PinnedPool

#: Names this module re-exports from modules that import torch, imported on first use: opening,
#: inspecting and verifying a snapshot need no torch (the CLI's ``inspect`` and ``verify``
#: start without it).
_REEXPORTS = {
    "Comparison": "kvsnap.analysis",
    "LayerDifference": "kvsnap.analysis",
    "CaptureResult": "kvsnap.pipeline",
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

ProgressCallback = Callable[[int, int], None]
"""``progress(done_bytes, total_bytes)``, called as data moves."""


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


def staging_options(staging: StagingOptions | PinnedPool | None) -> StagingOptions | None:
    """A caller's pool as :class:`StagingOptions` (anything else unchanged)."""
    from kvsnap.pipeline import StagingOptions
    from kvsnap.transfer.pinned import PinnedPool

    return StagingOptions(pool=staging) if isinstance(staging, PinnedPool) else staging


class Snapshot:
    """An open snapshot: its metadata, its sequences, and what can be done with them.

    Use :meth:`open`; a ``Snapshot`` is a context manager that closes the file.
    """

    def __init__(self, reader: SnapshotReader, path: str) -> None:
        self._reader = reader
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
        was written to) opens as a :class:`~kvsnap.parted.PartedSnapshot`: one snapshot of all
        heads, every part checked against the index.
        """
        from kvsnap.store.parts import open_parts, parted_index

        index = parted_index(path)
        if index is not None:
            from kvsnap.parted import PartedSnapshot  # imports torch: only for parted snapshots

            return PartedSnapshot(open_parts(index, verify=verify, keys=keys), str(path))
        return cls(SnapshotReader(path, verify=verify, keys=keys), str(path))

    # -- metadata --------------------------------------------------------------------------

    @property
    def metadata(self) -> fmt.SnapshotMetadata:
        return self._reader.metadata

    @property
    def format_version(self) -> int:
        """The format version the snapshot was written in."""
        return self._reader.format_version

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
        known = [record.id for record in self.sequences]
        raise UnknownSequenceError(sequence_id, known, file=self.path)

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
        total = self.kv_bytes
        callback = None if progress is None else (lambda done: progress(done, total))
        return self._reader.verify(progress=callback)

    def signature_problems(self, keys: KeyRing) -> list[SignatureError]:
        """Why ``keys`` do not vouch for each file of the snapshot: an
        :class:`~kvsnap.errors.UnsignedSnapshotError` or a
        :class:`~kvsnap.errors.BadSignatureError` per file that fails (empty: every file is
        signed by one of the keys over exactly its header and checksum trailer)."""
        return self._reader.signature_problems(keys)

    def signing_key_ids(self) -> list[str | None]:
        """Per file, the hex id of the key that signed it, as written (unchecked; ``None``
        for an unsigned file)."""
        return self._reader.signing_key_ids()

    @property
    def reader(self) -> SnapshotReader:
        """The underlying reader (block reads, checksums)."""
        return self._reader

    def check_compatible(
        self, geometry: KVGeometry, *, model_fingerprint: str | None = None, force: bool = False
    ) -> None:
        """Refuse (with :class:`IncompatibleSnapshotError`) a target this snapshot does not fit;
        see :func:`kvsnap.format.fit.check_fits`."""
        from kvsnap.format.fit import check_fits

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
        return self._reader.read_tensor(name)

    def sequence_kv(self, sequence_id: str, name: str) -> torch.Tensor:
        """One sequence's KV of tensor ``name``.

        Shaped ``(num_tokens, heads, head_dim)``, or ``(num_tokens, latent_dim)`` for MLA.
        """
        import torch

        record = self.sequence(sequence_id)
        page_bytes = self._reader.page_size_bytes(name)
        pages = np.empty(len(record.block_ids) * page_bytes, dtype=np.uint8)
        self._reader.read_pages(name, record.block_ids, pages)
        shape = self.geometry.canonical_page_shape
        tensor = torch.from_numpy(pages).view(torch_dtype(self.geometry.dtype))
        tokens = tensor.reshape(len(record.block_ids) * shape[0], *shape[1:])
        return tokens[: len(record.token_ids)]

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
        self._reader.close()

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
