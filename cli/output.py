"""How the CLI talks to people and scripts: exit codes, error messages, JSON, progress bars.

Exit codes: 0 success; 1 verification failed (corrupt, truncated, mismatching, not a snapshot);
2 usage error (bad arguments, missing file, incompatible target); 130 interrupted (Ctrl-C). A
user error prints one line on stderr, never a traceback (``--debug`` shows it). With
``--json`` stdout carries exactly one JSON object and nothing else.

Anything that comes from a file, a path or an argument is printed as text, never as rich markup:
:func:`text` escapes it (a path ``a[/x]`` or a sequence id ``user[admin]`` prints as itself).
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from kvsnap.errors import KVSnapError, NotASnapshotError, SignatureError, SnapshotCorruptError

EXIT_OK = 0
EXIT_VERIFY_FAILED = 1
EXIT_USAGE = 2
#: Ctrl-C (SIGINT): 128 + the signal's number, as shells report it.
EXIT_INTERRUPTED = 130

stdout = Console(highlight=False, soft_wrap=True)
stderr = Console(stderr=True, highlight=False, soft_wrap=True)


@dataclass
class Settings:
    """Options every command shares, set by the app callback."""

    debug: bool = False


settings = Settings()


class UsageError(ValueError):
    """A user mistake the CLI reports with exit code 2 (bad argument, missing file)."""


def format_bytes(count: float) -> str:
    """``count`` bytes in B, KiB, MiB or GiB (one decimal above bytes): the one unit every
    size the CLI prints uses, progress bars included."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count} B"


class _BinarySpeedColumn(ProgressColumn):
    """Bytes per second in the binary units of :func:`format_bytes` (rich's own speed column
    speaks kB and MB, beside sizes in KiB and MiB), averaged since the bar started: rich's own
    estimate spans only the updates, so bytes reported in a few large steps (a capture's
    pages staged long before they are written) read as an impossible speed."""

    def render(self, task: Task) -> Text:
        elapsed = task.finished_time if task.finished else task.elapsed
        speed = task.completed / elapsed if elapsed and task.completed else None
        shown = "?" if speed is None else f"{format_bytes(speed)}/s"
        return Text(shown, style="progress.data.speed")


def text(value: object) -> str:
    """``value`` as a string that rich prints literally (its markup characters escaped)."""
    return escape(str(value))


def exit_code_for(error: BaseException) -> int:
    """The documented exit code for an error raised by a command: 1 when a snapshot failed its
    checks, 2 for everything the user must fix (arguments, paths, an incompatible target)."""
    if isinstance(error, SnapshotCorruptError | NotASnapshotError | SignatureError):
        return EXIT_VERIFY_FAILED
    return EXIT_USAGE


def report_error(message: str, *, as_json: bool) -> None:
    """Print ``message`` as the one error line on stderr, and as ``{"ok": false, "error": ...}``
    on stdout with ``--json``. Line breaks in ``message`` are joined: one line, always."""
    line = " ".join(message.split())
    if as_json:
        emit_json({"ok": False, "error": line})
    stderr.print(f"[bold red]error:[/] {text(line)}")


def fail(message: str, code: int, *, as_json: bool = False) -> NoReturn:
    """Print one clear error (and the JSON error object with ``--json``) and exit with ``code``."""
    report_error(message, as_json=as_json)
    raise typer.Exit(code)


def handle_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Turn expected errors into one message and the documented exit code.

    ``--debug`` re-raises instead, so the traceback shows."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except typer.Exit:
            raise
        except (KVSnapError, UsageError, OSError, ValueError, KeyError) as error:
            if settings.debug:
                raise
            message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
            fail(str(message), exit_code_for(error), as_json=bool(kwargs.get("as_json")))

    return wrapper


def emit_json(payload: dict[str, Any]) -> None:
    """Write ``payload`` as the one JSON object on stdout."""
    sys.stdout.write(json.dumps(payload, indent=2, default=_jsonable) + "\n")
    sys.stdout.flush()


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


@contextmanager
def progress_bar(description: str, *, enabled: bool) -> Iterator[Callable[[int, int], None]]:
    """A rich byte progress bar on stderr.

    The callback does nothing when disabled or when stderr is not a terminal."""
    if not enabled or not stderr.is_terminal:
        yield lambda done, total: None
        return
    columns = (
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        _BinarySpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=stderr, transient=True) as progress:
        task = progress.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        yield update


@contextmanager
def step_progress(description: str, *, enabled: bool) -> Iterator[Callable[[int, int, str], None]]:
    """A rich progress bar of steps on stderr, naming the step that runs now.

    The callback ``(done, total, label)`` does nothing when disabled or when stderr is not a
    terminal. The bar is redrawn only by the callback, never by a refresh thread, so it takes
    no host time from what runs between steps (a benchmark's timings)."""
    if not enabled or not stderr.is_terminal:
        yield lambda done, total, label: None
        return
    columns = (
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[step]}"),
    )
    with Progress(*columns, console=stderr, transient=True, auto_refresh=False) as progress:
        task = progress.add_task(description, total=None, step="")

        def update(done: int, total: int, label: str) -> None:
            progress.update(task, completed=done, total=total, step=label)
            progress.refresh()

        yield update


@contextmanager
def status(description: str, *, enabled: bool) -> Iterator[None]:
    """A spinner with ``description`` on stderr while the block runs (work of unknown length);
    nothing when disabled or when stderr is not a terminal."""
    if not enabled or not stderr.is_terminal:
        yield
        return
    with stderr.status(description):
        yield
