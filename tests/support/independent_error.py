"""The error report's per-tensor measurements (kvsnap/encoding/report.py's TensorError) by their
definitions, in float64 numpy, one loop per block: what the tests check kvsnap's measurements
and recorded reports against, sharing no code with kvsnap/encoding/measure.py."""

from __future__ import annotations

import math

import numpy as np


def numpy_tensor_error(x: np.ndarray, y: np.ndarray, counts: np.ndarray) -> dict[str, float]:
    """The error of ``y`` (decoded) against ``x`` (original), both ``(blocks, tokens, heads,
    dim)``, over the first ``counts[b]`` tokens of each block ``b``: every value counts where
    both are finite; cosines are per (token, head) vector of a nonzero original."""
    x, y = x.astype(np.float64), y.astype(np.float64)
    stored = np.arange(x.shape[1])[None, :] < counts[:, None]
    in_tokens = np.broadcast_to(stored[:, :, None, None], x.shape)
    kept = np.isfinite(x) & np.isfinite(y) & in_tokens
    error = np.where(kept, np.abs(y - x), 0.0)
    xs, ys = np.where(kept, x, 0.0), np.where(kept, y, 0.0)
    relative = []
    for block in range(x.shape[0]):
        top = np.abs(xs[block]).max()
        relative.append(error[block].max() / top if top else float(error[block].max() > 0))
    x_norm, y_norm = np.linalg.norm(xs, axis=-1), np.linalg.norm(ys, axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cosine = np.where(y_norm > 0, (xs * ys).sum(-1) / (x_norm * y_norm), 0.0)[x_norm > 0]
    nonzero = xs != 0
    return {
        "values": kept.sum(),
        "max_abs": error.max(),
        "max_abs_rel_block": max(relative),
        "rms_rel": math.sqrt((error**2).sum() / (xs**2).sum()),
        "min_cosine": cosine.min(),
        "mean_cosine": cosine.mean(),
        "underflow_share": (nonzero & (ys == 0)).sum() / nonzero.sum(),
        "non_finite": (~(np.isfinite(x) & np.isfinite(y)) & in_tokens).sum(),
    }


def held_tokens(block_size: int, num_blocks: int, sequences) -> np.ndarray:
    """How many leading tokens of each snapshot block a sequence holds (the most any holds),
    from each sequence's ``(num_tokens, block_ids)``: docs/format.md, "Only the tokens the
    sequences hold count"."""
    counts = np.zeros(num_blocks, dtype=np.int64)
    for num_tokens, block_ids in sequences:
        for position, block in enumerate(block_ids):
            held = min(block_size, num_tokens - position * block_size)
            counts[block] = max(counts[block], held)
    return counts
