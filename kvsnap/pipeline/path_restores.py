"""``Pipeline.restore(PATH)`` of a snapshot format a layer above the pipeline reads.

The pipeline opens a path through the store (:func:`~kvsnap.store.read.head_parts.open_snapshot`),
which reads every ordinary snapshot. An encoded snapshot (format version 3, docs/format.md
"Encoded snapshots") is read by :mod:`kvsnap.encoded`, above the pipeline, which the pipeline
may not import (tests/project/test_import_layers.py): so that layer registers its restore of a
path here (:mod:`kvsnap.encoded.path_restore`, which ``kvsnap`` imports with
``kvsnap.Pipeline``). The pipeline asks the registered restores only once the store has refused
the file as a format version it does not read (``UnsupportedVersionError``, raised from the
header that open reads anyway), so an ordinary file's restore reads and parses nothing more.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from kvsnap.errors import UnsupportedVersionError
from kvsnap.pipeline.jobs import RestoreResult

__all__ = ["PathRestore", "register_path_restore", "restore_refused_path"]

#: ``restore(pipeline, path, block_ids, **options)``: ``Pipeline.restore`` of the snapshot at
#: ``path`` into ``pipeline``'s caches (``options``: that method's keyword arguments), or
#: ``None`` when ``path`` holds no snapshot of the format it reads.
PathRestore = Callable[..., RestoreResult | None]

_RESTORES: list[PathRestore] = []
_RESTORES_LOCK = threading.Lock()


def register_path_restore(restore: PathRestore) -> PathRestore:
    """Have ``Pipeline.restore`` of a path the store refuses as another format version ask
    ``restore`` (once, however often it is registered); returns ``restore``."""
    with _RESTORES_LOCK:
        if restore not in _RESTORES:
            _RESTORES.append(restore)
    return restore


def restore_refused_path(
    pipeline: Any,
    path: str | os.PathLike[str],
    block_ids: Mapping[str, np.ndarray | Sequence[int]],
    refused: UnsupportedVersionError,
    options: Mapping[str, Any],
) -> RestoreResult:
    """The restore of ``path``, which the store refused (``refused``), by the first registered
    restore that reads it; ``refused`` raised again when none does."""
    with _RESTORES_LOCK:
        restores = tuple(_RESTORES)
    for restore in restores:
        result = restore(pipeline, path, block_ids, **options)
        if result is not None:
            return result
    raise refused
