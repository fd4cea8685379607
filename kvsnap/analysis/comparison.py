"""The result of comparing two snapshots' KV: :class:`Comparison` (made of the records of
:mod:`kvsnap.analysis.differences`) and its JSON form. :mod:`kvsnap.analysis.diff` computes
one; :mod:`kvsnap.analysis.report` writes it for people.

Every number is over the tokens both snapshots hold, in the wider of their dtypes. A (token,
head) *vector* is one head's ``head_dim`` values of one token (an MLA token's latent is one
vector): its *relative error* is ``|a - b| / max(|a|, |b|)`` (L2 norms; 0 when both are
zero, at most 2) and its *cosine* ``a . b / (|a| |b|)`` (1 when both are zero, 0 when one is).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from kvsnap import format as fmt
from kvsnap.analysis.differences import (
    DiffProfile,
    HeadDifference,
    LayerDifference,
    Location,
    NonFinite,
    SourceDifference,
    VectorLocation,
)
from kvsnap.analysis.report import report_lines

# The records a Comparison is made of live in differences.py (the report reads them without
# the Comparison); they are named here too, where they were defined before.
__all__ = [
    "Comparison",
    "DiffProfile",
    "HeadDifference",
    "LayerDifference",
    "Location",
    "NonFinite",
    "SourceDifference",
    "VectorLocation",
]


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
