"""``kvsnap bench``: measure this machine's transfer paths and refresh the ``auto`` calibration.

A thin client of :func:`kvsnap.bench.run_bench`: one table of GB/s and ratios to the contiguous
pinned-copy ceiling (people) or one JSON object (``--json``), and the derived calibration,
written where ``auto`` reads it with ``--write-calibration``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from .common import JsonOption
from .output import UsageError, emit_json, stdout, step_progress, text

if TYPE_CHECKING:
    import torch

    from kvsnap.bench import BenchReport, Measurement

_SMOKE_TEST_WARNING = (
    "--device cpu copies host memory to host memory: a smoke test of the measurements, "
    "whose figures say nothing about GPU transfers"
)


def bench(
    device: Annotated[
        str,
        typer.Option(
            "--device", help="Device to measure: cuda, cuda:N, or cpu (a smoke test only)."
        ),
    ] = "cuda",
    quick: Annotated[
        bool,
        typer.Option("--quick", help="Jobs of at most 16 MiB, each timed once: seconds."),
    ] = False,
    write: Annotated[
        bool,
        typer.Option(
            "--write-calibration", help="Write the derived calibration where auto reads it."
        ),
    ] = False,
    calibration_file: Annotated[
        Path | None,
        typer.Option(
            "--calibration-path",
            help="Write the calibration to this file instead (with --write-calibration).",
        ),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Measure copies between GPU and host memory per backend; derive auto's calibration."""
    from kvsnap.bench import run_bench
    from kvsnap.bench.calibration import write_calibration

    target = _check_options(device, write, calibration_file)
    if target.type == "cpu" and not as_json:
        stdout.print(f"[yellow]note:[/] {_SMOKE_TEST_WARNING}")
    with step_progress("bench", enabled=not as_json) as progress:
        report = run_bench(target, quick=quick, on_progress=progress)
    written = write_calibration(report.calibration, calibration_file) if write else None
    if as_json:
        emit_json(
            {**report.to_json(), "calibration_path": None if written is None else str(written)}
        )
        return
    # Piped output has no width to respect: print the table whole rather than squeezed to 80.
    table_console = stdout if stdout.is_terminal else Console(highlight=False, width=200)
    table_console.print(_results_table(report))
    for line in _failures(report.results, on_gpu=not report.smoke_test):
        stdout.print(f"[red]failed:[/] {text(line)}")
    _print_calibration(report, written)


def _check_options(device: str, write: bool, calibration_file: Path | None) -> torch.device:
    """The device to measure, once the options are consistent and the calibration writable."""
    from kvsnap.bench import resolve_device
    from kvsnap.transfer.policy import calibration_path

    try:
        target = resolve_device(device)
    except ValueError as error:
        raise UsageError(
            f"{error} (kvsnap bench measures copies between a CUDA GPU and host memory; "
            "--device cpu runs them on host memory as a smoke test)"
        ) from None
    if calibration_file is not None and not write:
        raise UsageError("--calibration-path names the file --write-calibration writes: add it")
    if write and target.type == "cpu" and calibration_file is None:
        # A host-memory calibration at the default path would steer auto on this machine's GPUs.
        raise UsageError(
            "--device cpu measures host memory only: its calibration would mislead auto on a "
            "GPU, so it is written only to a file named with --calibration-path"
        )
    if write:
        # Before measuring: a run of minutes must not end in a calibration that cannot be saved.
        _check_writable(calibration_path() if calibration_file is None else calibration_file)
    return target


def _check_writable(path: Path) -> None:
    """Raise a usage error unless a calibration can be written at ``path``."""
    directory = path.expanduser().parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(
            f"cannot write the calibration to {path}: {error.strerror or error}"
        ) from None
    if path.expanduser().is_dir() or not os.access(directory, os.W_OK):
        raise UsageError(f"cannot write the calibration to {path}: not a writable file path")


