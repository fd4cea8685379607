"""The ``kvsnap`` command line: capture, inspect, verify, diff, restore, fixture, bench, convert,
export, store.

Every command is a thin client of the library (one module per command): it parses options,
calls :mod:`kvsnap`, and formats the answer as rich tables (people) or one JSON object
(``--json``, scripts). The contract of docs/cli.md holds for every error, click's own usage
errors included: one line on stderr, exit code 2, and ``{"ok": false, "error": ...}`` on stdout
with ``--json``.
"""

from __future__ import annotations

import re
import signal
import sys
from collections.abc import Sequence
from typing import Annotated, Any

import click
import typer
from typer.core import TyperArgument, TyperGroup

from kvsnap import __version__

from .bench import bench
from .capture import capture
from .convert import convert
from .diff import diff
from .export import export
from .fixture import fixture
from .inspection import inspect
from .output import EXIT_INTERRUPTED, EXIT_USAGE, handle_errors, report_error, settings, stdout
from .restore import restore
from .store import app as store_app
from .verify import verify


def _keep_argument_help() -> None:
    """Give arguments their help text back: typer 0.25 sets ``help`` before calling
    ``click.Argument.__init__``, which since click 8.5 takes a ``help`` of its own and resets
    it to ``None``, so ``--help`` showed no description of ``SNAPSHOT``."""
    initialise = TyperArgument.__init__
    if getattr(initialise, "keeps_help", False):
        return

    def keeping_help(
        self: TyperArgument, *args: Any, help: str | None = None, **kwargs: Any
    ) -> None:
        initialise(self, *args, help=help, **kwargs)
        self.help = help

    keeping_help.keeps_help = True  # type: ignore[attr-defined]
    TyperArgument.__init__ = keeping_help  # type: ignore[method-assign]


_keep_argument_help()

#: Raised after the help of a group called without a command was printed (click 8.2 and later).
_NO_ARGS_IS_HELP: Any = getattr(click.exceptions, "NoArgsIsHelpError", ())


class KVSnapGroup(TyperGroup):
    """The app's click group: runs without click's standalone error printing, so that a usage
    error (a missing option, a value out of range) is reported as every other error is."""

    #: Whether the command line asked for ``--json`` (errors then also go to stdout as JSON).
    _json_errors = False

    def main(  # type: ignore[override]
        self, args: Sequence[str] | None = None, *pargs: Any, **kwargs: Any
    ) -> Any:
        arguments = _global_options_first(list(sys.argv[1:] if args is None else args))
        self._json_errors = "--json" in arguments
        kwargs["standalone_mode"] = False
        try:
            code = super().main(arguments, *pargs, **kwargs)
        except _NO_ARGS_IS_HELP:
            sys.exit(EXIT_USAGE)  # the help was printed already
        except click.ClickException as error:
            command = _command_path(error)
            hint = f" (see {command} --help)" if command else ""
            message = _each_sentence_once(error.format_message())
            report_error(message + hint, as_json="--json" in arguments)
            sys.exit(EXIT_USAGE if error.exit_code == 2 else error.exit_code)
        except click.exceptions.Abort:
            report_error("aborted", as_json="--json" in arguments)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx: click.Context) -> Any:
        """Run the command; Ctrl-C at any point of it (model load, prefill, write) prints one
        "interrupted" line and exits 130, what a shell reports for SIGINT. The library has
        removed whatever it was writing by then and left the previous file as it was."""
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            # The cleanup is done: another Ctrl-C while the interpreter exits ends the process
            # at once, as an uncaught SIGINT does, instead of printing a traceback.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            report_error("interrupted", as_json=self._json_errors)
            sys.exit(EXIT_INTERRUPTED)


def _global_options_first(arguments: list[str]) -> list[str]:
    """``arguments`` with ``--debug`` moved before the command wherever it was typed (``kvsnap
    verify FILE --debug`` means what ``kvsnap --debug verify FILE`` does); after ``--`` it is
    an argument and stays."""
    end = arguments.index("--") if "--" in arguments else len(arguments)
    if "--debug" not in arguments[:end]:
        return arguments
    rest = [argument for argument in arguments[:end] if argument != "--debug"]
    return ["--debug", *rest, *arguments[end:]]


def _each_sentence_once(message: str) -> str:
    """``message`` without repeated sentences (typer and click both add "Did you mean ...?",
    click in parentheses and in other words when there are several candidates)."""
    sentences = re.split(r"(?<=[.?!])\s+", message.strip())
    text = " ".join(dict.fromkeys(sentences))
    suggestion = re.compile(r"\s*\(Did you mean[^)]*\)")
    if "Did you mean" in suggestion.sub("", text):
        text = suggestion.sub("", text)
    return text


def _command_path(error: click.ClickException) -> str:
    context = getattr(error, "ctx", None)
    return context.command_path if context is not None else ""


app = typer.Typer(
    name="kvsnap",
    cls=KVSnapGroup,
    help="Snapshot an LLM's KV cache to disk and restore it: fast, bit-exact, refusing cleanly.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version_callback(value: bool) -> None:
    if value:
        stdout.print(f"kvsnap {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    debug: Annotated[
        bool, typer.Option("--debug", help="Show full tracebacks for errors.")
    ] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version_callback, is_eager=True, help="Print the version."
        ),
    ] = False,
) -> None:
    """kvsnap: capture → inspect → verify → restore KV cache snapshots."""
    settings.debug = debug


for _command in (capture, inspect, verify, diff, restore, fixture, bench, convert, export):
    app.command()(handle_errors(_command))
app.add_typer(store_app, name="store")


def main() -> None:
    """Console-script entry point (``kvsnap``, ``python -m kvsnap.cli``)."""
    app(prog_name="kvsnap")


if __name__ == "__main__":
    main()
