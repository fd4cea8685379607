"""Deterministic synthetic KV caches and the reproducible snapshots written from them.

:func:`generate` builds a real CPU cache of any layout kvsnap supports (through the
:mod:`kvsnap.layout` constructors), fills it with synthetic KV and writes it with
:func:`kvsnap.snapshot.capture` — the real capture path — with ``reproducible=True``. For the same
arguments the file is byte-identical on every machine: every random number comes from one
``torch.Generator`` on the CPU seeded with ``seed``, drawn in a fixed order, computed in float64
and cast to the KV dtype only at the end.

What the values model (see docs/fixtures.md):

* **keys**: per (layer, head, channel) a mean and a scale, a few large-magnitude outlier channel
  pairs per head among the lowest-frequency rotary pairs (where real models' key outliers sit),
  then the rotary embedding (base 10000, rotate-half pairing as in Llama/NeoX) at the token's
  absolute position;
* **values**: N(0, 0.5²), no structure;
* **MLA latents**: a compressed part with per-channel scales and a few outlier channels, followed
  by a rotary part (the last ``latent_dim // 9`` dims, rounded down to even, at least 2;
  576 → 512 + 64 as in DeepSeek-V3) with interleaved-pair RoPE as DeepSeek uses;
* **tokens**: uniform ids in ``[0, vocab_size)``; with ``shared_prefix_tokens`` every sequence
  starts with the same tokens *and the same KV* for them, and the full blocks of that prefix are
  one set of physical blocks shared by all sequences (as with vLLM's prefix caching), so
  capture's prefix deduplication stores them once;
* **the cache**: physical block ids are a random permutation, with spare blocks (not part of any
  sequence) filled with NaN, so a capture that reads a wrong block shows up; token slots after a
  sequence's end in its last block are zero.

Attention type ``"sliding"`` alternates sliding-window and full layers (sliding first, as in
Gemma 2); the type is recorded per layer in the snapshot and does not change the values.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvsnap import format as fmt
from kvsnap.layout import (
    KEY,
    LATENT,
    VALUE,
    CacheLayout,
    KVGeometry,
    canonical_name,
    dtype_name,
    torch_dtype,
)
from kvsnap.snapshot import CaptureResult, SequenceBlocks, capture
from kvsnap.testing.caches import make_cache

#: Bumped whenever the values drawn for given arguments change; committed fixtures then need
#: regenerating (scripts/make_fixtures.py) and the change is visible in review.
GENERATOR_VERSION = 1
#: Rotary embedding base (the standard Llama value).
ROPE_BASE = 10000.0
#: Standard deviation of synthetic values.
VALUE_STD = 0.5
#: Range of the magnitude of key outlier channels' means (a random sign is applied).
OUTLIER_MAGNITUDE = (6.0, 12.0)
#: Default vocabulary size of the synthetic token ids.
DEFAULT_VOCAB_SIZE = 32000

#: Cache layouts :func:`generate` can build, by the name of the engine encoding.
LAYOUTS = (
    "vllm-split-nhd",
    "vllm-split-hnd",
    "packed",
    "mla",
    "flat-paged",
    "cross-layer",
    "legacy",
)
#: Attention types :func:`generate` can model.
ATTENTIONS = ("full", "sliding", "mla")

#: ``source.engine`` and ``source.model_id`` recorded in synthetic snapshots.
SYNTHETIC_ENGINE = "kvsnap-synthetic"
SYNTHETIC_MODEL_ID = "kvsnap/synthetic"

_F64 = torch.float64
# Host staging used by generate(): synthetic caches are small; 256 MiB default staging is waste.


@dataclass(frozen=True)
class SyntheticSpec:
    """Everything that determines a synthetic cache and its snapshot, validated.

    ``num_kv_heads``/``head_dim`` are for standard attention, ``latent_dim`` for MLA (the other
    ones stay 0). ``layout`` ``None`` picks ``"mla"`` for MLA and ``"vllm-split-nhd"`` otherwise.
    """

    num_layers: int
    block_size: int
    dtype: str
    sequence_lengths: tuple[int, ...]
    num_kv_heads: int = 0
    head_dim: int = 0
    latent_dim: int = 0
    attention: str = "full"
    layout: str | None = None
    seed: int = 0
    shared_prefix_tokens: int = 0
    vocab_size: int = DEFAULT_VOCAB_SIZE

    def __post_init__(self) -> None:
        if self.attention not in ATTENTIONS:
            raise ValueError(
                f"attention must be one of {', '.join(ATTENTIONS)}, got {self.attention!r}"
            )
        is_mla = self.attention == "mla"
        layout = self.layout if self.layout is not None else ("mla" if is_mla else "vllm-split-nhd")
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "sequence_lengths", tuple(int(n) for n in self.sequence_lengths))
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        if is_mla != (layout == "mla"):
            raise ValueError(
                f"layout {layout!r} does not hold attention {self.attention!r}: "
                "MLA caches use layout 'mla'"
            )
        if is_mla:
            if self.latent_dim < 4:
                raise ValueError(f"attention 'mla' needs latent_dim >= 4, got {self.latent_dim}")
            if self.num_kv_heads or self.head_dim:
                raise ValueError("attention 'mla' takes latent_dim, not num_kv_heads/head_dim")
        else:
            if self.latent_dim:
                raise ValueError(f"latent_dim is for attention 'mla', not {self.attention!r}")
            if self.num_kv_heads < 1 or self.head_dim < 2 or self.head_dim % 2:
                raise ValueError(
                    f"need num_kv_heads >= 1 and an even head_dim >= 2 (RoPE rotates pairs), "
                    f"got {self.num_kv_heads} and {self.head_dim}"
                )
        if self.num_layers < 1 or self.block_size < 1:
            raise ValueError(
                "num_layers and block_size must be positive, "
                f"got {self.num_layers}, {self.block_size}"
            )
        if not torch_dtype(self.dtype).is_floating_point:
            raise ValueError(f"synthetic KV needs a floating-point dtype, got {self.dtype!r}")
        if not self.sequence_lengths or min(self.sequence_lengths) < 1:
            raise ValueError(
                f"need at least one sequence, each with at least one token: {self.sequence_lengths}"
            )
        if not 0 <= self.shared_prefix_tokens <= min(self.sequence_lengths):
            raise ValueError(
                f"shared_prefix_tokens {self.shared_prefix_tokens} must lie in "
                f"0..{min(self.sequence_lengths)} (the shortest sequence)"
            )
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must lie in 0..2**63-1, got {self.seed}")

    @property
    def is_mla(self) -> bool:
        return self.attention == "mla"

    @property
    def attention_types(self) -> tuple[str, ...]:
        """Per layer attention type recorded in the snapshot."""
        if self.attention == "sliding":
            return tuple(
                "sliding" if layer % 2 == 0 else "full" for layer in range(self.num_layers)
            )
        return (self.attention,) * self.num_layers

    @property
    def rope_dim(self) -> int:
        """Dims the rotary embedding covers: ``head_dim``, or the MLA latent's rotary tail."""
        if not self.is_mla:
            return self.head_dim
        return max(2, self.latent_dim // 9 // 2 * 2)

    @property
    def sequence_ids(self) -> tuple[str, ...]:
        return tuple(f"seq-{index}" for index in range(len(self.sequence_lengths)))

    def geometry(self) -> KVGeometry:
        """The snapshot geometry of this cache."""
        return KVGeometry(
            num_layers=self.num_layers,
            block_size=self.block_size,
            dtype=self.dtype,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            latent_dim=self.latent_dim,
            attention_types=self.attention_types,
        )

    def model_config(self) -> dict[str, Any]:
        """The "model" these values come from: what the values depend on, minus the cache layout.

        Its fingerprint (:func:`kvsnap.format.model_fingerprint`) is the snapshot's model
        fingerprint, so snapshots of the same synthetic model in different layouts restore into
        each other and ones from another seed are refused.
        """
        return {
            "generator": SYNTHETIC_MODEL_ID,
            "generator_version": GENERATOR_VERSION,
            "seed": self.seed,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "latent_dim": self.latent_dim,
            "attention_types": list(self.attention_types),
            "vocab_size": self.vocab_size,
            "rope_base": ROPE_BASE,
        }

    def arguments(self) -> dict[str, Any]:
        """The keyword arguments of :func:`generate` that reproduce this spec (JSON-friendly)."""
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads or None,
            "head_dim": self.head_dim or None,
            "block_size": self.block_size,
            "dtype": self.dtype,
            "sequence_lengths": list(self.sequence_lengths),
            "attention": self.attention,
            "latent_dim": self.latent_dim or None,
            "layout": self.layout,
            "seed": self.seed,
            "shared_prefix_tokens": self.shared_prefix_tokens,
            "vocab_size": self.vocab_size,
        }


