"""``kvsnap inspect --plot``: a heatmap of per-layer, per-token KV norms of one sequence.

One panel per part (key and value, or the MLA latent): layers down, tokens across, the L2 norm
of each token's KV as colour. The colour scale spans the finite norms without their outliers
(see :func:`_scale`), so one outlier does not wash the picture out (values beyond are clipped
to the ends of the scale, which the colour bar shows as arrows); NaN and Inf norms get colours
of their own, counted in a legend. The title names the file, the model and the sequence.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .common import is_url
from .output import UsageError

if TYPE_CHECKING:
    from kvsnap.snapshot import Snapshot

#: Image formats ``--plot`` writes, chosen by the file name's extension.
PLOT_EXTENSIONS = (".png", ".svg", ".pdf")
#: Percentiles of the finite norms that the colour scale spans.
SCALE_PERCENTILES = (1.0, 99.0)
#: How far beyond the quartiles, in interquartile ranges, the colour scale may reach.
FENCE_IQRS = 3.0
NAN_COLOUR = "#ff00ff"
INF_COLOUR = "#ff0000"


def check_plot_path(path: str) -> None:
    """Refuse, before anything is read, a ``--plot`` path that cannot take the image exactly as
    named: a URL, a directory, a missing or read-only parent, or a name without an image
    extension."""
    if is_url(path):
        raise UsageError(f"--plot {path}: the plot is written to a local file, not a URL")
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"--plot {path}: is a directory; name the image file to write")
    if target.suffix.lower() not in PLOT_EXTENSIONS:
        raise UsageError(
            f"--plot {path}: name an image file ending in {', '.join(PLOT_EXTENSIONS)}"
        )
    if not target.parent.is_dir():
        raise UsageError(f"--plot {path}: directory {target.parent} does not exist")
    if not os.access(target.parent, os.W_OK):
        raise UsageError(f"--plot {path}: directory {target.parent} is not writable")


def pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'kvsnap[plot]'") from None
    return plt


def _default_sequence(snap: Snapshot) -> str:
    """The first sequence holding tokens (the first one when none does)."""
    with_tokens = [record for record in snap.sequences if len(record.token_ids)]
    return (with_tokens or snap.sequences)[0].id


def plot_norms(snap: Snapshot, path: str, *, sequence_id: str | None = None) -> str:
    """Write the heatmap of ``sequence_id``'s norms (default :func:`_default_sequence`) to
    exactly ``path`` (checked with :func:`check_plot_path`); return ``path``."""
    plt = pyplot()
    if not snap.sequences:
        raise UsageError(f"--plot: {snap.path} holds no sequence")
    chosen = sequence_id if sequence_id is not None else _default_sequence(snap)
    record = snap.sequence(chosen)
    norms = snap.token_norms(chosen)
    figure, axes = plt.subplots(len(norms), 1, figsize=(10, 2.5 + 1.8 * len(norms)), squeeze=False)
    for axis, (part, values) in zip(axes[:, 0], norms.items(), strict=True):
        _draw_panel(figure, axis, part, values)
    figure.suptitle(
        f"{Path(snap.path).name}: model {snap.metadata.source.model_id}, "
        f"sequence {record.id} ({len(record.token_ids)} tokens)",
        parse_math=False,
    )
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=100, format=Path(path).suffix.lower().lstrip("."))
    except OSError as error:
        # What access() cannot foresee: a read-only mount for root, a full disk, a filesystem
        # that refuses new files.
        raise UsageError(
            f"--plot {path}: cannot write the image ({error.strerror or error})"
        ) from None
    finally:
        plt.close(figure)
    return path


def _draw_panel(figure: Any, axis: Any, part: str, values: np.ndarray) -> None:
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    axis.set_title(f"L2 norm of each token's {part}, per layer", parse_math=False)
    axis.set_xlabel("token")
    axis.set_ylabel("layer")
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.yaxis.set_major_locator(MaxNLocator(integer=True))
    if values.shape[1] == 0:
        axis.text(0.5, 0.5, "this sequence holds no tokens", ha="center", va="center")
        axis.set_xticks([])
        return
    finite = np.isfinite(values)
    low, high = _scale(values[finite])
    image = axis.imshow(
        np.ma.masked_invalid(values),
        aspect="auto",
        interpolation="nearest",
        cmap="viridis",
        vmin=low,
        vmax=high,
    )
    colour_bar = figure.colorbar(image, ax=axis, extend="both")
    colour_bar.set_label(f"{part} norm (outliers clipped)")
    legend = []
    for mask, colour, label in (
        (np.isnan(values), NAN_COLOUR, "NaN"),
        (np.isinf(values), INF_COLOUR, "Inf"),
    ):
        if mask.any():
            overlay = np.zeros((*values.shape, 4))
            overlay[mask] = _rgba(colour)
            axis.imshow(overlay, aspect="auto", interpolation="nearest")
            legend.append(Patch(color=colour, label=f"{label} ({int(mask.sum())})"))
    if legend:
        axis.legend(handles=legend, loc="upper right", fontsize="small")


def _scale(finite: np.ndarray) -> tuple[float, float]:
    """The colour scale's ends for ``finite`` norms: the :data:`SCALE_PERCENTILES`, pulled in to
    at most :data:`FENCE_IQRS` interquartile ranges beyond the quartiles, so that a few outliers
    (which a percentile alone keeps when there are few tokens) are clipped rather than shown."""
    if finite.size == 0:
        return 0.0, 1.0
    low, q1, q3, high = (
        float(value)
        for value in np.percentile(finite, (SCALE_PERCENTILES[0], 25, 75, SCALE_PERCENTILES[1]))
    )
    spread = q3 - q1
    if spread > 0:
        low, high = max(low, q1 - FENCE_IQRS * spread), min(high, q3 + FENCE_IQRS * spread)
    if high <= low:
        high = low + max(abs(low) * 1e-6, 1e-12)
    return low, high


def _rgba(colour: str) -> tuple[float, float, float, float]:
    from matplotlib.colors import to_rgba

    return to_rgba(colour)
