"""The ``kvsnap`` command line (``kvsnap.cli.app:main``), one module per command."""