def _direction_label(direction: str, on_gpu: bool) -> str:
    from kvsnap.transfer.plan import Direction

    device_side = "GPU" if on_gpu else "device"
    if direction == Direction.DEVICE_TO_HOST.value:
        return f"{device_side}→host"
    return f"host→{device_side}"


def _results_table(report: BenchReport) -> Table:
    from kvsnap.bench import format_bytes

    on_gpu = not report.smoke_test
    table = Table(
        title=text(
            f"kvsnap bench on {report.device_name} ({report.device}): vLLM split NHD, "
            "2 layers, bfloat16"
        ),
        caption="GB/s (ratio to the ceiling); auto: the backend it picked",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    for column in ("page", "blocks", "direction", "ceiling GB/s", *report.backends):
        justify = "left" if column == "direction" else "right"
        table.add_column(column, justify=justify, no_wrap=True)
    for by_method in _rows(report.results).values():
        ceiling = by_method["ceiling"]
        cells = [
            format_bytes(ceiling.page_bytes),
            str(ceiling.blocks),
            _direction_label(ceiling.direction, on_gpu),
            "failed" if ceiling.gbps is None else _gbps(ceiling.gbps),
        ]
        cells += [
            _cell(by_method.get(f"kvsnap-{name}"), name == "auto") for name in report.backends
        ]
        table.add_row(*cells)
    return table


def _rows(results: list[Measurement]) -> dict[tuple[int, int, str], dict[str, Measurement]]:
    rows: dict[tuple[int, int, str], dict[str, Measurement]] = {}
    for m in results:
        rows.setdefault((m.page_bytes, m.blocks, m.direction), {})[m.method] = m
    return rows


def _cell(m: Measurement | None, show_backend: bool) -> str:
    if m is None or m.gbps is None:
        return "[red]failed[/]"
    ratio = "" if m.ratio_to_ceiling is None else f" ({m.ratio_to_ceiling:.2f})"
    backend = f" {m.backend_used}" if show_backend else ""
    return f"{_gbps(m.gbps)}{ratio}{backend}"


def _gbps(value: float) -> str:
    # Three significant digits: 52.1 on a GPU, and a small job on the CPU never shows as 0.0.
    return f"{value:.3g}"


def _failures(results: list[Measurement], on_gpu: bool) -> list[str]:
    from kvsnap.bench import format_bytes

    return [
        f"{m.method.removeprefix('kvsnap-')}, {format_bytes(m.page_bytes)} pages x {m.blocks} "
        f"blocks, {_direction_label(m.direction, on_gpu)}: {m.note}"
        for m in results
        if m.gbps is None
    ]


def _print_calibration(report: BenchReport, written: Path | None) -> None:
    from kvsnap.bench import format_bytes
    from kvsnap.transfer.policy import calibration_path

    calibration: dict[str, Any] = report.calibration
    thresholds = calibration["large_fragment_bytes"]
    on_gpu = not report.smoke_test
    froms = " and ".join(
        f"{format_bytes(size)} ({_direction_label(direction, on_gpu)})"
        for direction, size in thresholds.items()
    )
    stdout.print(f"auto ran under: {text(report.auto_policy)}")
    smoke_test = " (from host memory: not for GPUs)" if report.smoke_test else ""
    stdout.print(
        f"derived calibration{smoke_test}: cuda-batch for fragments from {froms}, "
        f"{calibration['small_backend']} below"
    )
    default_path = calibration_path()
    if written is None and report.smoke_test:
        # The default path is refused for a host-memory calibration (see _check_options).
        stdout.print(
            "not written: --write-calibration --calibration-path FILE writes it to FILE "
            "(a host-memory calibration never goes where auto reads it)"
        )
    elif written is None:
        stdout.print(f"not written: --write-calibration writes it to {text(default_path)}")
    elif written.resolve() == default_path.resolve():
        stdout.print(f"calibration written to [bold]{text(written)}[/]: auto uses it from now on")
    else:
        stdout.print(
            f"calibration written to [bold]{text(written)}[/]; auto reads {text(default_path)}, "
            f"so set KVSNAP_CALIBRATION={text(written)} to use it"
        )
