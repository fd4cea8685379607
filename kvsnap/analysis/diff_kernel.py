"""The reductions of one comparison step: two pieces of one tensor's KV, ``(tokens, heads,
dim)`` each, folded into running per-tensor and per-head numbers with vectorised numpy.

One step costs a handful of passes over its elements (the difference, three per-vector sums
of squares, ``|diff|``, the tolerance test, the per-channel maximum) and a few over its
(token, head) vectors, D times fewer. Cosines come from the three norms, as
``1 - (|d|^2 - (|a| - |b|)^2) / (2 |a| |b|)``, which keeps small angles accurate without a dot
product pass. NaN and Inf take a slower path only in a step that holds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvsnap.analysis.comparison import (
    HeadDifference,
    LayerDifference,
    Location,
    NonFinite,
    VectorLocation,
)

#: Channels of a head the report names per head (those carrying its largest differences).
TOP_CHANNELS = 4


@dataclass
class Piece:
    """One step's KV of one tensor: ``a`` and ``b`` decoded, ``(tokens, heads, dim)``, owned by
    the reduction (it overwrites them); ``token`` is the first token's index in ``sequence``;
    ``scratch`` an array of their shape and dtype the reduction may use."""

    tensor: str
    sequence: str
    token: int
    a: np.ndarray
    b: np.ndarray
    scratch: np.ndarray


@dataclass
class _VectorStats:
    """Running sums and extremes of per-vector numbers (relative error or cosine), overall and
    per head."""

    heads: int
    largest: bool  # track the maximum (relative error) or the minimum (cosine)
    total: float = 0.0
    count: int = 0
    extreme: float = float("nan")
    at: VectorLocation | None = None
    head_total: np.ndarray = field(init=False)
    head_count: np.ndarray = field(init=False)
    head_extreme: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.head_total = np.zeros(self.heads)
        self.head_count = np.zeros(self.heads, dtype=np.int64)
        start = -np.inf if self.largest else np.inf
        self.head_extreme = np.full(self.heads, start)

    def add(self, values: np.ndarray, valid: np.ndarray | None, piece: Piece) -> None:
        """Fold ``values`` ``(tokens, heads)`` in, those where ``valid`` is false left out."""
        if valid is not None:
            self._add_some(np.where(valid, values, np.nan), piece)
            return
        self.head_count += values.shape[0]
        self.count += values.size
        self.head_total += values.sum(axis=0)
        self.total = float(self.head_total.sum())
        if self.largest:
            extremes = values.max(axis=0)
            np.fmax(self.head_extreme, extremes, out=self.head_extreme)
            self._locate(values, piece, float(extremes.max()))
        else:
            extremes = values.min(axis=0)
            np.fmin(self.head_extreme, extremes, out=self.head_extreme)
            self._locate(values, piece, float(extremes.min()))

    def _add_some(self, values: np.ndarray, piece: Piece) -> None:
        """:meth:`add` of ``values`` holding NaN where a vector is left out."""
        finite = ~np.isnan(values)
        counts = finite.sum(axis=0)
        self.head_count += counts
        self.head_total += np.nansum(values, axis=0)
        self.count += int(counts.sum())
        self.total = float(self.head_total.sum())
        if not counts.any():
            return
        reduce = np.fmax if self.largest else np.fmin
        self.head_extreme = reduce(self.head_extreme, pick_each(values, self.largest))
        best = np.nanmax(values) if self.largest else np.nanmin(values)
        self._locate(np.nan_to_num(values, nan=-np.inf if self.largest else np.inf), piece, best)

    def _locate(self, values: np.ndarray, piece: Piece, best: float) -> None:
        """Keep where the extreme is when ``best`` (``values``' extreme) beats it."""
        better = best > self.extreme if self.largest else best < self.extreme
        if self.at is not None and not better:
            return
        index = np.argmax(values) if self.largest else np.argmin(values)
        token, head = np.unravel_index(int(index), values.shape)
        self.extreme = best
        self.at = VectorLocation(piece.sequence, piece.token + int(token), int(head), best)

    def mean(self) -> float:
        return self.total / self.count if self.count else float("nan")

    def head_means(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.head_total / self.head_count


def pick_each(values: np.ndarray, largest: bool) -> np.ndarray:
    """Per head (column) the largest or smallest non-NaN value (NaN for an all-NaN column)."""
    filled = np.where(np.isnan(values), -np.inf if largest else np.inf, values)
    extreme = filled.max(axis=0) if largest else filled.min(axis=0)
    return np.where(np.isinf(extreme), np.nan, extreme)


class TopDifferences:
    """The ``count`` largest element differences seen, over every tensor, largest first."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.entries: list[Location] = []
        #: A step whose largest difference is not above this adds nothing.
        self.threshold = 0.0

    def offer(self, piece: Piece, diff: np.ndarray, peak: float) -> None:
        """Take the largest differences of ``diff`` (``|a - b|`` of ``piece``, finite) that
        beat the ones held; ``peak`` is ``diff``'s maximum. Only the tokens whose largest
        difference beats the threshold are searched, and of those the ``count`` largest:
        the ``count`` largest elements lie in them."""
        if self.count == 0 or not peak > self.threshold:
            return
        tokens = diff.shape[0]
        per_token = diff.reshape(tokens, -1).max(axis=1)
        candidates = np.flatnonzero(per_token > self.threshold)
        if candidates.size > self.count:
            best = np.argpartition(per_token[candidates], -self.count)[-self.count :]
            candidates = candidates[best]
        rows = diff[candidates].reshape(candidates.size, -1)
        flat = rows.reshape(-1)
        keep = min(self.count, flat.size)
        order = np.argpartition(flat, -keep)[-keep:]
        heads, dim = diff.shape[1], diff.shape[2]
        for index in order.tolist():
            if not flat[index] > self.threshold:
                continue
            row, within = divmod(index, heads * dim)
            head, channel = divmod(within, dim)
            token = int(candidates[row])
            self.entries.append(
                Location(
                    piece.tensor,
                    piece.sequence,
                    piece.token + token,
                    head,
                    channel,
                    float(piece.a[token, head, channel]),
                    float(piece.b[token, head, channel]),
                )
            )
        self.entries.sort(key=lambda location: location.abs_diff, reverse=True)
        del self.entries[self.count :]
        if len(self.entries) == self.count:
            self.threshold = self.entries[-1].abs_diff


class TensorDiff:
    """The running comparison of one tensor, step by step (:meth:`add`), and its result
    (:meth:`result`)."""

    def __init__(
        self, tensor: str, heads: int, dim: int, atol: float, rtol: float, top: TopDifferences
    ) -> None:
        self.tensor = tensor
        self.atol, self.rtol = atol, rtol
        self.top = top
        self.elements = 0
        self.mismatches = 0
        self.first: dict[str, object] | None = None
        self.max_abs = 0.0
        self.max_at: Location | None = None
        self.square_sum = 0.0
        self.channel_max = np.zeros((heads, dim))
        self.head_mismatches = np.zeros(heads, dtype=np.int64)
        self.head_elements = 0
        self.relative = _VectorStats(heads, largest=True)
        self.cosine = _VectorStats(heads, largest=False)
        self.nonfinite = NonFinite()

    def add(self, piece: Piece) -> np.ndarray:
        """Fold one step in; returns each vector's relative error ``(tokens, heads)`` (NaN
        where a vector holds NaN or Inf), for a per-token profile."""
        a, b = piece.a, piece.b
        with np.errstate(invalid="ignore", over="ignore"):  # NaN and Inf are handled below
            diff = np.subtract(a, b, out=piece.scratch)
            norms = _squared_norms(diff, a, b)
        valid: np.ndarray | None = None
        unequal: np.ndarray | None = None
        if not (np.isfinite(norms[1]).all() and np.isfinite(norms[2]).all()):
            valid, unequal = self._nonfinite(a, b, diff)
            norms = _squared_norms(diff, a, b, wide=True)
        np.abs(diff, out=diff)
        self._tolerance(piece, diff, unequal)
        self._largest(piece, diff)
        self.square_sum += float(norms[0].sum())
        self.elements += diff.size
        self.head_elements += diff.shape[0] * diff.shape[2]
        relative, cosine = _vector_errors(*norms)
        self.relative.add(relative, valid, piece)
        self.cosine.add(cosine, valid, piece)
        return relative if valid is None else np.where(valid, relative, np.nan)

    def _tolerance(self, piece: Piece, diff: np.ndarray, unequal: np.ndarray | None) -> None:
        """Count the elements beyond the tolerance (and NaN/Inf on one side), per head too."""
        if self.rtol:
            over = diff > np.abs(piece.b) * self.rtol + self.atol
        else:
            over = diff > self.atol
        if unequal is not None:
            over |= unequal
        count = int(np.count_nonzero(over))
        if not count:
            return
        self.mismatches += count
        # Summing the flags of each (head, channel) down the tokens reads them once, in order
        # (a count over the head's axes strides): uint16 holds a step's count of one channel.
        tokens = over.shape[0]
        wide = np.uint16 if tokens < np.iinfo(np.uint16).max else np.int64
        per_channel = np.add.reduce(over.view(np.uint8).reshape(tokens, -1), axis=0, dtype=wide)
        self.head_mismatches += per_channel.reshape(over.shape[1:]).sum(axis=1, dtype=np.int64)
        if self.first is None:
            token, head, channel = np.unravel_index(int(np.argmax(over)), over.shape)
            self.first = {
                "sequence": piece.sequence,
                "token": piece.token + int(token),
                "head": int(head),
                "channel": int(channel),
            }

    def _largest(self, piece: Piece, diff: np.ndarray) -> None:
        """The per-channel maxima, the largest difference and its place, the top list."""
        channels = diff.max(axis=0)
        np.maximum(self.channel_max, channels, out=self.channel_max)
        peak = float(channels.max())
        if peak > self.max_abs:
            head, channel = np.unravel_index(int(np.argmax(channels)), channels.shape)
            token = int(np.argmax(diff[:, head, channel]))
            self.max_abs = peak
            self.max_at = Location(
                piece.tensor,
                piece.sequence,
                piece.token + token,
                int(head),
                int(channel),
                float(piece.a[token, head, channel]),
                float(piece.b[token, head, channel]),
            )
        self.top.offer(piece, diff, peak)

    def _nonfinite(
        self, a: np.ndarray, b: np.ndarray, diff: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Count NaN and Inf, mark the elements where they make ``a`` and ``b`` differ, and
        zero every non-finite element in ``a``, ``b`` and ``diff`` so that the finite numbers
        stay finite. Returns the vectors free of them and the differing elements."""
        finite_a, finite_b = np.isfinite(a), np.isfinite(b)
        bad = ~(finite_a & finite_b)
        nan_a, nan_b = np.isnan(a), np.isnan(b)
        same = ~finite_a & ~finite_b & ((a == b) | (nan_a & nan_b))
        unequal = bad & ~same
        counts = self.nonfinite
        nan_a_count, nan_b_count = int(nan_a.sum()), int(nan_b.sum())
        vectors = ~bad.any(axis=2)
        self.nonfinite = NonFinite(
            counts.nan_a + nan_a_count,
            counts.nan_b + nan_b_count,
            counts.inf_a + int((~finite_a).sum()) - nan_a_count,
            counts.inf_b + int((~finite_b).sum()) - nan_b_count,
            counts.mismatches + int(unequal.sum()),
            counts.both + int(same.sum()),
            counts.vectors + int((~vectors).sum()),
        )
        a[bad] = 0.0
        b[bad] = 0.0
        diff[bad] = 0.0
        return vectors, unequal

    def result(self) -> LayerDifference:
        """The tensor's numbers so far."""
        heads = []
        relative_means, cosine_means = self.relative.head_means(), self.cosine.head_means()
        for head in range(self.channel_max.shape[0]):
            channels = self.channel_max[head]
            order = np.argsort(-channels, kind="stable")[:TOP_CHANNELS]
            heads.append(
                HeadDifference(
                    head,
                    float(channels.max()) if channels.size else 0.0,
                    int(self.head_mismatches[head]),
                    self.head_elements,
                    _number(relative_means[head], 0.0),
                    _number(self.relative.head_extreme[head], 0.0),
                    _number(cosine_means[head], 1.0),
                    _number(self.cosine.head_extreme[head], 1.0),
                    tuple((int(c), float(channels[c])) for c in order if channels[c] > 0),
                )
            )
        rms = (self.square_sum / self.elements) ** 0.5 if self.elements else 0.0
        return LayerDifference(
            self.tensor,
            self.max_abs,
            self.mismatches,
            self.first,
            num_elements=self.elements,
            max_at=self.max_at,
            rms_diff=rms,
            num_vectors=self.relative.count,
            rel_error_mean=_number(self.relative.mean(), 0.0),
            rel_error_max=_number(self.relative.extreme, 0.0),
            rel_error_max_at=self.relative.at,
            cosine_mean=_number(self.cosine.mean(), 1.0),
            cosine_min=_number(self.cosine.extreme, 1.0),
            cosine_min_at=self.cosine.at,
            heads=tuple(heads),
            nonfinite=self.nonfinite,
        )


def _number(value: float, empty: float) -> float:
    """``value``, or ``empty`` when there was nothing to measure (NaN, +-Inf start values)."""
    value = float(value)
    return empty if np.isnan(value) or np.isinf(value) else value


def _squared_norms(*arrays: np.ndarray, wide: bool = False) -> list[np.ndarray]:
    """Per (token, head) vector of each array, the sum of its squares as float64: summed in
    the arrays' own dtype (a float32 sum of one head's squares is good to a few ulps), or in
    float64 when ``wide`` (a step that overflowed float32: values beyond 1e19)."""
    if wide:
        return [np.einsum("thd,thd->th", x, x, dtype=np.float64) for x in arrays]
    return [np.einsum("thd,thd->th", x, x).astype(np.float64) for x in arrays]


def _vector_errors(
    diff_squares: np.ndarray, a_squares: np.ndarray, b_squares: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per vector, the relative error and the cosine from the squared norms of ``a - b``,
    ``a`` and ``b`` (float64)."""
    norm_a, norm_b = np.sqrt(a_squares), np.sqrt(b_squares)
    larger = np.maximum(norm_a, norm_b)
    product = norm_a * norm_b
    with np.errstate(invalid="ignore", divide="ignore"):
        relative = np.where(larger > 0, np.sqrt(diff_squares) / larger, 0.0)
        gap = (diff_squares - (norm_a - norm_b) ** 2) / (2 * product)
    # Both zero: the same vector (cosine 1); one zero: nothing in common (cosine 0).
    one_minus = np.where(product > 0, np.clip(gap, 0.0, 2.0), np.where(larger > 0, 1.0, 0.0))
    return relative, 1.0 - one_minus
