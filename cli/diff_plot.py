"""``kvsnap diff --plot``: where in the cache two snapshots differ, as a picture.

Per part (key and value, or the MLA latent) two panels: layers down and tokens across, the
largest relative error of the (token, head) vectors of each cell (tokens binned: at most
1,024 columns, so 8k tokens read as well as 80); and layers down, heads across, the largest
over the tokens. A logarithmic colour scale (relative errors span decades); identical cells
in light grey, cells holding NaN or Inf in magenta (in the token panels also pointed out by a
magenta marker, as a column may be narrower than a pixel), both named in a legend. The title names
both files and the sequence.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .output import UsageError
from .plot import NAN_COLOUR, pyplot

if TYPE_CHECKING:
    from kvsnap.analysis import Comparison, DiffProfile

#: Cells whose every vector is identical.
SAME_COLOUR = "#dddddd"
#: The colour scale spans at most this many decades below its largest error.
DECADES = 6


def plot_comparison(comparison: Comparison, path: str) -> str:
    """Write the picture of ``comparison``'s profile to exactly ``path``; return ``path``."""
    plt = pyplot()
    profile = comparison.profile
    if profile is None or profile.num_tokens == 0:
        raise UsageError("--plot: the snapshots share no token to compare")
    parts = list(profile.values)
    figure, axes = plt.subplots(
        len(parts),
        2,
        figsize=(13, 1.6 + 2.8 * len(parts)),
        squeeze=False,
        width_ratios=[4, 1],
        layout="constrained",
    )
    norm = _scale(plt, profile)
    for row, part in enumerate(parts):
        values = profile.values[part]
        image = _panel(axes[row, 0], values.max(axis=2, initial=0.0), norm, profile, part)
        _head_panel(axes[row, 1], values, norm, part)
        bar = figure.colorbar(image, ax=list(axes[row]), extend="min")
        bar.set_label("relative error |a-b| / max(|a|,|b|)")
    first, second = (Path(path).name for path in comparison.paths)
    figure.suptitle(
        f"{first} vs {second}: sequence {profile.sequence} ({profile.num_tokens} tokens)",
        parse_math=False,
    )
    _legend(figure, profile)
    try:
        figure.savefig(path, dpi=100, format=Path(path).suffix.lower().lstrip("."))
    except OSError as error:
        raise UsageError(
            f"--plot {path}: cannot write the image ({error.strerror or error})"
        ) from None
    finally:
        plt.close(figure)
    return path


def _scale(plt: Any, profile: DiffProfile) -> Any:
    from matplotlib.colors import LogNorm

    stacked = np.concatenate([values.reshape(-1) for values in profile.values.values()])
    positive = stacked[np.isfinite(stacked) & (stacked > 0)]
    high = float(positive.max()) if positive.size else 1.0
    low = max(float(positive.min()) if positive.size else high, high * 10.0**-DECADES)
    return LogNorm(vmin=min(low, high / 10), vmax=high)


def _cmap(plt: Any) -> Any:
    # Masked cells (an error of exactly 0) in the colour of "identical".
    return plt.get_cmap("inferno").with_extremes(bad=SAME_COLOUR)


def _panel(axis: Any, cells: np.ndarray, norm: Any, profile: DiffProfile, part: str) -> Any:
    """Layers down, token bins across (the axis in tokens)."""
    import matplotlib.pyplot as plt

    layers, bins = cells.shape
    extent = (0, profile.num_tokens, layers - 0.5, -0.5)
    image = axis.imshow(
        np.ma.masked_less_equal(np.nan_to_num(cells, nan=0.0), 0.0),
        aspect="auto",
        interpolation="nearest",
        cmap=_cmap(plt),
        norm=norm,
        extent=extent,
    )
    _mark_nonfinite(axis, cells, extent)
    _point_out_nonfinite(axis, cells, profile.num_tokens)
    binned = (
        f", {profile.num_tokens / bins:.3g} tokens per column" if bins < profile.num_tokens else ""
    )
    axis.set_title(f"{part}: largest relative error per layer and token{binned}", parse_math=False)
    axis.set_xlabel("token")
    axis.set_ylabel("layer")
    axis.set_yticks(_ticks(layers))
    return image


def _head_panel(axis: Any, values: np.ndarray, norm: Any, part: str) -> None:
    """Layers down, heads across: each head's largest error over the tokens."""
    import matplotlib.pyplot as plt

    per_head = np.where(np.isnan(values).any(axis=1), np.nan, np.nanmax(values, axis=1, initial=0))
    layers, heads = per_head.shape
    extent = (-0.5, heads - 0.5, layers - 0.5, -0.5)
    axis.imshow(
        np.ma.masked_less_equal(np.nan_to_num(per_head, nan=0.0), 0.0),
        aspect="auto",
        interpolation="nearest",
        cmap=_cmap(plt),
        norm=norm,
        extent=extent,
    )
    _mark_nonfinite(axis, per_head, extent)
    axis.set_title(f"{part} per head", parse_math=False)
    axis.set_xlabel("KV head")
    axis.set_xticks(_ticks(heads))
    axis.set_yticks(_ticks(layers))


def _mark_nonfinite(axis: Any, cells: np.ndarray, extent: tuple[float, ...]) -> None:
    mask = np.isnan(cells)
    if not mask.any():
        return
    from matplotlib.colors import to_rgba

    overlay = np.zeros((*cells.shape, 4))
    overlay[mask] = to_rgba(NAN_COLOUR)
    axis.imshow(overlay, aspect="auto", interpolation="nearest", extent=extent)


def _point_out_nonfinite(axis: Any, cells: np.ndarray, num_tokens: int) -> None:
    """A marker over each token column holding NaN or Inf: at thousands of tokens a column is
    narrower than a pixel, and its colour alone may not be drawn at all."""
    layers, columns = np.nonzero(np.isnan(cells))
    if not layers.size:
        return
    limits = axis.get_xlim(), axis.get_ylim()
    width = num_tokens / cells.shape[1]
    axis.scatter(
        (columns + 0.5) * width,
        layers,
        marker="v",
        s=64,
        color=NAN_COLOUR,
        edgecolors="black",
        linewidths=0.6,
        zorder=3,
    )
    axis.set_xlim(*limits[0])
    axis.set_ylim(*limits[1])


def _ticks(count: int) -> list[int]:
    step = max(1, int(np.ceil(count / 16)))
    return list(range(0, count, step))


def _legend(figure: Any, profile: DiffProfile) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(color=SAME_COLOUR, label="identical")]
    if any(np.isnan(values).any() for values in profile.values.values()):
        handles.append(Patch(color=NAN_COLOUR, label="NaN or Inf"))
    figure.legend(handles=handles, loc="outside upper right", fontsize="small", ncols=2)
