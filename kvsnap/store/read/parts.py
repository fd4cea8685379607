"""Parted snapshots read: opening the parts an index names (with every cross-check), and
:func:`parts_index_bytes`, the one function through which a capture opens readers, to compare
the index it is about to publish with the parts already on disk.

The write protocol (docs/format.md, "Parted snapshots"): every part is published atomically
under its own new name (``{stem}-{generation}-part-{i:05d}-of-{k:05d}.safetensors``, a plain
:class:`~kvsnap.store.SnapshotWriter` commit), then
:func:`~kvsnap.store.write.parts_index.publish_parts_index` publishes the
index, which is the commit point, and only then removes what the replaced snapshot owned.
Until the index's rename readers find the old snapshot; a failed write's parts are named by no
index, and :func:`~kvsnap.store.files.part_files.discard_parts` removes them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from kvsnap import format as fmt
from kvsnap.errors import SnapshotCorruptError
from kvsnap.format.signing import KeyRing
from kvsnap.store.files.location import INDEX_SUFFIX, Location, locate, stem_of
from kvsnap.store.files.resolve import Resolved
from kvsnap.store.read.reader import SnapshotReader

__all__ = ["OpenedParts", "opened_parts", "parts_index_bytes", "whole_metadata"]


def parts_index_bytes(path: str | os.PathLike[str], records: Sequence[fmt.PartRecord]) -> bytes:
    """The index of a parted snapshot at ``path`` whose parts ``records`` are durable: the
    whole snapshot's metadata is read from part 1 (verified), and every part is checked to be
    the part its record says (number, heads, trailer digest, same snapshot), so an index is
    never published over parts that do not make one snapshot."""
    location = locate(path, None)
    index_location = location.with_suffix(INDEX_SUFFIX)
    if not records:
        raise ValueError("a parted snapshot needs at least one part")
    stem = stem_of(location)
    foreign = [record.file for record in records if not fmt.is_part_of(stem, record.file)]
    if foreign:
        raise ValueError(f"{foreign[0]!r} is not a part file name of {location.name}")
    with SnapshotReader.opened(Resolved.single(location.sibling(records[0].file))) as first:
        part = first.metadata.part
        if part is None:
            raise ValueError(f"{records[0].file} is not a part of a parted snapshot")
        whole = _whole_metadata(first.metadata, part.num_kv_heads)
    raw = fmt.encode_parts_index(whole, records)
    index = fmt.decode_parts_index(raw, file=index_location.url)
    opened = _open_once(index_location, index, verify=True)
    for reader in opened:
        reader.close()
    return raw


@dataclass
class OpenedParts:
    """A parted snapshot opened: its index and one reader per part, in head order."""

    index: fmt.PartsIndex
    readers: list[SnapshotReader]
    url: str

    def close(self) -> None:
        """Close every part's reader."""
        for reader in self.readers:
            reader.close()


def opened_parts(
    resolved: Resolved,
    *,
    verify: bool = True,
    keys: KeyRing | None = None,
    read_whole_max_bytes: int = 0,
) -> OpenedParts:
    """The parted snapshot ``resolved`` describes, every part opened and checked once (no
    retry: a part that vanished raises, for the caller's
    :func:`~kvsnap.store.files.resolve.open_retrying`); a part file of at most
    ``read_whole_max_bytes`` is read whole as it opens
    (:class:`~kvsnap.store.read.source.Source`)."""
    index, index_location = resolved.index, resolved.index_location
    assert isinstance(index, fmt.PartsIndex) and index_location is not None
    readers = _open_once(
        index_location,
        index,
        verify=verify,
        keys=keys,
        home=resolved.directory,
        read_whole_max_bytes=read_whole_max_bytes,
    )
    return OpenedParts(index, readers, index_location.url)


