"""``python -m kvsnap.cli``: the ``kvsnap`` command line."""

from kvsnap.cli.app import main

main()
