"""A filled engine cache of a spec (:func:`build_cache`) and its reproducible snapshot
(:func:`generate`, :func:`write_spec`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvsnap import format as fmt
from kvsnap.layout import CacheLayout, canonical_name, torch_dtype
from kvsnap.layout.allocate import allocate_cache
from kvsnap.snapshot import CaptureResult, SequenceBlocks, capture
from kvsnap.testing.synthetic.spec import (
    DEFAULT_VOCAB_SIZE,
    GENERATOR_VERSION,
    SYNTHETIC_ENGINE,
    SYNTHETIC_MODEL_ID,
    SyntheticSpec,
    make_spec,
)
from kvsnap.testing.synthetic.values import Synthesizer


@dataclass(frozen=True)
class SyntheticCache:
    """A filled engine cache: its layout (real tensors) and the sequences it holds."""

    spec: SyntheticSpec
    layout: CacheLayout
    sequences: list[SequenceBlocks]
    page_views: dict[str, torch.Tensor] = field(repr=False)


#: The cache kind of :func:`kvsnap.layout.allocate.allocate_cache` for each fixture layout name.
_CACHE_KINDS = {
    "vllm-split-nhd": "vllm-nhd",
    "vllm-split-hnd": "vllm-hnd",
    "legacy": "vllm-legacy",
    "packed": "packed",
    "cross-layer": "cross-layer",
    "flat-paged": "flat-paged",
    "mla": "mla",
}


def _allocate(spec: SyntheticSpec, num_blocks: int) -> tuple[CacheLayout, dict[str, torch.Tensor]]:
    """A zeroed CPU cache of ``spec.layout`` and, per canonical tensor name, its logical page
    view ``(num_blocks, block_size, heads, head_dim)`` (MLA: ``(..., latent_dim)``)."""
    cache = allocate_cache(
        _CACHE_KINDS[spec.layout],
        num_layers=spec.num_layers,
        num_blocks=num_blocks,
        block_size=spec.block_size,
        num_kv_heads=spec.num_kv_heads or 0,
        head_dim=spec.head_dim or 0,
        latent_dim=spec.latent_dim or 0,
        dtype=torch_dtype(spec.dtype),
        attention_types=spec.attention_types,
    )
    return cache.layout, cache.views


def build_cache(spec: SyntheticSpec) -> SyntheticCache:
    """A real CPU cache of ``spec.layout`` filled with the synthetic KV of ``spec``.

    Each sequence's tokens sit in its blocks (``block_ids[t // block_size]``, slot
    ``t % block_size``); the rest of its last block is zero and spare blocks are NaN.
    """
    synthesizer = Synthesizer(spec)
    layout, views = _allocate(spec, synthesizer.num_cache_blocks)
    spare = torch.from_numpy(synthesizer.spare_block_ids)
    for view in views.values():
        view[spare] = float("nan")
    block_size = spec.block_size
    for span, layer, parts in synthesizer.span_kv():
        positions = torch.arange(span.start, span.stop)
        for index in span.sequence_indices:
            blocks = torch.from_numpy(synthesizer.block_ids[index])[positions // block_size]
            for part, values in parts.items():
                views[canonical_name(layer, part)][blocks, positions % block_size] = values
    sequences = [
        SequenceBlocks(
            id=sequence_id,
            token_ids=synthesizer.token_ids[index],
            block_ids=synthesizer.block_ids[index],
        )
        for index, sequence_id in enumerate(spec.sequence_ids)
    ]
    return SyntheticCache(spec=spec, layout=layout, sequences=sequences, page_views=views)


def source_info(spec: SyntheticSpec) -> fmt.SourceInfo:
    """The :class:`kvsnap.format.SourceInfo` recorded for ``spec``: nothing time- or host-bound."""
    return fmt.SourceInfo(
        engine=SYNTHETIC_ENGINE,
        engine_version=str(GENERATOR_VERSION),
        model_id=SYNTHETIC_MODEL_ID,
        model_revision=None,
        model_fingerprint=fmt.model_fingerprint(spec.model_config()),
    )


def generate(
    path: str | Path,
    *,
    num_layers: int,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    block_size: int,
    dtype: str | torch.dtype,
    sequence_lengths: Sequence[int],
    attention: str = "full",
    latent_dim: int | None = None,
    layout: str | None = None,
    seed: int = 0,
    shared_prefix_tokens: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> CaptureResult:
    """Write a reproducible snapshot of a synthetic KV cache to ``path``; return the CaptureResult.

    Builds a CPU cache of ``layout`` (default: ``"mla"`` for ``attention="mla"``, else
    ``"vllm-split-nhd"``) with :func:`build_cache` and writes it with
    ``kvsnap.snapshot.capture(..., reproducible=True)``. Standard attention needs
    ``num_kv_heads`` and an even ``head_dim``; MLA needs ``latent_dim`` instead. The same
    arguments give the same bytes on every machine. Raises ``ValueError`` for invalid arguments.
    """
    spec = make_spec(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        sequence_lengths=sequence_lengths,
        attention=attention,
        latent_dim=latent_dim,
        layout=layout,
        seed=seed,
        shared_prefix_tokens=shared_prefix_tokens,
        vocab_size=vocab_size,
    )
    return write_spec(spec, path)


def write_spec(spec: SyntheticSpec, path: str | Path) -> CaptureResult:
    """:func:`generate` for an already built :class:`SyntheticSpec`."""
    cache = build_cache(spec)
    return capture(
        cache.layout,
        cache.sequences,
        path,
        source=source_info(spec),
        reproducible=True,
    )
