"""A snapshot of any form opened in one step: one resolution, one open per file.

:func:`open_snapshot` is what a caller that takes any snapshot path calls (``kvsnap.Snapshot.
open``): it resolves the path once (:func:`~kvsnap.store.resolve.resolve`), opens a single or
sharded snapshot as a :class:`~kvsnap.store.reader.SnapshotReader` and a parted one as its
parts (:class:`~kvsnap.store.parts.OpenedParts`), and starts over when a replacement removed
a file meanwhile (:func:`~kvsnap.store.resolve.open_retrying`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from kvsnap.format.signing import KeyRing
from kvsnap.store.location import locate
from kvsnap.store.parts import OpenedParts, opened_parts
from kvsnap.store.reader import SnapshotReader
from kvsnap.store.resolve import Form, Resolved, open_retrying

__all__ = ["open_snapshot"]


def open_snapshot(
    path: str | os.PathLike[str],
    *,
    verify: bool = True,
    keys: KeyRing | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> SnapshotReader | OpenedParts:
    """The snapshot at ``path`` (a local path or fsspec URL naming ``NAME.safetensors`` or its
    index) opened: a reader for a single-file or sharded snapshot, every part's reader for a
    parted one (each part checked against the index). ``verify`` and ``keys`` as for
    :class:`SnapshotReader`. Resolving costs at most two ``stat`` calls and one read of the
    index, and every data file is opened once."""

    def attempt(resolved: Resolved) -> SnapshotReader | OpenedParts:
        if resolved.form is Form.PARTED:
            return opened_parts(resolved, verify=verify, keys=keys)
        return SnapshotReader.opened(resolved, verify=verify, keys=keys)

    return open_retrying(locate(path, storage_options), attempt)
