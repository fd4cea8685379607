"""What determines a synthetic cache: :class:`SyntheticSpec`, validated, and its constants."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvsnap.layout import KVGeometry, dtype_name, torch_dtype

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