def _open_once(
    index_location: Location,
    index: fmt.PartsIndex,
    *,
    verify: bool,
    keys: KeyRing | None = None,
    home: str | None = None,
    read_whole_max_bytes: int = 0,
) -> list[SnapshotReader]:
    """A reader per part of ``index``, each checked against it; ``home``: the index's real
    directory, which every part must resolve into (worked out here when not given); a part
    file of at most ``read_whole_max_bytes`` is read whole as it opens."""
    if home is None and index_location.is_local:
        home = os.path.realpath(os.path.dirname(index_location.path))
    readers: list[SnapshotReader] = []
    try:
        for number, record in enumerate(index.parts, start=1):
            part = Resolved.single(index_location.sibling(record.file), home)
            reader = SnapshotReader.opened(
                part, verify=verify, keys=keys, read_whole_max_bytes=read_whole_max_bytes
            )
            readers.append(reader)
            _check_part(index, number, record, reader)
            if number > 1 and reader.metadata.sequences != readers[0].metadata.sequences:
                raise SnapshotCorruptError(
                    "its sequences (token ids, block ids or prefix hashes) differ from part 1's",
                    file=reader.url,
                )
    except BaseException:
        for reader in readers:
            reader.close()
        raise
    return readers


def _check_part(
    index: fmt.PartsIndex, number: int, record: fmt.PartRecord, reader: SnapshotReader
) -> None:
    """``reader``'s file is part ``number`` of this index: its ``part`` key, its heads, its
    metadata the index's (but for its head count, ``part`` and ``created``: each rank stamps
    its own) and its trailer the digest the index records."""
    part = reader.metadata.part
    whole = index.metadata
    expected = fmt.PartInfo(
        number, len(index.parts), record.first_head, whole.geometry.num_kv_heads
    )
    held = reader.metadata.geometry.num_kv_heads
    if part != expected or held != record.num_heads:
        says = (
            "it is no part"
            if part is None
            else f"it is part {part.index} of {part.count} holding heads {part.first_head}.."
            f"{part.first_head + held} of {part.num_kv_heads}"
        )
        raise SnapshotCorruptError(
            f"is not part {number} of {len(index.parts)} holding heads {record.first_head}.."
            f"{record.first_head + record.num_heads} of {whole.geometry.num_kv_heads}: {says}",
            file=reader.url,
        )
    if reader.trailer_digest() != record.trailer:
        raise SnapshotCorruptError(
            "does not match the index's trailer digest (a part of another snapshot or write)",
            file=reader.url,
            tensor=fmt.CHECKSUMS_TENSOR,
        )
    if _comparable(reader.metadata.to_json_dict(), whole.geometry.num_kv_heads) != _comparable(
        whole.document, whole.geometry.num_kv_heads
    ):
        raise SnapshotCorruptError("its metadata differs from the index's", file=reader.url)


def _comparable(document: dict[str, object], num_kv_heads: int) -> dict[str, object]:
    """A metadata document as parts and index must agree on it: whole head count, no
    ``part`` or ``created``."""
    comparable = {key: value for key, value in document.items() if key not in ("part", "created")}
    layout = dict(comparable["layout"])  # type: ignore[call-overload]
    layout["num_kv_heads"] = num_kv_heads
    comparable["layout"] = layout
    return comparable


def _whole_metadata(part: fmt.SnapshotMetadata, num_kv_heads: int) -> fmt.SnapshotMetadata:
    """The whole snapshot's metadata, given one part's."""
    return fmt.SnapshotMetadata(
        geometry=fmt.whole_geometry(part.geometry, num_kv_heads),
        source=part.source,
        sequences=part.sequences,
        num_blocks=part.num_blocks,
        capture_encoding=part.capture_encoding,
        tp_size=part.tp_size,
        kvsnap_version=part.kvsnap_version,
        created=part.created,
        signature=part.signature,
    )


def whole_metadata(index: fmt.PartsIndex, first: SnapshotReader) -> fmt.SnapshotMetadata:
    """The whole snapshot's metadata: the index's, with part 1's sequences."""
    meta = index.metadata
    return fmt.SnapshotMetadata(
        geometry=meta.geometry,
        source=meta.source,
        sequences=first.metadata.sequences,
        num_blocks=meta.num_blocks,
        capture_encoding=meta.capture_encoding,
        tp_size=meta.tp_size,
        kvsnap_version=meta.kvsnap_version,
        created=meta.created,
        signature=meta.signature,
    )
