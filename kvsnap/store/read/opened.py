"""What the reader's parts need of an open snapshot, handed to them instead of the reader.

:class:`OpenedFiles` holds the open data files and, once they are all open, where each layer
tensor lies, the page geometry, the signed page digests and the metadata. The reader fills it
as it opens; :class:`~kvsnap.store.read.checksums.Checksums`,
:class:`~kvsnap.store.read.page_reads.PageReads`, :mod:`~kvsnap.store.read.slot_reads`,
:mod:`~kvsnap.store.read.verify` and :mod:`~kvsnap.store.read.held_verify` read it, so none of
them imports the reader. Also here: the placements of a file set's layer tensors, worked out
once per shape.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import numpy as np

from kvsnap import format as fmt
from kvsnap.caches import BoundedLRU
from kvsnap.errors import SnapshotCorruptError
from kvsnap.format import SnapshotMetadata, TensorEntry
from kvsnap.layout import KVGeometry
from kvsnap.store.read.source import OpenFile

__all__ = ["OpenedFiles", "Placements", "joined_digests", "placements"]


@dataclass(eq=False)
class OpenedFiles:
    """One open snapshot as its reader's parts see it.

    ``open_files`` grow as the files open (a sharded snapshot's ``index_digests``, per shard
    the xxh3-128 of its trailer, known before); the rest is set once every file is open:
    ``where`` (by layer tensor name, its file position and entry), ``layer_names`` (file
    order), ``tensor_index`` (by name, its number), ``num_blocks``, ``page_bytes``,
    ``page_digest_table`` (opened with keys over BLAKE3-signed files: every page's signed
    digest, which then binds the page instead of its xxh3-64) and, last, ``metadata``.
    ``verify``: whether the caller asked to check what is read against the stored checksums.
    """

    url: str
    verify: bool
    index_digests: tuple[str, ...] | None = None
    open_files: list[OpenFile] = field(default_factory=list)
    where: dict[str, tuple[int, TensorEntry]] = field(default_factory=dict)
    layer_names: tuple[str, ...] = ()
    tensor_index: dict[str, int] = field(default_factory=dict)
    num_blocks: int = 0
    page_bytes: int = 0
    page_digest_table: np.ndarray | None = None
    metadata: SnapshotMetadata | None = None

    @property
    def verifies(self) -> bool:
        """Whether pages read are checked: against their stored checksums, or, opened with
        keys, against their signed BLAKE3 digests."""
        return self.verify or self.page_digest_table is not None

    def placement(self, name: str) -> tuple[int, TensorEntry]:
        """Which of :attr:`open_files` holds tensor ``name``, and its entry there."""
        try:
            return self.where[name]
        except KeyError:
            raise KeyError(f"no tensor {name!r} in {self.url}") from None

    def layer(self, name: str) -> tuple[int, OpenFile, TensorEntry]:
        """Layer tensor ``name``'s number (its index in :attr:`layer_names`), file and entry."""
        tensor = self.tensor_index.get(name)
        if tensor is None:
            raise KeyError(
                f"{name!r} is not a layer tensor of {self.url} (they are "
                f"{self.layer_names[0]}, ...)"
            )
        position, entry = self.placement(name)
        return tensor, self.open_files[position], entry

    def opened_metadata(self) -> SnapshotMetadata:
        """:attr:`metadata`, which a part may ask for only once the reader has loaded it."""
        assert self.metadata is not None, "the snapshot's metadata is not loaded yet"
        return self.metadata


def joined_digests(per_file: list[np.ndarray | None], tensors: int, url: str) -> np.ndarray | None:
    """One table of every layer tensor's page digests (files hold their tensors in order), or
    ``None`` unless every file has one."""
    if not per_file or any(digests is None for digests in per_file):
        return None
    tables = [digests for digests in per_file if digests is not None]
    table = tables[0] if len(tables) == 1 else np.concatenate(tables)
    if len(table) != tensors:
        raise SnapshotCorruptError("the page digests do not cover every layer tensor", file=url)
    return table


#: A reader's placements of a snapshot's layer tensors: by name, their file and entry; their
#: names in order; by name, their number.
Placements = tuple[dict[str, tuple[int, TensorEntry]], tuple[str, ...], dict[str, int]]
#: Placements per tuple of the files' entries, by identity (the layouts of one shape share
#: their entries: :func:`kvsnap.format.container.pack_file`), and geometry: worked out once
#: per shape, not on every open of a new file (~1 us a tensor).
_PLACEMENTS: BoundedLRU[
    tuple[int, ...], tuple[tuple[tuple[TensorEntry, ...], ...], KVGeometry, Placements]
]
_PLACEMENTS = BoundedLRU(64)


def placements(layouts: tuple[fmt.FileLayout, ...], geometry: KVGeometry) -> Placements:
    """Where each layer tensor of the files ``layouts`` lies (file position and entry), the
    layer names of ``geometry`` in order, and each name's number; shared by every reader of
    files with these entries (do not change them)."""
    entries = tuple(layout.entries for layout in layouts)
    key = tuple(map(id, entries))
    known = _PLACEMENTS.get(key)
    # The kept entries are held, so no other object can have their ids meanwhile.
    if known is not None and known[1] == geometry and all(map(operator.is_, known[0], entries)):
        return known[2]
    where = {
        entry.name: (index, entry)
        for index, layout in enumerate(layouts)
        for entry in layout.layer_entries
    }
    names = tuple(geometry.tensor_names())
    found = (where, names, {name: index for index, name in enumerate(names)})
    _PLACEMENTS.put(key, (entries, geometry, found))
    return found
