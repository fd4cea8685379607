"""The result of comparing two snapshots' KV: :class:`Comparison`, what it is made of, and its
JSON form. :mod:`kvsnap.analysis.diff` computes one; :mod:`kvsnap.analysis.report` writes it
for people.

Every number is over the tokens both snapshots hold, in the wider of their dtypes. A (token,
head) *vector* is one head's ``head_dim`` values of one token (an MLA token's latent is one
vector): its *relative error* is ``|a - b| / max(|a|, |b|)`` (L2 norms; 0 when both are
zero, at most 2) and its *cosine* ``a . b / (|a| |b|)`` (1 when both are zero, 0 when one is).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvsnap import format as fmt
from kvsnap.analysis.report import report_lines


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


@dataclass(frozen=True)
class Comparison:
    """What :func:`kvsnap.analysis.compare` found: ``ok`` when both snapshots hold the same
    sequences (ids, token ids, lengths) and no element is beyond the tolerance.

    ``sources`` are how the snapshots' origins differ (model fingerprint, engine, dtype, block
    size: stated up front, not failures); ``problems`` the structural differences, each stated
    once; ``notes`` what is worth knowing without being a difference; ``layers`` the numbers
    per tensor; ``top`` the largest element differences over every tensor, largest first;
    ``profile`` one sequence's per-token errors when asked for (``kvsnap diff --plot``).
    """

    ok: bool
    layers: list[LayerDifference]
    problems: list[fmt.Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    sources: list[SourceDifference] = field(default_factory=list)
    top: list[Location] = field(default_factory=list)
    atol: float = 0.0
    rtol: float = 0.0
    paths: tuple[str, str] = ("", "")
    profile: DiffProfile | None = None

    def first_mismatch(self) -> LayerDifference | None:
        """The first tensor (in snapshot order) with an element beyond the tolerance."""
        return next((layer for layer in self.layers if layer.num_mismatches), None)

    def first_divergent_layer(self) -> int | None:
        """The first layer any of whose tensors has an element beyond the tolerance."""
        first = self.first_mismatch()
        return None if first is None else first.layer

    def layer_errors(self) -> list[tuple[int, float, float]]:
        """Per layer: its index, the largest difference and the largest mean vector relative
        error of its tensors: how an error grows (or fades) through the layers."""
        by_layer: dict[int, tuple[float, float]] = {}
        for layer in self.layers:
            diff, rel = by_layer.get(layer.layer, (0.0, 0.0))
            by_layer[layer.layer] = (
                max(diff, layer.max_abs_diff),
                max(rel, layer.rel_error_mean),
            )
        return [(index, diff, rel) for index, (diff, rel) in sorted(by_layer.items())]

    def report(self, top: int = 10) -> str:
        """The report ``kvsnap diff`` prints (:func:`kvsnap.analysis.report.report_lines`),
        with the ``top`` largest differences."""
        return "\n".join(report_lines(self, top=top))

    def to_dict(self) -> dict[str, Any]:
        """Every number of the comparison as JSON-ready values (``kvsnap diff --json``; a
        number that is not finite, which strict JSON cannot hold, as ``None``)."""
        return _finite(self._fields())

    def _fields(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "a": self.paths[0],
            "b": self.paths[1],
            "atol": self.atol,
            "rtol": self.rtol,
            "sources": [asdict(difference) for difference in self.sources],
            "notes": list(self.notes),
            "problems": [
                {"tensor": p.tensor, "block": p.block, "message": p.message} for p in self.problems
            ],
            "first_divergent_layer": self.first_divergent_layer(),
            "layer_errors": [
                {"layer": index, "max_abs_diff": diff, "rel_error_mean": rel}
                for index, diff, rel in self.layer_errors()
            ],
            "layers": [layer.to_dict() for layer in self.layers],
            "top": [location.to_dict() for location in self.top],
        }


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by ``None``, recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value
