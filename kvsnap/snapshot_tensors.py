"""A snapshot's KV read back as tensors, and the statistics over it: the methods of
:class:`~kvsnap.snapshot.Snapshot` that read whole tensors or one sequence's KV
(:class:`SnapshotTensors`, which ``Snapshot`` inherits) and hand them to
:mod:`kvsnap.analysis`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvsnap import format as fmt
from kvsnap.layout import torch_dtype
from kvsnap.store import SnapshotReader

if TYPE_CHECKING:
    import torch

    from kvsnap.analysis import Comparison, ReadableSnapshot
    from kvsnap.layout import KVGeometry
    from kvsnap.pipeline import ProgressCallback
    from kvsnap.store.read.head_parts import HeadPart

__all__ = ["SnapshotTensors"]


class SnapshotTensors:
    """What :class:`~kvsnap.snapshot.Snapshot` reads back as tensors: its parts' readers
    (:attr:`parts`) and its sequences (:meth:`sequence`) are the snapshot's own."""

    if TYPE_CHECKING:  # the snapshot's own; with them a SnapshotTensors is a ReadableSnapshot
        path: str

        @property
        def metadata(self) -> fmt.SnapshotMetadata: ...

        @property
        def geometry(self) -> KVGeometry: ...

        @property
        def sequences(self) -> list[fmt.SequenceRecord]: ...

        @property
        def num_blocks(self) -> int: ...

        @property
        def parts(self) -> tuple[HeadPart, ...]: ...

        def sequence(self, sequence_id: str) -> fmt.SequenceRecord: ...

    def read_tensor(self, name: str) -> torch.Tensor:
        """A whole canonical tensor, every block of it, checksums verified.

        Args:
            name: The tensor, ``layers.{layer}.{part}`` with part ``key``, ``value`` or
                ``latent`` (MLA).

        Returns:
            A CPU tensor of the snapshot's dtype, ``(num_blocks, block_size, num_kv_heads,
            head_dim)`` (``(num_blocks, block_size, latent_dim)`` for MLA).

        Raises:
            KeyError: No tensor of that name.
            SnapshotCorruptError: A block failed its checksum (with ``verify``).
            SnapshotIOError: Reading failed.

        Example:
            >>> import kvsnap
            >>> with kvsnap.Snapshot.open("prefix.safetensors") as snap:
            ...     tuple(snap.read_tensor("layers.1.value").shape)
            (3, 16, 2, 64)
        """
        if len(self.parts) == 1:
            return self.parts[0].reader.read_tensor(name)
        import torch

        # Parts hold head ranges: the head axis of the canonical page is the third.
        return torch.cat([part.reader.read_tensor(name) for part in self.parts], dim=2)

    def sequence_kv(self, sequence_id: str, name: str) -> torch.Tensor:
        """One sequence's KV of tensor ``name``, token by token, checksums verified.

        Args:
            sequence_id: The sequence.
            name: The tensor, ``layers.{layer}.{part}`` (see ``read_tensor``).

        Returns:
            A CPU tensor ``(num_tokens, num_kv_heads, head_dim)``, or ``(num_tokens,
            latent_dim)`` for MLA.

        Raises:
            UnknownSequenceError: No sequence of that id.
            KeyError: No tensor of that name.
            SnapshotCorruptError: A block failed its checksum (with ``verify``).

        Example:
            >>> import kvsnap
            >>> with kvsnap.Snapshot.open("prefix.safetensors") as snap:
            ...     tuple(snap.sequence_kv("seq-0", "layers.0.key").shape)
            (40, 2, 64)
        """
        import torch

        record = self.sequence(sequence_id)
        if len(self.parts) == 1:
            return _sequence_kv(self.parts[0].reader, record, name)
        return torch.cat([_sequence_kv(part.reader, record, name) for part in self.parts], dim=1)

    def compare(
        self,
        other: ReadableSnapshot,
        *,
        atol: float = 0.0,
        rtol: float = 0.0,
        top: int = 10,
        profile: bool = False,
        profile_sequence: str | None = None,
        progress: ProgressCallback | None = None,
    ) -> Comparison:
        """Compare this snapshot's KV with a reference snapshot, token by token, streaming.

        The layers, KV heads and head size must match; dtype and block size may differ.
        Sequences are paired by id (by position when no id matches, which a note says); an
        element is beyond the tolerance when ``|a - b| > atol + rtol * |b|``, or when it is
        NaN or Inf in one snapshot and not the same in the other. Both snapshots are read
        once, a bounded step at a time (``kvsnap.analysis.compare``).

        Args:
            other: The reference snapshot.
            atol: Absolute tolerance. Default ``0.0``: exact.
            rtol: Relative tolerance. Default ``0.0``.
            top: How many of the largest element differences to keep. Default ``10``.
            profile: Keep one sequence's per-token errors, for a picture (``profile``).
                Default ``False``.
            profile_sequence: The sequence (an id of this snapshot) whose per-token errors
                are kept (implies ``profile``). Default ``None``: the first holding tokens.
            progress: ``progress(done_bytes, total_bytes)``, the KV bytes of both snapshots
                read so far. Default ``None``.

        Returns:
            A ``Comparison``: ``ok``; how the origins differ (``sources``: model
            fingerprint, engine, dtype, block size); the structural ``problems``; per tensor
            (``layers``) the largest difference and where, the share beyond the tolerance,
            relative errors, cosines and a per-head breakdown; the ``top`` differences;
            ``notes``. ``report()`` writes it for people, ``to_dict()`` as JSON.

        Raises:
            SnapshotCorruptError: A block failed its checksum.
            KeyError: ``profile_sequence`` is not a compared sequence.

        Example:
            >>> import kvsnap
            >>> with kvsnap.Snapshot.open("prefix.safetensors") as snap:
            ...     comparison = snap.compare(snap)
            >>> comparison.ok, comparison.layers[0].max_abs_diff, comparison.layers[0].cosine_min
            (True, 0.0, 1.0)
        """
        from kvsnap import analysis

        return analysis.compare(
            self,
            other,
            atol=atol,
            rtol=rtol,
            top=top,
            profile=profile,
            profile_sequence=profile_sequence,
            progress=progress,
        )

    def valid_tokens_per_block(self) -> np.ndarray:
        """How many leading tokens of each snapshot block hold real KV.

        A sequence's last block may be partial; a block no sequence references counts 0
        (``kvsnap.analysis.valid_tokens_per_block``).

        Returns:
            An int64 array, one count per snapshot block.

        Example:
            >>> import kvsnap
            >>> with kvsnap.Snapshot.open("prefix.safetensors") as snap:
            ...     snap.valid_tokens_per_block().tolist()
            [16, 16, 8]
        """
        from kvsnap import analysis

        return analysis.valid_tokens_per_block(self)

    def tensor_stats(self, name: str) -> dict[str, float | int]:
        """Statistics of one tensor over the tokens that hold real KV.

        Args:
            name: The tensor, ``layers.{layer}.{part}`` (see ``read_tensor``).

        Returns:
            ``absmax``, ``mean``, ``std`` (population; of the finite values) and the ``nan``
            and ``inf`` counts; all zero when no token holds KV
            (``kvsnap.analysis.tensor_stats``).

        Raises:
            KeyError: No tensor of that name.
            SnapshotCorruptError: A block failed its checksum.

        Example:
            >>> import kvsnap
            >>> with kvsnap.Snapshot.open("prefix.safetensors") as snap:
            ...     stats = snap.tensor_stats("layers.0.key")
            >>> sorted(stats), stats["nan"]
            (['absmax', 'inf', 'mean', 'nan', 'std'], 0)
        """
        from kvsnap import analysis

        return analysis.tensor_stats(self, name)

    def stats(self, progress: ProgressCallback | None = None) -> dict[str, dict[str, float | int]]:
        """``tensor_stats`` of every layer tensor, reading the snapshot once, streaming.

        Args:
            progress: ``progress(done_bytes, total_bytes)``, called as data is read. Default
                ``None``.

        Returns:
            Per tensor name, its ``tensor_stats`` (``kvsnap.analysis.snapshot_stats``: a
            bounded step at a time, whatever the snapshot's size).

        Raises:
            SnapshotCorruptError: A block failed its checksum.

        Example:
            >>> import kvsnap
            >>> with kvsnap.Snapshot.open("prefix.safetensors") as snap:
            ...     stats = snap.stats()
            >>> list(stats)[:2], stats["layers.0.key"]["nan"]
            (['layers.0.key', 'layers.0.value'], 0)
        """
        from kvsnap import analysis

        return analysis.snapshot_stats(self, progress=progress)

    def token_norms(self, sequence_id: str) -> dict[str, np.ndarray]:
        """The L2 norm of each token's KV in each layer, of one sequence.

        Args:
            sequence_id: The sequence.

        Returns:
            Per part (``key`` and ``value``, or ``latent``), a float32 ``(num_layers,
            num_tokens)`` array (``kvsnap.analysis.token_norms``).

        Raises:
            UnknownSequenceError: No sequence of that id.
            SnapshotCorruptError: A block failed its checksum.

        Example:
            >>> import kvsnap
            >>> with kvsnap.Snapshot.open("prefix.safetensors") as snap:
            ...     norms = snap.token_norms("seq-0")
            >>> {part: array.shape for part, array in norms.items()}
            {'key': (2, 40), 'value': (2, 40)}
        """
        from kvsnap import analysis

        return analysis.token_norms(self, sequence_id)


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
