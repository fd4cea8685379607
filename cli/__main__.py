"""``python -m kvsnap.cli`` (installed), or ``python -m cli`` from an uninstalled source tree."""

from .app import main

main()
