"""Per-token norms of one sequence's KV (``kvsnap inspect --plot``), read a bounded step at a
time like every other analysis."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvsnap.analysis.readable import ReadableSnapshot
from kvsnap.analysis.reads import BlockSource, prefetched, token_blocks, tokens_per_step
from kvsnap.analysis.values import compute_dtype, decoder


def token_norms(snapshot: ReadableSnapshot, sequence_id: str) -> dict[str, np.ndarray]:
    """Per part (``key``/``value`` or ``latent``), a float32 ``(num_layers, num_tokens)`` array
    of the L2 norm of each token's KV in each layer (``num_tokens`` may be 0)."""
    geometry = snapshot.geometry
    record = snapshot.sequence(sequence_id)
    count = len(record.token_ids)
    norms = {
        part: np.zeros((geometry.num_layers, count), dtype=np.float32) for part in geometry.parts
    }
    if count == 0:
        return norms
    source = BlockSource(snapshot)
    step_tokens = tokens_per_step(source.token_bytes, source.block_size)
    steps = [
        (layer, part, start, min(count, start + step_tokens))
        for layer in range(geometry.num_layers)
        for part in geometry.parts
        for start in range(0, count, step_tokens)
    ]
    dtype = compute_dtype(geometry.dtype)
    decode = decoder(geometry.dtype, dtype)
    raw = [np.empty((step_tokens // source.block_size + 1) * source.page_bytes, np.uint8)]
    raw.append(np.empty_like(raw[0]))
    values = np.empty(step_tokens * source.heads * source.dim, dtype=dtype)

    def start(step: tuple[int, str, int, int], slot: int) -> Callable[[], None]:
        layer, part, first, stop = step
        blocks = token_blocks(record, source.block_size, first, stop)
        return source.start(f"layers.{layer}.{part}", blocks, raw[slot], slot)

    for number, ((layer, part, first, stop), _) in enumerate(prefetched(steps, start)):
        tokens = stop - first
        decoded = values[: tokens * source.heads * source.dim]
        decode(raw[number % 2][: tokens * source.token_bytes], decoded)
        rows = decoded.reshape(tokens, -1)
        norms[part][layer, first:stop] = np.sqrt(np.einsum("td,td->t", rows, rows))
    return norms
