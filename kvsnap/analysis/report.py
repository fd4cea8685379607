"""A :class:`~kvsnap.analysis.comparison.Comparison` written for people, in at most 100
columns: how the snapshots' origins differ, then per tensor the largest difference and where
it is, the share beyond the tolerance, the relative errors and cosines; the first layer
that differs and how the difference grows through the layers; the heads and channels that
carry it; the largest differences; NaN and Inf."""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvsnap.analysis.comparison import Comparison, LayerDifference, Location

#: The report's width.
WIDTH = 100
#: Hex digits of a model fingerprint shown (``kvsnap inspect`` shows as many).
FINGERPRINT_DIGITS = 16
#: Characters of a sequence id shown in a table cell.
ID_WIDTH = 10


def number(value: float) -> str:
    """A difference or error in 3 significant digits (``0`` for zero)."""
    return "0" if value == 0 else f"{value:.3g}"


def cosine(value: float) -> str:
    """A cosine: ``1``, ``1-2.3e-07`` close to 1 (where the digits that matter are), else
    6 decimals."""
    if value == 1:
        return "1"
    if value > 0.9999:
        return f"1-{1 - value:.2g}"
    return f"{value:.6f}"


def share(mismatches: int, elements: int) -> str:
    """``148 (3.13%)``: a count and its share, never a bare ``N of N``."""
    if not elements:
        return "0"
    percent = 100 * mismatches / elements
    shown = f"{percent:.3g}" if percent >= 0.01 or not mismatches else "<0.01"
    return f"{mismatches} ({shown}%)"


def short(identifier: str, width: int = ID_WIDTH) -> str:
    return identifier if len(identifier) <= width else identifier[: width - 1] + "~"


def where(sequence: str, token: int, head: int, channel: int | None = None) -> str:
    place = f"{short(sequence)} t{token} h{head}"
    return place if channel is None else f"{place} c{channel}"


def report_lines(comparison: Comparison, *, top: int = 10, verdict: bool = True) -> list[str]:
    """The report, line by line (none longer than :data:`WIDTH`); its last line is the verdict
    (``OK: ...`` or ``DIFFERENT: ...``) unless ``verdict`` is false."""
    lines = _header(comparison)
    if comparison.layers:
        lines += ["", *_tensor_table(comparison), *_divergence(comparison)]
        lines += _heads(comparison)
        lines += _top(comparison, top)
        lines += _nonfinite(comparison)
    if verdict:
        lines += ["", *_wrap(_verdict(comparison))]
    return lines


def _wrap(text: str, prefix: str = "") -> list[str]:
    # Paths and ids are never cut: a line holding one may run past the width.
    lines = textwrap.wrap(
        text,
        WIDTH,
        initial_indent=prefix,
        subsequent_indent=" " * len(prefix),
        break_long_words=False,
        break_on_hyphens=False,
    )
    return lines or [prefix.rstrip()]


def _header(comparison: Comparison) -> list[str]:
    first, second = comparison.paths
    lines = [*_wrap(first, "A: "), *_wrap(second, "B: ")]
    for difference in comparison.sources:
        first, second = difference.a, difference.b
        if difference.field == "model fingerprint":  # as inspect shows it; --json has it whole
            first, second = first[:FINGERPRINT_DIGITS], second[:FINGERPRINT_DIGITS]
        lines += _wrap(f"{difference.field}: {first} (A) vs {second} (B)", "differs: ")
    for note in comparison.notes:
        lines += _wrap(note, "note: ")
    for problem in comparison.problems:
        lines += _wrap(problem.message, "problem: ")
    if comparison.layers:
        lines.append(
            f"tolerance: |a - b| <= {comparison.atol:g} + {comparison.rtol:g} * |b| "
            "(relative error and cosine per (token, head) vector)"
        )
    return lines


def _tensor_table(comparison: Comparison) -> list[str]:
    lines = [
        f"{'tensor':<17}{'max |a-b|':>10}  {'at (seq, token, head, ch)':<26}"
        f"{'beyond tol':>15}{'rel mean':>9}{'rel max':>9}{'cos min':>11}"
    ]
    for layer in comparison.layers:
        at = layer.max_at
        place = "-" if at is None else where(at.sequence, at.token, at.head, at.channel)
        if layer.nonfinite.mismatches:  # what matters more than the largest finite difference
            place = f"NaN/Inf differ x{layer.nonfinite.mismatches}"
        lines.append(
            f"{layer.tensor:<17}{number(layer.max_abs_diff):>10}  {place:<26}"
            f"{share(layer.num_mismatches, layer.num_elements):>15}"
            f"{number(layer.rel_error_mean):>9}{number(layer.rel_error_max):>9}"
            f"{cosine(layer.cosine_min):>11}"
        )
    return lines


