"""Read-only analysis of snapshots: compare two, per-tensor statistics, per-token norms.

Nothing here writes or restores anything, and nothing needs torch: every function reads a
snapshot's KV through its readers (checksums verified), a bounded step at a time, and
reduces it with numpy, so memory stays bounded whatever the snapshot's size. The
``Snapshot`` methods of the same names delegate here; what they read of it is
:class:`ReadableSnapshot`, so this package needs nothing of the facade.

- :func:`compare` (``Snapshot.compare``, ``kvsnap diff``, ``kvsnap verify --against``): a
  :class:`Comparison` of two snapshots' KV (:mod:`kvsnap.analysis.comparison` says what it
  holds, :mod:`kvsnap.analysis.report` writes it for people);
- :func:`snapshot_stats` and :func:`tensor_stats` (``kvsnap inspect --stats``);
- :func:`token_norms` (``kvsnap inspect --plot``) and :func:`valid_tokens_per_block`.
"""

from __future__ import annotations

from kvsnap.analysis.comparison import (
    Comparison,
    DiffProfile,
    HeadDifference,
    LayerDifference,
    Location,
    NonFinite,
    SourceDifference,
    VectorLocation,
)
from kvsnap.analysis.diff import compare
from kvsnap.analysis.norms import token_norms
from kvsnap.analysis.readable import ReadableSnapshot
from kvsnap.analysis.stats import snapshot_stats, tensor_stats, valid_tokens_per_block
from kvsnap.analysis.values import compute_dtype

__all__ = [
    "Comparison",
    "DiffProfile",
    "HeadDifference",
    "LayerDifference",
    "Location",
    "NonFinite",
    "ReadableSnapshot",
    "SourceDifference",
    "VectorLocation",
    "compare",
    "compute_dtype",
    "snapshot_stats",
    "tensor_stats",
    "token_norms",
    "valid_tokens_per_block",
]
