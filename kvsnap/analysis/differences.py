"""The records a :class:`~kvsnap.analysis.comparison.Comparison` is made of: where a
difference is (:class:`Location`, :class:`VectorLocation`), NaN and Inf (:class:`NonFinite`),
per head and per tensor (:class:`HeadDifference`, :class:`LayerDifference`), how the origins
differ (:class:`SourceDifference`) and one sequence's per-token errors (:class:`DiffProfile`).
Each holds its own numbers and their JSON form; see :mod:`kvsnap.analysis.comparison` for what
a vector's relative error and cosine are."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Location:
    """One element: its tensor, sequence, token, head and channel, and both values."""

    tensor: str
    sequence: str
    token: int
    head: int
    channel: int
    a: float
    b: float

    @property
    def abs_diff(self) -> float:
        """``|a - b|``."""
        return abs(self.a - self.b)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "abs_diff": self.abs_diff}


@dataclass(frozen=True)
class VectorLocation:
    """One (token, head) vector of one sequence, and the value found there."""

    sequence: str
    token: int
    head: int
    value: float


@dataclass(frozen=True)
class NonFinite:
    """NaN and Inf met in one tensor: counts per snapshot, the elements where they make the
    snapshots differ (``mismatches``: NaN on one side only, or Inf against another value) and
    those where both hold the same NaN or Inf (``both``: not a difference, but never silently
    equal: the report names them). ``vectors`` (token, head) holding any are left out of the
    relative errors and cosines."""

    nan_a: int = 0
    nan_b: int = 0
    inf_a: int = 0
    inf_b: int = 0
    mismatches: int = 0
    both: int = 0
    vectors: int = 0

    @property
    def any(self) -> bool:
        return bool(self.nan_a or self.nan_b or self.inf_a or self.inf_b)


@dataclass(frozen=True)
class HeadDifference:
    """One KV head of one tensor: the largest difference, the elements beyond the tolerance,
    its vectors' relative errors and cosines, and the channels carrying the largest
    differences (``top_channels``: up to 4 ``(channel, max |diff|)``, largest first)."""

    head: int
    max_abs_diff: float
    num_mismatches: int
    num_elements: int
    rel_error_mean: float
    rel_error_max: float
    cosine_mean: float
    cosine_min: float
    top_channels: tuple[tuple[int, float], ...] = ()

    @property
    def share(self) -> float:
        """The share of this head's elements beyond the tolerance."""
        return self.num_mismatches / self.num_elements if self.num_elements else 0.0


@dataclass(frozen=True)
class LayerDifference:
    """One tensor (a layer's key, value or MLA latent) compared over the tokens both hold.

    ``max_abs_diff`` is the largest finite ``|a - b|`` (``max_at`` says where);
    ``num_mismatches`` counts elements beyond ``atol + rtol * |b|`` and those NaN or Inf on one
    side only (``first_mismatch``: the first in sequence, token, head, channel order);
    ``rms_diff`` is the root mean square difference; the relative errors and cosines are over
    (token, head) vectors (module docstring); ``heads`` breaks it down per KV head."""

    tensor: str
    max_abs_diff: float
    num_mismatches: int
    first_mismatch: dict[str, Any] | None  # {"sequence", "token", "head", "channel"}
    num_elements: int = 0
    max_at: Location | None = None
    rms_diff: float = 0.0
    num_vectors: int = 0
    rel_error_mean: float = 0.0
    rel_error_max: float = 0.0
    rel_error_max_at: VectorLocation | None = None
    cosine_mean: float = 1.0
    cosine_min: float = 1.0
    cosine_min_at: VectorLocation | None = None
    heads: tuple[HeadDifference, ...] = ()
    nonfinite: NonFinite = field(default_factory=NonFinite)

    @property
    def layer(self) -> int:
        """The layer index from the tensor name ``layers.{i}.{part}``."""
        return int(self.tensor.split(".")[1])

    @property
    def part(self) -> str:
        """``key``, ``value`` or ``latent``."""
        return self.tensor.rsplit(".", 1)[1]

    @property
    def share(self) -> float:
        """The share of elements beyond the tolerance (NaN/Inf mismatches included)."""
        return self.num_mismatches / self.num_elements if self.num_elements else 0.0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["max_at"] = self.max_at.to_dict() if self.max_at else None
        data["heads"] = [{**asdict(head), "share": head.share} for head in self.heads]
        return {"layer": self.layer, "part": self.part, **data, "share": self.share}


@dataclass(frozen=True)
class SourceDifference:
    """A way the two snapshots' origins differ (model fingerprint, engine, dtype, ...)."""

    field: str
    a: str
    b: str


@dataclass(frozen=True)
class DiffProfile:
    """Per-token relative errors of one sequence pair, for a picture: per part an array
    ``(num_layers, bins, heads)`` of the largest vector relative error of each bin of tokens
    (NaN where a vector of the bin holds NaN or Inf); bin ``i`` starts at token
    ``bin_starts[i]``."""

    sequence: str
    num_tokens: int
    bin_starts: np.ndarray
    values: dict[str, np.ndarray]
