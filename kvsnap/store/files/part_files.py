"""A parted snapshot's part files: where each goes, and the removal of a failed write's parts
(docs/format.md, "Parted snapshots")."""

from __future__ import annotations

import contextlib
import os

from kvsnap import format as fmt
from kvsnap.errors import KVSnapError
from kvsnap.store.files import publish
from kvsnap.store.files.location import locate, stem_of

__all__ = ["discard_parts", "part_path"]


def part_path(path: str | os.PathLike[str], index: int, count: int, generation: str) -> str:
    """Where part ``index`` (1-based) of ``count`` of the write ``generation`` of the snapshot
    ``path`` (``NAME.safetensors``) goes: beside it, named by
    :func:`kvsnap.format.part_file_name`."""
    location = locate(path, None)
    name = fmt.part_file_name(stem_of(location), index, count, generation)
    return location.sibling(name).url


def discard_parts(path: str | os.PathLike[str], generation: str) -> list[str]:
    """Remove the part files of the write ``generation`` of the snapshot ``path`` (a failed
    parted write: no index names them), and the unlocked temporary files of those names
    (dead writers'; a live writer's is kept). Best effort: what cannot be removed stays. The
    published snapshot, if any, is never touched (its parts have another generation). Returns
    the URLs removed. Local directories and fsspec filesystems with ``ls``."""
    location = locate(path, None)
    stem = stem_of(location)
    removed: list[str] = []
    with contextlib.suppress(OSError, KVSnapError):
        if location.is_local:
            names = os.listdir(os.path.dirname(location.path))
        else:
            names = [
                os.path.basename(entry)
                for entry in location.fs.ls(os.path.dirname(location.path), detail=False)
            ]
        for name in names:
            if fmt.is_part_of(stem, name, generation):
                target = location.sibling(name)
                with contextlib.suppress(OSError, KVSnapError):
                    target.remove()
                    removed.append(target.url)
        if location.is_local:
            removed += publish.remove_dead_temps(
                os.path.dirname(location.path),
                lambda name: fmt.is_part_of(stem, name, generation),
                stem,
            )
    return removed
