"""A slow disk, for the tests of what a shutdown does with saves still being written: every
``os.fsync`` of the process waits ``delay_s`` seconds before it runs.

kvsnap's writers call ``os.fsync`` through the ``os`` module (a file before its rename, the
directory after it), so replacing the module's function delays every publish of the process,
on every thread, and processes forked from it inherit the delay (vLLM forks its engine core
and workers).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

#: The ``os.fsync`` this module replaces.
REAL_FSYNC = os.fsync


def delayed_fsync(delay_s: float) -> Callable[[int], None]:
    """An ``os.fsync`` that sleeps ``delay_s`` seconds, then flushes the file for real."""

    def fsync(fd: int) -> None:
        time.sleep(delay_s)
        REAL_FSYNC(fd)

    return fsync


def slow_down_fsync(delay_s: float) -> None:
    """Make every later ``os.fsync`` of this process (and of the processes it forks) wait
    ``delay_s`` seconds first."""
    os.fsync = delayed_fsync(delay_s)
