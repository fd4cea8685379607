"""What a writer's commit published (:class:`SnapshotInfo`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SnapshotInfo"]


@dataclass(frozen=True)
class SnapshotInfo:
    """What :meth:`SnapshotWriter.commit` published.

    ``path`` is what :class:`SnapshotReader` opens (the file, or the index of a sharded
    snapshot); ``files`` the data files in order; ``num_bytes`` their total size; ``kv_bytes``
    the layer tensors' bytes. ``direct_io`` tells whether O_DIRECT carried layer data.
    """

    path: str
    files: tuple[str, ...]
    num_bytes: int
    kv_bytes: int
    num_blocks: int
    direct_io: bool
    fallback_reason: str | None
    seconds: float
    #: xxh3-128 (hex) of each file's checksum trailer, in ``files`` order: what an index
    #: records to bind itself to exactly these files.
    trailers: tuple[str, ...] = ()
    #: Whether the layer data was placed in the mapped files by the caller's device copies
    #: (:meth:`SnapshotWriter.map_for_device`) rather than written.
    mapped: bool = False
