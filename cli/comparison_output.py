"""How ``kvsnap diff`` and ``kvsnap verify --against`` show a comparison: the library's report
(``Comparison.report``, at most 100 columns) on stdout, its verdict coloured, and the same
numbers as JSON (``Comparison.to_dict``, which the commands print as it is)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from .output import stdout, text

if TYPE_CHECKING:
    from kvsnap.analysis import Comparison

TopOption = Annotated[
    int,
    typer.Option("--top", min=0, metavar="N", help="List the N largest element differences."),
]
AtolOption = Annotated[
    float, typer.Option("--atol", min=0.0, help="Absolute tolerance: |a - b| <= atol + rtol*|b|.")
]
RtolOption = Annotated[
    float, typer.Option("--rtol", min=0.0, help="Relative tolerance: |a - b| <= atol + rtol*|b|.")
]


def print_report(comparison: Comparison, *, top: int, verdict: bool = True) -> None:
    """The comparison's report on stdout (its verdict line in colour when ``verdict``)."""
    from kvsnap.analysis.report import report_lines

    for line in report_lines(comparison, top=top, verdict=verdict):
        word, colon, rest = line.partition(":")
        if verdict and colon and word in ("OK", "DIFFERENT"):
            colour = "green" if comparison.ok else "red"
            stdout.print(f"[bold {colour}]{word}[/]:{text(rest)}")
        else:
            stdout.print(text(line))
