"""Writing a foreign source's sequences as an ordinary kvsnap snapshot.

The blocks are decoded into canonical pages, laid side by side as one contiguous cache per
layer (``kvsnap.contiguous_layout``) and captured with :func:`kvsnap.capture`: the result is a
checksummed, restorable snapshot like any other, comparable with ``verify --against``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kvsnap.dtypes import kv_torch_dtype
from kvsnap.errors import LayoutError
from kvsnap.format import SourceInfo
from kvsnap.layout import CacheLayout, KVGeometry, contiguous_layout, mla_layout
from kvsnap.snapshot import CaptureResult, SequenceBlocks, capture

from .base import ForeignSequence, ForeignSource


def convert_to_snapshot(
    source: ForeignSource,
    output: str | Path,
    *,
    sequences: list[ForeignSequence] | None = None,
    engine: str = "unknown",
    model_id: str = "unknown",
    reproducible: bool = False,
) -> CaptureResult:
    """Write ``sequences`` (default: every sequence ``source`` names) of ``source`` to a
    kvsnap snapshot at ``output``. Each distinct block is decoded and stored once."""
    chosen = source.sequences() if sequences is None else sequences
    chosen = [sequence for sequence in chosen if sequence.block_ids]
    if not chosen:
        raise LayoutError(f"{source.path}: holds no block of the sequences to convert")
    geometry = source.geometry()
    position: dict[str, int] = {}
    for sequence in chosen:
        for block_id in sequence.block_ids:
            position.setdefault(block_id, len(position))
    if geometry.is_mla:
        layout = _mla_cache(source, geometry, position)
    else:
        layout = _contiguous_cache(source, geometry, position)
    blocks = [
        SequenceBlocks(
            sequence.id,
            np.asarray(sequence.token_ids, dtype=np.int64),
            np.asarray([position[b] for b in sequence.block_ids], dtype=np.int64),
        )
        for sequence in chosen
    ]
    info = SourceInfo(engine=engine, engine_version=source.version, model_id=model_id)
    return capture(layout, blocks, output, source=info, reproducible=reproducible)


def _contiguous_cache(
    source: ForeignSource, geometry: KVGeometry, position: dict[str, int]
) -> CacheLayout:
    """The blocks side by side as one ``(1, heads, tokens, head_dim)`` cache per layer."""
    shape = (1, geometry.num_kv_heads, len(position) * geometry.block_size, geometry.head_dim)
    dtype = kv_torch_dtype(geometry.dtype)
    keys = [torch.empty(shape, dtype=dtype) for _ in range(geometry.num_layers)]
    values = [torch.empty(shape, dtype=dtype) for _ in range(geometry.num_layers)]
    for block_id, index in position.items():
        block = source.read_block(block_id)
        tokens = slice(index * geometry.block_size, (index + 1) * geometry.block_size)
        for layer in range(geometry.num_layers):
            # Canonical (tokens, heads, dim) pages into the (batch, heads, seq, dim) cache.
            keys[layer][0, :, tokens] = block.keys[layer].transpose(0, 1)
            values[layer][0, :, tokens] = block.values[layer].transpose(0, 1)
    return contiguous_layout(keys, values, block_size=geometry.block_size)


def _mla_cache(
    source: ForeignSource, geometry: KVGeometry, position: dict[str, int]
) -> CacheLayout:
    """The blocks' latents as one ``(blocks, block_size, latent_dim)`` MLA cache per layer."""
    shape = (len(position), geometry.block_size, geometry.latent_dim)
    dtype = kv_torch_dtype(geometry.dtype)
    latents = [torch.empty(shape, dtype=dtype) for _ in range(geometry.num_layers)]
    for block_id, index in position.items():
        block = source.read_block(block_id)
        for layer in range(geometry.num_layers):
            latents[layer][index] = block.keys[layer]
    return mla_layout(latents)
