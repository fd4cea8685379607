"""``kvsnap diff A B``: where two snapshots' KV differs, by how much, and in what.

A thin client of :func:`kvsnap.analysis.compare` (``Snapshot.compare``): both snapshots are
checked block by block as they are read, a bounded step at a time, with a byte bar on stderr;
the report is the library's (``--json``: every number of it), ``--plot`` draws its per-token
profile. Exit 0 when every element is within the tolerance, 1 when not (or a snapshot is
damaged), 2 for usage errors.
"""

from __future__ import annotations

from typing import Annotated

import typer

from .common import JsonOption, snapshot_location
from .comparison_output import AtolOption, RtolOption, TopOption, print_report
from .foreign_paths import is_foreign
from .output import EXIT_VERIFY_FAILED, UsageError, emit_json, progress_bar, stdout, text
from .plot import check_plot_path

SnapshotA = Annotated[str, typer.Argument(metavar="A", help="The snapshot file or URL to check.")]
SnapshotB = Annotated[
    str, typer.Argument(metavar="B", help="The reference snapshot file or URL it is compared with.")
]


def diff(
    a: SnapshotA,
    b: SnapshotB,
    atol: AtolOption = 0.0,
    rtol: RtolOption = 0.0,
    top: TopOption = 10,
    plot: Annotated[
        str | None,
        typer.Option(
            "--plot",
            metavar="FILE",
            help="Write heatmaps of the relative error per layer and token (.png, .svg, .pdf).",
        ),
    ] = None,
    sequence: Annotated[
        str | None,
        typer.Option(
            "--sequence", metavar="ID", help="The sequence --plot shows (default: the first)."
        ),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Compare snapshot A's KV with reference B: where it differs, by how much, in what."""
    for location in (a, b):
        if is_foreign(location):
            raise UsageError(
                f"{location}: another engine's files; diff reads kvsnap snapshots: "
                f"kvsnap convert {location} -o OUT.safetensors first"
            )
    first, second = snapshot_location(a), snapshot_location(b)
    if sequence is not None and plot is None:
        raise UsageError("--sequence chooses the sequence of --plot: add --plot FILE")
    if plot is not None:
        check_plot_path(plot)
    from kvsnap.snapshot import Snapshot

    with Snapshot.open(first) as mine, Snapshot.open(second) as reference:
        with progress_bar("comparing", enabled=not as_json) as progress:
            comparison = mine.compare(
                reference,
                atol=atol,
                rtol=rtol,
                top=top,
                profile=plot is not None,
                profile_sequence=sequence,
                progress=progress,
            )
    written = None
    if plot is not None:
        from .diff_plot import plot_comparison

        written = plot_comparison(comparison, plot)
    if as_json:
        emit_json({**comparison.to_dict(), **({"plot": written} if written else {})})
    else:
        print_report(comparison, top=top)
        if written:
            stdout.print(f"plot written to {text(written)}")
    if not comparison.ok:
        raise typer.Exit(EXIT_VERIFY_FAILED)
