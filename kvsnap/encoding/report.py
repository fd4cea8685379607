"""The error an encoding introduced, written down: per layer tensor and per layer's attention.

An :class:`ErrorReport` is what a lossy snapshot carries in its metadata (and what ``verify
--against`` measures again from two files): one :class:`TensorError` per layer tensor and one
:class:`AttentionError` per layer, each a handful of numbers (:mod:`kvsnap.encoding.measure`
computes them). It serialises to a small JSON object (:meth:`ErrorReport.to_dict`) and reads
back strictly (:meth:`ErrorReport.from_dict`): a report with a missing, unknown, mistyped or
non-finite field is refused whole, with the field named.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: How queries of the attention check are made (docs/format.md, "The error report").
QUERY_SOURCES = ("keys", "gaussian")


@dataclass(frozen=True)
class TensorError:
    """The error of one layer tensor (``layers.3.key``) over its ``values`` finite elements
    (docs/format.md, "Encoded snapshots", gives each figure's value in the corner cases).

    * ``max_abs``: the largest ``|decoded - original|``;
    * ``max_abs_rel_block``: the largest, over blocks, of a block's ``max_abs`` divided by the
      block's largest ``|original|``;
    * ``rms_rel``: ``||decoded - original|| / ||original||`` over the whole tensor;
    * ``min_cosine`` / ``mean_cosine``: cosine similarity of each (token, head) vector of
      ``head_dim`` with its original (vectors whose original is zero are left out);
    * ``underflow_share``: of the non-zero originals, the share decoded as zero;
    * ``non_finite``: elements where the original or the decoded value is NaN or infinite
      (left out of everything above): every other number is finite.
    """

    tensor: str
    values: int
    max_abs: float
    max_abs_rel_block: float
    rms_rel: float
    min_cosine: float
    mean_cosine: float
    underflow_share: float
    non_finite: int


@dataclass(frozen=True)
class AttentionError:
    """``softmax(q K^T / sqrt(d)) V`` of ``queries`` queries per KV head of one layer, in fp32,
    with the original and the decoded K and V: ``rel_l2`` is ``||O' - O|| / ||O||`` over every
    query and head, ``min_cosine`` / ``mean_cosine`` those of each (query, head) output."""

    layer: int
    queries: int
    rel_l2: float
    min_cosine: float
    mean_cosine: float


@dataclass(frozen=True)
class ErrorBounds:
    """Bounds a report is held to (the defaults: what fp8 e4m3 with per-(block, head) scales
    must keep, issue 39's targets)."""

    rms_rel: float = 0.03
    max_abs_rel_block: float = 1 / 16
    min_cosine: float = 0.998
    attention_rel_l2: float = 0.02


@dataclass(frozen=True)
class ErrorReport:
    """The error of one encoded snapshot: ``encoding`` (its name), ``granularity`` (what
    shares a scale), ``query_source`` (how the attention check's queries were made, one of
    :data:`QUERY_SOURCES`), and the measurements."""

    encoding: str
    granularity: str
    query_source: str
    tensors: tuple[TensorError, ...]
    attention: tuple[AttentionError, ...]

    @property
    def worst(self) -> dict[str, float]:
        """The worst value of each measurement over the whole snapshot."""
        tensors, attention = self.tensors, self.attention
        return {
            "max_abs": max((t.max_abs for t in tensors), default=0.0),
            "max_abs_rel_block": max((t.max_abs_rel_block for t in tensors), default=0.0),
            "rms_rel": max((t.rms_rel for t in tensors), default=0.0),
            "min_cosine": min((t.min_cosine for t in tensors), default=1.0),
            "underflow_share": max((t.underflow_share for t in tensors), default=0.0),
            "non_finite": float(sum(t.non_finite for t in tensors)),
            "attention_rel_l2": max((a.rel_l2 for a in attention), default=0.0),
            "attention_min_cosine": min((a.min_cosine for a in attention), default=1.0),
        }

    def exceeds(self, bounds: ErrorBounds | None = None) -> list[str]:
        """One line per measurement past ``bounds`` (default :class:`ErrorBounds`); ``[]`` when
        the report keeps them all."""
        bounds = bounds or ErrorBounds()
        lines = []
        for item in self.tensors:
            if item.rms_rel > bounds.rms_rel:
                lines.append(f"{item.tensor}: RMS relative error {item.rms_rel:.4g}")
            if item.max_abs_rel_block > bounds.max_abs_rel_block:
                lines.append(
                    f"{item.tensor}: max error {item.max_abs_rel_block:.4g} of a block's max"
                )
            if item.min_cosine < bounds.min_cosine:
                lines.append(f"{item.tensor}: min cosine {item.min_cosine:.6g}")
        for check in self.attention:
            if check.rel_l2 > bounds.attention_rel_l2:
                lines.append(f"layer {check.layer}: attention output off by {check.rel_l2:.4g}")
        return lines

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (floats to 6 significant digits: what the metadata stores);
        ``ValueError`` naming the first number that is NaN or infinite (strict JSON has
        neither, and no reader would open the file)."""
        return {
            "encoding": self.encoding,
            "granularity": self.granularity,
            "query_source": self.query_source,
            "tensors": [_rounded(item) for item in self.tensors],
            "attention": [_rounded(item) for item in self.attention],
        }

    @classmethod
    def from_dict(cls, data: Any) -> ErrorReport:
        """Read :meth:`to_dict`'s output back; ``ValueError`` naming the first field that is
        missing, unknown, of the wrong type or not a finite number."""
        fields = _exact(data, ("encoding", "granularity", "query_source", "tensors", "attention"))
        for name in ("encoding", "granularity", "query_source"):
            if not isinstance(fields[name], str) or not 0 < len(fields[name]) <= 64:
                raise ValueError(f"error report: {name} must be a string of 1-64 characters")
        if fields["query_source"] not in QUERY_SOURCES:
            raise ValueError(f"error report: query_source {fields['query_source']!r}")
        return cls(
            fields["encoding"],
            fields["granularity"],
            fields["query_source"],
            tuple(_entry(TensorError, item) for item in _list(fields["tensors"], "tensors")),
            tuple(_entry(AttentionError, item) for item in _list(fields["attention"], "attention")),
        )


def _rounded(item: TensorError | AttentionError) -> dict[str, Any]:
    values = dataclasses.asdict(item)
    for name, value in values.items():
        if isinstance(value, float):
            if not math.isfinite(value):
                where = getattr(item, "tensor", None) or f"layer {getattr(item, 'layer', '?')}"
                raise ValueError(f"error report: {where} {name} is {value}, not a finite number")
            values[name] = float(f"{value:.6g}")
    return values


def _exact(data: Any, names: Sequence[str]) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise ValueError(f"error report: expected an object, got {type(data).__name__}")
    missing = [name for name in names if name not in data]
    unknown = [name for name in data if name not in names]
    if missing or unknown:
        raise ValueError(f"error report: missing {missing}, unknown {unknown}")
    return data


def _list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list) or len(value) > 1 << 20:
        raise ValueError(f"error report: {name} must be a list")
    return value


def _entry(kind: type, data: Any) -> Any:
    """One :class:`TensorError` or :class:`AttentionError`, every field checked."""
    fields = dataclasses.fields(kind)
    values = _exact(data, [field.name for field in fields])
    checked = {}
    for field in fields:
        value = values[field.name]
        where = f"error report: {kind.__name__}.{field.name}"
        if field.type in ("str",):
            if not isinstance(value, str) or not 0 < len(value) <= 256:
                raise ValueError(f"{where} must be a string of 1-256 characters")
        elif field.type in ("int",):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{where} must be a non-negative integer")
        else:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{where} must be a number")
            if not math.isfinite(value):
                raise ValueError(f"{where} must be finite")
            value = float(value)
        checked[field.name] = value
    return kind(**checked)