def _divergence(comparison: Comparison) -> list[str]:
    """The first layer beyond the tolerance, and the growth of the error through the layers."""
    first = comparison.first_mismatch()
    lines = [""]
    if first is None:
        lines.append("no element is beyond the tolerance")
    else:
        spot = first.first_mismatch or {}
        lines += _wrap(
            f"layer {first.layer} ({first.tensor}), sequence {spot.get('sequence')}, token "
            f"{spot.get('token')}, head {spot.get('head')}, channel {spot.get('channel')}",
            "first difference beyond the tolerance: ",
        )
    steps = [
        f"L{index} {number(diff)} ({number(rel)})" for index, diff, rel in comparison.layer_errors()
    ]
    if any(diff for _, diff, _ in comparison.layer_errors()):
        lines += _wrap(" -> ".join(steps), "growth, max |a-b| (rel mean) per layer: ")
    return lines


def _heads(comparison: Comparison) -> list[str]:
    """The per-head breakdown of the first differing tensor and of the largest difference's."""
    shown: list[LayerDifference] = []
    first = comparison.first_mismatch()
    if first is not None:
        shown.append(first)
    largest = max(comparison.layers, key=lambda layer: layer.max_abs_diff)
    if largest.max_abs_diff > 0 and largest not in shown:
        shown.append(largest)
    lines: list[str] = []
    for layer in shown:
        lines += ["", f"heads of {layer.tensor}:"]
        lines.append(
            f"{'head':>6}{'max |a-b|':>11}{'beyond tol':>16}{'rel mean':>10}{'cos min':>11}"
            "  channels carrying it (max |a-b|)"
        )
        for head in layer.heads:
            channels = ", ".join(f"{c} ({number(v)})" for c, v in head.top_channels) or "-"
            lines.append(
                f"{head.head:>6}{number(head.max_abs_diff):>11}"
                f"{share(head.num_mismatches, head.num_elements):>16}"
                f"{number(head.rel_error_mean):>10}{cosine(head.cosine_min):>11}  {channels}"
            )
    return lines


def _top(comparison: Comparison, top: int) -> list[str]:
    entries: list[Location] = comparison.top[:top]
    if not entries:
        return []
    lines = ["", f"largest differences ({len(entries)}):"]
    lines.append(
        f"{'#':>3}  {'tensor':<16}{'sequence':<11}{'token':>7}{'head':>5}{'ch':>5}"
        f"{'a':>14}{'b':>14}{'|a-b|':>11}"
    )
    for rank, location in enumerate(entries, start=1):
        lines.append(
            f"{rank:>3}  {location.tensor:<16}{short(location.sequence):<11}"
            f"{location.token:>7}{location.head:>5}{location.channel:>5}"
            f"{location.a:>14.6g}{location.b:>14.6g}{number(location.abs_diff):>11}"
        )
    return lines


def _nonfinite(comparison: Comparison) -> list[str]:
    lines = []
    for layer in comparison.layers:
        counts = layer.nonfinite
        if not counts.any:
            continue
        lines += _wrap(
            f"{layer.tensor}: NaN {counts.nan_a} in A, {counts.nan_b} in B; Inf {counts.inf_a} "
            f"in A, {counts.inf_b} in B; {counts.mismatches} element(s) differ by them, "
            f"{counts.both} hold the same NaN/Inf in both; {counts.vectors} vector(s) left out "
            "of the relative errors and cosines",
            "NaN/Inf: ",
        )
    return ["", *lines] if lines else []


def _verdict(comparison: Comparison) -> str:
    differing = [layer for layer in comparison.layers if layer.num_mismatches]
    if comparison.ok:
        return "OK: every element within the tolerance"
    if differing:
        elements = sum(layer.num_elements for layer in comparison.layers)
        beyond = sum(layer.num_mismatches for layer in differing)
        problems = f", and {len(comparison.problems)} problem(s)" if comparison.problems else ""
        return (
            f"DIFFERENT: {share(beyond, elements)} of {elements} elements beyond the tolerance "
            f"in {len(differing)} of {len(comparison.layers)} tensors{problems}"
        )
    return f"DIFFERENT: {len(comparison.problems)} problem(s)"
