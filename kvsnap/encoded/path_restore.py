"""``Pipeline.restore(PATH)`` of a local encoded snapshot, registered with the pipeline
(:mod:`kvsnap.pipeline.path_restores`) when this module is imported, as ``kvsnap.Pipeline``
imports it.

The file opens as ``Snapshot.open(PATH)`` opens it (:func:`~kvsnap.encoded.opening.open_encoded`,
without keys, as the pipeline opens every path: the signature's fields and tensor are checked,
its MAC by a caller opening with keys) and restores as ``Snapshot.restore`` restores it: an
fp8 file into CUDA caches on the device (:func:`~kvsnap.encoded.device_restore.restore_fp8`),
anything else by the pipeline from the decoded file.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from kvsnap.encoded.device_restore import restore_fp8
from kvsnap.encoded.opening import open_encoded
from kvsnap.pipeline import Pipeline
from kvsnap.pipeline.jobs import RestoreResult
from kvsnap.pipeline.path_restores import register_path_restore

__all__ = ["restore_encoded_path"]


def restore_encoded_path(
    pipeline: Pipeline,
    path: str | os.PathLike[str],
    block_ids: Mapping[str, np.ndarray | Sequence[int]],
    *,
    model_fingerprint: str | None = None,
    force: bool = False,
    while_copying: Callable[[], None] | None = None,
    **options: Any,
) -> RestoreResult | None:
    """``pipeline.restore(path, block_ids, ...)`` of the local encoded snapshot at ``path``;
    ``None`` when ``path`` is none (the store's refusal stands). A restore on the device calls
    ``while_copying`` once it has written the caches."""
    opened = open_encoded(path, None, verify=True)
    if opened is None:
        return None
    with contextlib.closing(opened):
        restored = restore_fp8(opened, pipeline.layouts, block_ids, model_fingerprint, force)
        if restored is None:
            return pipeline.restore(
                opened,
                block_ids,
                model_fingerprint=model_fingerprint,
                force=force,
                while_copying=while_copying,
                **options,
            )
        if while_copying is not None:
            while_copying()
        return restored


register_path_restore(restore_encoded_path)
