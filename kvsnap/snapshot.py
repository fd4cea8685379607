"""The facade users hold: :func:`capture`, and :class:`Snapshot` (open, verify, compare, restore).

It owns no mechanism: capture and restore run on :class:`~kvsnap.pipeline.Pipeline` (the
staging loop over slots that span tensors), reading and writing go through
:mod:`kvsnap.store`, and whether a snapshot fits a target is :mod:`kvsnap.compat`'s call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvsnap import format as fmt
from kvsnap.compat import check_fits
from kvsnap.errors import IncompatibleSnapshotError
from kvsnap.layout import CacheLayout, KVGeometry, torch_dtype
from kvsnap.pinned import PinnedPool
from kvsnap.pipeline import (
    CaptureResult,
    Pipeline,
    RestoreResult,
    SequenceBlocks,
    StagingOptions,
    TransferOptions,
)
from kvsnap.store import SnapshotReader, TraceHook

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


@dataclass(frozen=True)
class LayerDifference:
    """One tensor's comparison between two snapshots, over the tokens both hold."""

    tensor: str
    max_abs_diff: float
    num_mismatches: int
    first_mismatch: dict[str, object] | None  # {"sequence", "token", "head"} of the first one


@dataclass(frozen=True)
class Comparison:
    """The result of :meth:`Snapshot.compare`; ``ok`` when every compared element is close."""

    ok: bool
    layers: list[LayerDifference]
    problems: list[fmt.Problem] = field(default_factory=list)

    def first_mismatch(self) -> LayerDifference | None:
        return next((layer for layer in self.layers if layer.num_mismatches), None)

    def report(self) -> str:
        """A readable summary: per layer the largest difference, then the first mismatch."""
        lines = [problem.message for problem in self.problems]
        for layer in self.layers:
            flag = "MISMATCH" if layer.num_mismatches else "ok"
            lines.append(
                f"{layer.tensor:<24} max |diff| {layer.max_abs_diff:.6g}  "
                f"mismatches {layer.num_mismatches}  {flag}"
            )
        first = self.first_mismatch()
        if first is not None and first.first_mismatch is not None:
            where = first.first_mismatch
            lines.append(
                f"first mismatch: {first.tensor}, sequence {where['sequence']}, "
                f"token {where['token']}, head {where['head']}"
            )
        return "\n".join(lines)


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
    (:class:`~kvsnap.pipeline.StagingOptions`, or a :class:`~kvsnap.pinned.PinnedPool` the
    caller keeps; default: kvsnap's process-wide slots, pinned once). ``trace(kind, started,
    finished, nbytes)`` receives a span for each step (setup, slot waits, transfers, checksums,
    writes, commit phases): ``benchmarks/e2e.py --timeline`` shows what it records. Repeated
    calls are warm; a caller capturing from the same caches many times may keep a
    :class:`~kvsnap.pipeline.Pipeline` instead.
    """
    return Pipeline(layout, transfer=transfer).capture(
        sequences,
        path,
        source=source,
        staging=staging_options(staging),
        reproducible=reproducible,
        max_shard_bytes=max_shard_bytes,
        direct_io=direct_io,
        progress=progress,
        trace=trace,
    )


def staging_options(staging: StagingOptions | PinnedPool | None) -> StagingOptions | None:
    """A caller's pool as :class:`StagingOptions` (anything else unchanged)."""
    return StagingOptions(pool=staging) if isinstance(staging, PinnedPool) else staging