def make_spec(
    *,
    num_layers: int,
    block_size: int,
    dtype: str | torch.dtype,
    sequence_lengths: Sequence[int],
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    attention: str = "full",
    latent_dim: int | None = None,
    layout: str | None = None,
    seed: int = 0,
    shared_prefix_tokens: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> SyntheticSpec:
    """A validated :class:`SyntheticSpec` from :func:`generate`'s keyword arguments."""
    return SyntheticSpec(
        num_layers=num_layers,
        block_size=block_size,
        dtype=dtype if isinstance(dtype, str) else dtype_name(dtype),
        sequence_lengths=tuple(sequence_lengths),
        num_kv_heads=num_kv_heads or 0,
        head_dim=head_dim or 0,
        latent_dim=latent_dim or 0,
        attention=attention,
        layout=layout,
        seed=seed,
        shared_prefix_tokens=shared_prefix_tokens,
        vocab_size=vocab_size,
    )


# --------------------------------------------------------------------------------------------
# Values


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


class _Synthesizer:
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


# --------------------------------------------------------------------------------------------
# Public API


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
    synthesizer = _Synthesizer(spec)
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


@dataclass(frozen=True)
class SyntheticCache:
    """A filled engine cache: its layout (real tensors) and the sequences it holds."""

    spec: SyntheticSpec
    layout: CacheLayout
    sequences: list[SequenceBlocks]
    page_views: dict[str, torch.Tensor] = field(repr=False)


#: The cache kind of :func:`kvsnap.testing.caches.make_cache` for each fixture layout name.
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
    cache = make_cache(
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
    synthesizer = _Synthesizer(spec)
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
