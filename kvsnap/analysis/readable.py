"""What the analysis reads of a snapshot: :class:`ReadableSnapshot` (a
:class:`~kvsnap.snapshot.Snapshot` is one), so that this package needs nothing of the facade."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvsnap import format as fmt
from kvsnap.layout import KVGeometry
from kvsnap.store.head_parts import HeadPart


class ReadableSnapshot(Protocol):
    """A snapshot as the analysis reads it: its path, metadata, geometry and sequences, and
    its head-range parts, whose readers give its KV block by block (checksums verified)."""

    @property
    def path(self) -> str: ...

    @property
    def metadata(self) -> fmt.SnapshotMetadata: ...

    @property
    def geometry(self) -> KVGeometry: ...

    @property
    def sequences(self) -> list[fmt.SequenceRecord]: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def parts(self) -> Sequence[HeadPart]: ...

    def sequence(self, sequence_id: str) -> fmt.SequenceRecord: ...