class Snapshot:
    """An open snapshot: its metadata, its sequences, and what can be done with them.

    Use :meth:`open`; a ``Snapshot`` is a context manager that closes the file.
    """

    def __init__(self, reader: SnapshotReader, path: str) -> None:
        self._reader = reader
        self.path = path

    @classmethod
    def open(cls, path: str | Path, *, verify: bool = True) -> Snapshot:
        """Open and strictly validate the snapshot header at ``path`` (a local path or fsspec URL).

        With ``verify`` (the default) every block read later is checked against its checksum.
        Raises :class:`~kvsnap.errors.KVSnapError` subclasses for anything that is not a
        readable kvsnap snapshot.
        """
        return cls(SnapshotReader(path, verify=verify), str(path))

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
        total = self.kv_bytes
        callback = None if progress is None else (lambda done: progress(done, total))
        return self._reader.verify(progress=callback)

    @property
    def reader(self) -> SnapshotReader:
        """The underlying reader (block reads, checksums)."""
        return self._reader

    def check_compatible(
        self, geometry: KVGeometry, *, model_fingerprint: str | None = None, force: bool = False
    ) -> None:
        """Refuse (with :class:`IncompatibleSnapshotError`) a target this snapshot does not fit;
        see :func:`kvsnap.compat.check_fits`."""
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
        record = self.sequence(sequence_id)
        page_bytes = self._reader.page_size_bytes(name)
        pages = np.empty(len(record.block_ids) * page_bytes, dtype=np.uint8)
        self._reader.read_pages(name, record.block_ids, pages)
        shape = self.geometry.canonical_page_shape
        tensor = torch.from_numpy(pages).view(torch_dtype(self.geometry.dtype))
        tokens = tensor.reshape(len(record.block_ids) * shape[0], *shape[1:])
        return tokens[: len(record.token_ids)]

    def compare(self, other: Snapshot, *, atol: float = 0.0, rtol: float = 0.0) -> Comparison:
        """Compare this snapshot's KV with ``other`` over the tokens both hold.

        Sequences are paired by id (by position when no id matches). Elements are mismatched
        when ``|a - b| > atol + rtol * |b|`` or exactly one of them is NaN. The report names per
        tensor the largest difference and the first mismatching (sequence, token, head).
        """
        problems: list[fmt.Problem] = []
        try:
            self.check_compatible(other.geometry)
        except IncompatibleSnapshotError as error:
            return Comparison(False, [], [fmt.Problem(None, None, str(error))])
        pairs = _pair_sequences(self.sequences, other.sequences)
        if not pairs:
            return Comparison(
                False, [], [fmt.Problem(None, None, "the snapshots share no sequence")]
            )
        layers = []
        for name in self.geometry.tensor_names():
            max_diff = 0.0
            mismatches = 0
            first: dict[str, object] | None = None
            for mine, theirs in pairs:
                count = min(len(mine.token_ids), len(theirs.token_ids))
                if not np.array_equal(mine.token_ids[:count], theirs.token_ids[:count]):
                    problems.append(
                        fmt.Problem(
                            None,
                            None,
                            f"sequence {mine.id!r}: token ids differ between the snapshots",
                        )
                    )
                a = self.sequence_kv(mine.id, name)[:count].float()
                b = other.sequence_kv(theirs.id, name)[:count].float()
                diff = (a - b).abs()
                finite = torch.nan_to_num(diff, nan=0.0, posinf=0.0)
                max_diff = max(max_diff, float(finite.max()) if finite.numel() else 0.0)
                bad = ~torch.isclose(a, b, atol=atol, rtol=rtol, equal_nan=True)
                mismatches += int(bad.sum())
                if first is None and bad.any():
                    index = torch.nonzero(bad)[0].tolist()
                    first = {
                        "sequence": mine.id,
                        "token": index[0],
                        "head": index[1] if bad.dim() == 3 else 0,
                    }
            layers.append(LayerDifference(name, max_diff, mismatches, first))
        ok = not problems and all(layer.num_mismatches == 0 for layer in layers)
        return Comparison(ok, layers, problems)

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
        """How many leading tokens of each snapshot block hold real KV (partial last blocks)."""
        valid = np.zeros(self.num_blocks, dtype=np.int64)
        block_size = self.geometry.block_size
        for record in self.sequences:
            counts = np.full(len(record.block_ids), block_size, dtype=np.int64)
            counts[-1] = len(record.token_ids) - block_size * (len(record.block_ids) - 1)
            np.maximum.at(valid, record.block_ids, counts)
        return valid

    def tensor_stats(self, name: str) -> dict[str, float | int]:
        """absmax, mean, std, NaN and Inf counts of tensor ``name`` over tokens with real KV."""
        tensor = self.read_tensor(name)
        block_size = self.geometry.block_size
        valid = self.valid_tokens_per_block()
        mask = torch.from_numpy(np.arange(block_size)[None, :] < valid[:, None])
        values = tensor[mask].double()
        finite = values[torch.isfinite(values)]
        return {
            "absmax": float(finite.abs().max()) if finite.numel() else 0.0,
            "mean": float(finite.mean()) if finite.numel() else 0.0,
            "std": float(finite.std(unbiased=False)) if finite.numel() else 0.0,
            "nan": int(torch.isnan(values).sum()),
            "inf": int(torch.isinf(values).sum()),
        }

    def token_norms(self, sequence_id: str) -> dict[str, np.ndarray]:
        """Per part, a ``(num_layers, num_tokens)`` array of L2 norms of each token's KV."""
        norms: dict[str, list[np.ndarray]] = {part: [] for part in self.geometry.parts}
        for layer in range(self.geometry.num_layers):
            for part in self.geometry.parts:
                kv = self.sequence_kv(sequence_id, f"layers.{layer}.{part}").float()
                norms[part].append(kv.reshape(kv.shape[0], -1).norm(dim=1).numpy())
        return {part: np.stack(rows) for part, rows in norms.items()}

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _pair_sequences(
    mine: Sequence[fmt.SequenceRecord], theirs: Sequence[fmt.SequenceRecord]
) -> list[tuple[fmt.SequenceRecord, fmt.SequenceRecord]]:
    by_id = {record.id: record for record in theirs}
    pairs = [(record, by_id[record.id]) for record in mine if record.id in by_id]
    if pairs:
        return pairs
    return list(zip(mine, theirs, strict=False))
