"""What a writer may delete when it replaces a snapshot: only files of the snapshot's own naming.

A snapshot written to ``dir/NAME.safetensors`` owns exactly these names in ``dir``:
``NAME.safetensors`` (the single file), ``NAME.safetensors.index.json`` (the sharded form's
index), shards ``{stem}-00001-of-00004.safetensors`` and ``{stem}-g<12 hex>-00001-of-00004
.safetensors`` (``stem``: NAME without ``.safetensors``, see
:func:`kvsnap.format.is_shard_of`), and temporary files of those names
(:mod:`kvsnap.store.files.publish`), and parts ``{stem}-g<12 hex>-part-00001-of-00004.safetensors``
of a parted snapshot (:func:`kvsnap.format.is_part_of`). An index may name any file (it
could have been copied from another snapshot); a file it names is removed only when the naming
above makes it this snapshot's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

from kvsnap import format as fmt
from kvsnap.errors import KVSnapError
from kvsnap.store.files.location import INDEX_SUFFIX, Location, stem_of
from kvsnap.store.files.resolve import index_members, snapshot_names


def owns_name(location: Location) -> Callable[[str], bool]:
    """Whether a file name in ``location``'s directory belongs to the snapshot at ``location``."""
    stem = stem_of(location)
    own = {location.name, location.with_suffix(INDEX_SUFFIX).name}
    return lambda name: name in own or fmt.is_shard_of(stem, name) or fmt.is_part_of(stem, name)


def stale_files(location: Location, new_files: Sequence[Location], sharded: bool) -> list[Location]:
    """Files of the snapshot at ``location`` that its new form (``new_files``: one file, or
    shards or parts published by an index, ``sharded``) does not replace: the other form's
    index or single file, and the shards or parts the previous index names that are this
    snapshot's by name and not among ``new_files``. In the order to delete them: a superseded
    index first, so readers stop finding old shards or parts. One read of the old index (an
    unreadable one names nothing we could know to be ours), and for an indexed form one
    ``stat`` of the single file."""
    stale: list[Location] = []
    single, index = snapshot_names(location)
    owns = owns_name(location)
    new_names = {file.name for file in new_files}
    named = index_members(index)
    if not sharded and named is not None:
        stale.append(index)
    stale += [index.sibling(name) for name in named or () if owns(name) and name not in new_names]
    if sharded and single.exists():
        stale.append(single)
    return stale


def remove_quietly(locations: Sequence[Location]) -> None:
    """Delete ``locations``, ignoring files that are already gone or cannot be removed (the new
    snapshot is published by then; a leftover old file only wastes space)."""
    for location in locations:
        with contextlib.suppress(OSError, KVSnapError):
            location.remove()
