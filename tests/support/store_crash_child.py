"""Child process of the crash tests: writes one snapshot and may SIGKILL itself on the way.

Runs under multiprocessing's forkserver (which preloads this module and kvsnap), so each
child starts in milliseconds. The parent kills children at random moments too; the kill
points here make sure the critical instants (mid-data, each fsync, just before and just
after the rename) are hit every time, not only by luck.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np

from kvsnap import format as fmt
from kvsnap.store.files import publish
from kvsnap.store.write import local_file
from tests.support.store_helpers import (
    GEOMETRIES,
    make_metadata,
    random_pages,
    shared_prefix_tokens,
    write_snapshot,
)


def snapshot_data(
    geometry: str, seed: int, pages_seed: int | None = None
) -> tuple[fmt.SnapshotMetadata, dict[str, np.ndarray]]:
    """The metadata of snapshot ``seed`` and the pages of ``pages_seed`` (default: ``seed``);
    the parent rebuilds them to compare."""
    rng = np.random.default_rng(seed)
    spec = GEOMETRIES[geometry]
    metadata = make_metadata(spec, shared_prefix_tokens(rng, spec.block_size, num_sequences=6))
    # Many blocks, so that writing takes long enough to be interrupted in the middle.
    metadata.num_blocks += 400 if spec.canonical_page_size_bytes < 4096 else 40
    if pages_seed is not None:
        rng = np.random.default_rng(pages_seed)
    return metadata, random_pages(rng, metadata)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _die_at_call(module: Any, name: str, nth: int, after: bool) -> None:
    """SIGKILL at the ``nth`` call (0-based) of ``module.name``, before or after it runs."""
    real = getattr(module, name)
    calls = [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        index = calls[0]
        calls[0] += 1
        if index == nth and not after:
            _die()
        result = real(*args, **kwargs)
        if index == nth and after:
            _die()
        return result

    setattr(module, name, wrapper)


def write_and_maybe_die(
    path: str,
    geometry: str,
    seed: int,
    kill: tuple[Any, ...] | None,
    max_shard_bytes: int | None = None,
    pages_seed: int | None = None,
) -> None:
    """Write snapshot ``seed`` to ``path``; ``kill`` picks where to die:

    ``("bytes", n)``: once ``n`` KV bytes are written; ``("call", name, nth, after)``: at the
    ``nth`` call of ``os.fsync``/``os.replace``/``_fsync_directory`` (``publish.fsync_directory``)/
    ``_pwrite_all`` (``local_file._pwrite_all``);
    ``None``: never by itself (the parent may still kill it at any time).
    """
    metadata, pages = snapshot_data(geometry, seed, pages_seed)
    progress = None
    if kill is not None and kill[0] == "bytes":
        threshold = kill[1]

        def progress(done: int) -> None:
            if done >= threshold:
                _die()

    elif kill is not None and kill[0] == "call":
        _, name, nth, after = kill
        # The store's own functions by the names the tests use, else os.fsync / os.replace.
        owners = {
            "_pwrite_all": (local_file, "_pwrite_all"),
            "_fsync_directory": (publish, "fsync_directory"),
        }
        module, attribute = owners.get(name, (os, name))
        _die_at_call(module, attribute, nth, after)
    write_snapshot(
        path,
        metadata,
        pages,
        rng=np.random.default_rng(seed),
        progress=progress,
        max_shard_bytes=max_shard_bytes,
    )


# Imported once by the forkserver: warm what every child needs (jsonschema's import and the
# compiled metadata schema) so that forked children start writing at once.
snapshot_data("bf16", 0)[0].problems()
