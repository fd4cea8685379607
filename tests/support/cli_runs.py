"""The kvsnap CLI run in the test's own process, seen as a shell sees it: exit code, stdout, stderr.

A ``python -m kvsnap.cli`` child pays a fresh interpreter, kvsnap and, for most foreign formats
and every comparison, torch before the command starts: 1 to 3 s a call on a 2-core VM, where a
test of a command's messages makes several calls. Here the command runs through the app's own
``main`` (Typer's runner calls it, named ``kvsnap``), so its one-line errors and exit codes are
the entry point's; an exception the CLI leaves uncaught is raised into the test
(``catch_exceptions=False``) instead of becoming an exit code 1 that a test could take for a
reported error. What only a real process shows is tested with real processes: the imports a
command pays (``tests/cli/test_startup.py``), Ctrl-C (``tests/store/test_interrupt.py``), the
installed entry point and ``python -m`` (``tests/cli/test_cli.py``; a foreign format through
``python -m kvsnap.cli`` in ``tests/foreign/test_vllm_fs.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from typer.testing import CliRunner

from kvsnap.cli.app import app
from kvsnap.store.files.keys import new_key_text


def new_key_file(path: Path) -> Path:
    """A new signing key written to ``path`` as ``--key-file`` reads it (owner-only, as
    kvsnap requires of a key file); ``path``."""
    path.write_text(new_key_text() + "\n")
    path.chmod(0o600)
    return path


@dataclass(frozen=True)
class CliRun:
    """What a shell would see of one ``kvsnap`` command."""

    returncode: int
    stdout: str
    stderr: str


def run_kvsnap(*args: str) -> CliRun:
    """Run ``kvsnap ARGS`` in this process."""
    result = CliRunner().invoke(app, list(args), prog_name="kvsnap", catch_exceptions=False)
    return CliRun(result.exit_code, result.stdout, result.stderr)
