"""The staging pipeline: capture and restore over slots that span tensors, kept warm.

:class:`Pipeline` is what an engine keeps per set of caches; :func:`kvsnap.capture` and
:meth:`kvsnap.Snapshot.restore` run on the same machinery. Modules, in pipeline order:
``slots`` (which pages a slot carries), ``movers`` (the interface, and the transfer handler's
path for named backends), ``fused`` (one kernel launch, one digest launch and one DMA per
slot), ``staging`` (pinned slots and device buffers kept per process), ``capture`` (a whole
capture, which :meth:`Pipeline.capture` runs) and ``restore`` (the restore loop), ``jobs``
(requests and results), ``part_jobs`` (a restore's head-range parts: which pipeline moves
which, and what failed), ``options``, ``pipeline`` (the :class:`Pipeline`), ``path_restores``
(a path's restore by the layer above, for the formats it reads: encoded snapshots). The caches'
addresses as one table are :mod:`kvsnap.transfer.page_table`.
"""

from kvsnap.pipeline.jobs import CaptureResult, RestoreResult, SequenceBlocks
from kvsnap.pipeline.options import ProgressCallback, StagingOptions, TransferOptions
from kvsnap.pipeline.pipeline import Pipeline
from kvsnap.pipeline.staging import release_shared_staging

__all__ = [
    "CaptureResult",
    "Pipeline",
    "ProgressCallback",
    "RestoreResult",
    "SequenceBlocks",
    "StagingOptions",
    "TransferOptions",
    "release_shared_staging",
]
