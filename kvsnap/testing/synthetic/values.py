"""The synthetic values: RoPE'd keys with outlier channels, plain values, MLA latents.

Every random number comes from one ``torch.Generator`` on the CPU seeded with the spec's seed,
drawn in the fixed order :class:`Synthesizer` documents, computed in float64 and cast to the KV
dtype only at the end.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from kvsnap.layout import KEY, LATENT, VALUE, canonical_name, torch_dtype
from kvsnap.testing.synthetic.spec import (
    OUTLIER_MAGNITUDE,
    ROPE_BASE,
    VALUE_STD,
    SyntheticSpec,
)

_F64 = torch.float64


def apply_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    *,
    base: float = ROPE_BASE,
    interleaved: bool = False,
) -> torch.Tensor:
    """Rotate ``x`` (``(tokens, ..., dim)``, float64) by the rotary embedding at ``positions``.

    Pair ``i`` (of ``dim // 2``) turns by ``position * base ** (-2i / dim)``. Pairs are
    ``(i, i + dim/2)`` (rotate-half, Llama/NeoX) or, with ``interleaved``, ``(2i, 2i + 1)``
    (GPT-J, DeepSeek's MLA). Returns a new float64 tensor of ``x``'s shape.
    """
    dim = x.shape[-1]
    if dim % 2:
        raise ValueError(f"RoPE needs an even dimension, got {dim}")
    inv_freq = torch.pow(torch.tensor(base, dtype=_F64), -torch.arange(0, dim, 2, dtype=_F64) / dim)
    angles = positions.to(_F64)[:, None] * inv_freq[None, :]  # (tokens, dim/2)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (dim // 2,)
    cos, sin = angles.cos().reshape(shape), angles.sin().reshape(shape)
    if interleaved:
        first, second = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack((first * cos - second * sin, second * cos + first * sin), dim=-1)
        return rotated.flatten(-2)
    first, second = x[..., : dim // 2], x[..., dim // 2 :]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


@dataclass(frozen=True)
class _ChannelStructure:
    """Per channel mean and scale of a layer's keys ``(heads, dim)`` or MLA part ``(1, dim)``."""

    mean: torch.Tensor
    scale: torch.Tensor


def _draw_channels(
    generator: torch.Generator,
    shape: tuple[int, ...],
    outlier_candidates: torch.Tensor,
    num_outliers: int,
    pair_offset: int,
) -> _ChannelStructure:
    """Channel means and scales of shape ``(rows, dim)``.

    Scales are U(0.5, 1.5) and means N(0, 0.1²); then per row ``num_outliers`` channels picked
    among ``outlier_candidates`` (and their RoPE partners ``pair_offset`` further, when nonzero)
    get means of magnitude in :data:`OUTLIER_MAGNITUDE` with a random sign, and double scale.
    """
    rows = shape[0]
    scale = 0.5 + torch.rand(shape, generator=generator, dtype=_F64)
    mean = 0.1 * torch.randn(shape, generator=generator, dtype=_F64)
    # Pick per row a random subset of the candidates: argsort of uniform keys is a permutation.
    keys = torch.rand((rows, len(outlier_candidates)), generator=generator, dtype=_F64)
    chosen = outlier_candidates[keys.argsort(dim=1)[:, :num_outliers]]  # (rows, num_outliers)
    signs = torch.randint(0, 2, (rows, num_outliers), generator=generator).to(_F64) * 2 - 1
    low, high = OUTLIER_MAGNITUDE
    magnitude = low + (high - low) * torch.rand(
        (rows, num_outliers), generator=generator, dtype=_F64
    )
    row_index = torch.arange(rows)[:, None].expand_as(chosen)
    channels = [chosen, chosen + pair_offset] if pair_offset else [chosen]
    for channel in channels:
        mean[row_index, channel] = signs * magnitude
        scale[row_index, channel] *= 2.0
    return _ChannelStructure(mean, scale)


@dataclass(frozen=True)
class _Span:
    """Consecutive token positions ``start..stop`` shared by ``sequence_indices``."""

    sequence_indices: tuple[int, ...]
    start: int
    stop: int


class Synthesizer:
    """Draws everything for one spec, in the fixed order documented in docs/fixtures.md."""

    def __init__(self, spec: SyntheticSpec) -> None:
        self.spec = spec
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(spec.seed)
        self.dtype = torch_dtype(spec.dtype)
        # 1. token ids: the shared prefix, then each sequence's own tokens.
        prefix_len = spec.shared_prefix_tokens
        prefix = self._tokens(prefix_len)
        self.token_ids = [
            np.concatenate((prefix, self._tokens(length - prefix_len)))
            for length in spec.sequence_lengths
        ]
        # 2. physical block ids: shared full prefix blocks, then each sequence's own; spares last.
        block_size = spec.block_size
        shared_blocks = prefix_len // block_size
        own_blocks = [
            math.ceil(length / block_size) - shared_blocks for length in spec.sequence_lengths
        ]
        used = shared_blocks + sum(own_blocks)
        self.num_cache_blocks = used + max(1, used // 4)
        permutation = (
            torch.randperm(self.num_cache_blocks, generator=self.generator).numpy().astype(np.int64)
        )
        shared = permutation[:shared_blocks]
        offsets = np.cumsum([shared_blocks, *own_blocks])
        self.block_ids = [
            np.concatenate((shared, permutation[offsets[index] : offsets[index + 1]]))
            for index in range(len(own_blocks))
        ]
        self.spare_block_ids = permutation[used:]
        # 3. per-layer channel structure.
        self.structures = [self._layer_structure() for _ in range(spec.num_layers)]
        # 4. noise per span and layer: the shared prefix once, then each sequence's own tokens.
        all_sequences = tuple(range(len(spec.sequence_lengths)))
        self.spans = [_Span(all_sequences, 0, prefix_len)] if prefix_len else []
        self.spans += [
            _Span((index,), prefix_len, length)
            for index, length in enumerate(spec.sequence_lengths)
            if length > prefix_len
        ]

    def _tokens(self, count: int) -> np.ndarray:
        ids = torch.randint(
            0, self.spec.vocab_size, (count,), generator=self.generator, dtype=torch.int64
        )
        return ids.numpy()

    def _layer_structure(self) -> tuple[_ChannelStructure, ...]:
        spec = self.spec
        if spec.is_mla:
            compressed = spec.latent_dim - spec.rope_dim
            latent = _draw_channels(
                self.generator,
                (1, compressed),
                torch.arange(compressed),
                max(1, compressed // 64),
                pair_offset=0,
            )
            rope_pairs = spec.rope_dim // 2
            # Interleaved pairs (2i, 2i+1): outliers on the lowest-frequency quarter of the pairs.
            candidates = 2 * torch.arange(rope_pairs - max(1, rope_pairs // 4), rope_pairs)
            rope = _draw_channels(self.generator, (1, spec.rope_dim), candidates, 1, pair_offset=1)
            return (latent, rope)
        pairs = spec.head_dim // 2
        # Rotate-half pairs (i, i + dim/2); low frequencies are the highest i.
        candidates = torch.arange(pairs - max(1, pairs // 4), pairs)
        keys = _draw_channels(
            self.generator,
            (spec.num_kv_heads, spec.head_dim),
            candidates,
            max(1, pairs // 16),
            pair_offset=pairs,
        )
        return (keys,)

    def span_kv(self) -> Iterator[tuple[_Span, int, dict[str, torch.Tensor]]]:
        """Per span, per layer: ``(span, layer, {part: (tokens, ...) tensor in the KV dtype})``."""
        spec = self.spec
        for span in self.spans:
            positions = torch.arange(span.start, span.stop, dtype=torch.int64)
            count = span.stop - span.start
            for layer in range(spec.num_layers):
                structure = self.structures[layer]
                if spec.is_mla:
                    noise = torch.randn(
                        (count, spec.latent_dim), generator=self.generator, dtype=_F64
                    )
                    latent_structure, rope_structure = structure
                    compressed = spec.latent_dim - spec.rope_dim
                    latent = (
                        latent_structure.mean[0] + latent_structure.scale[0] * noise[:, :compressed]
                    )
                    rope = rope_structure.mean[0] + rope_structure.scale[0] * noise[:, compressed:]
                    rope = apply_rope(rope, positions, interleaved=True)
                    parts = {LATENT: torch.cat((latent, rope), dim=-1)}
                else:
                    noise = torch.randn(
                        (2, count, spec.num_kv_heads, spec.head_dim),
                        generator=self.generator,
                        dtype=_F64,
                    )
                    (key_structure,) = structure
                    keys = apply_rope(
                        key_structure.mean + key_structure.scale * noise[0], positions
                    )
                    parts = {KEY: keys, VALUE: VALUE_STD * noise[1]}
                yield span, layer, {part: values.to(self.dtype) for part, values in parts.items()}


@dataclass(frozen=True)
class SyntheticSequence:
    """One synthetic sequence: its token ids, physical block ids and per-token KV.

    ``kv[name]`` is ``(num_tokens, num_kv_heads, head_dim)`` (``(num_tokens, latent_dim)`` for
    MLA) in the spec's dtype, for every canonical tensor name ``layers.{i}.{part}``.
    """

    id: str
    token_ids: np.ndarray
    block_ids: np.ndarray
    kv: dict[str, torch.Tensor] = field(repr=False)


def synthesize(spec: SyntheticSpec) -> list[SyntheticSequence]:
    """The synthetic sequences of ``spec`` with all their KV, as :func:`generate` writes them."""
    synthesizer = Synthesizer(spec)
    pieces: list[dict[str, list[torch.Tensor]]] = [{} for _ in spec.sequence_lengths]
    for span, layer, parts in synthesizer.span_kv():
        for part, values in parts.items():
            for index in span.sequence_indices:
                pieces[index].setdefault(canonical_name(layer, part), []).append(values)
    return [
        SyntheticSequence(
            id=sequence_id,
            token_ids=synthesizer.token_ids[index],
            block_ids=synthesizer.block_ids[index],
            kv={name: torch.cat(chunks) for name, chunks in pieces[index].items()},
        )
        for index, sequence_id in enumerate(spec.sequence_ids)
    ]
