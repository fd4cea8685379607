"""The rule every fp8 scale obeys, checked with numpy alone (an fp8 snapshot opens, and the CLI
inspects it, without torch): a finite number of at least fp32's smallest normal."""

from __future__ import annotations

import numpy as np

from kvsnap.errors import SnapshotCorruptError

#: The smallest scale: fp32's smallest normal number (a subnormal scale loses precision).
MIN_SCALE = 2.0**-126


def check_scale_table(
    scales: np.ndarray, tensor: str | None = None, file: str | None = None
) -> None:
    """Refuse (``SnapshotCorruptError``) a table of scales a quantizer cannot have written:
    not ``float32 (num_blocks, heads)``, or any scale that is not a finite number of at least
    :data:`MIN_SCALE` (the error names the first one's block and head)."""
    if scales.dtype != np.float32 or scales.ndim != 2:
        raise SnapshotCorruptError(
            f"fp8 scales of {scales.dtype} {scales.shape}", file=file, tensor=tensor
        )
    bad = ~(np.isfinite(scales) & (scales >= MIN_SCALE))
    if bad.any():
        block, head = (int(i) for i in np.argwhere(bad)[0])
        raise SnapshotCorruptError(
            f"fp8 scale of head {head} is {float(scales[block, head]):.6g} (a scale is a finite "
            f"number of at least 2**-126)",
            file=file,
            tensor=tensor,
            block=block,
        )
