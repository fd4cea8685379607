"""``python -m kvsnap_cli`` (installed) or ``python -m cli`` (from a source tree): the CLI."""

from .app import app

app(prog_name="kvsnap")
