"""Whether the elected writers of every TP rank tile each canonical page exactly once: the
check a multi-rank capture runs over its layouts before it writes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvsnap.errors import LayoutError
from kvsnap.layout.mapping import coverage

if TYPE_CHECKING:
    from kvsnap.layout.cache import CacheLayout

__all__ = ["check_tiling"]


def check_tiling(layouts: Sequence[CacheLayout]) -> None:
    """Check that the elected writers of all ranks tile every canonical page exactly once.

    ``layouts`` holds one layout per TP rank (same geometry). For each canonical tensor and
    each block residue modulo the writers' count, the writing ranks' runs must cover every
    canonical byte exactly once; otherwise a capture would leave holes or race. Raises
    :class:`LayoutError` naming the tensor and the uncovered or doubly covered bytes.
    """
    if not layouts:
        raise LayoutError("check_tiling needs at least one layout")
    geometry = layouts[0].geometry
    ranks = sorted(layout.tp_rank for layout in layouts)
    if ranks != list(range(layouts[0].tp_size)):
        raise LayoutError(f"check_tiling needs every TP rank once, got ranks {ranks}")
    for name in geometry.tensor_names():
        mappings = [layout.ref(name).mapping for layout in layouts]
        period = math.lcm(*(mapping.num_writers for mapping in mappings))
        for block_residue in range(period):
            total = np.zeros(geometry.canonical_page_size_bytes, dtype=np.int32)
            for mapping in mappings:
                if block_residue % mapping.num_writers == mapping.writer_index:
                    total += coverage(mapping)
            if (total != 1).any():
                wrong = np.flatnonzero(total != 1)
                raise LayoutError(
                    f"{name}: elected writers cover canonical bytes {wrong[0]}..{wrong[-1]} "
                    f"{int(total[wrong[0]])} times for blocks = {block_residue} mod {period} "
                    "(each byte must be written exactly once)"
                )
