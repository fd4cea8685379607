"""A slow disk, for the tests of what a shutdown does with saves still being written: every
``os.fsync`` of a file or directory under a given folder waits ``delay_s`` seconds first.

kvsnap's writers call ``os.fsync`` through the ``os`` module (a file before its rename, the
directory after it), so replacing the module's function delays every publish into the folder,
on every thread, and nothing else the process syncs. :func:`slow_down_fsync_everywhere` also
reaches the Python processes started later, forked or spawned (vLLM's CPU platform spawns its
engine core and workers), through ``slow_disk/sitecustomize.py``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

#: The ``os.fsync`` this module replaces.
REAL_FSYNC = os.fsync
#: The delay and the slow folder, for processes started with ``slow_disk`` on their
#: ``PYTHONPATH``.
FSYNC_DELAY_ENV = "KVSNAP_TEST_FSYNC_DELAY_S"
SLOW_FOLDER_ENV = "KVSNAP_TEST_SLOW_FOLDER"
#: The folder whose ``sitecustomize`` slows down a process as it starts.
SLOW_DISK = Path(__file__).resolve().parent / "slow_disk"


def delayed_fsync(
    delay_s: float, folder: str | os.PathLike[str], began: threading.Event | None = None
) -> Callable[[int], None]:
    """An ``os.fsync`` that sleeps ``delay_s`` seconds before flushing a file or directory
    under ``folder`` (the folder itself included), and flushes anything else at once; sets
    ``began`` (when given) as a delayed fsync starts."""
    root = os.path.realpath(folder)

    def fsync(fd: int) -> None:
        target = os.path.realpath(f"/proc/self/fd/{fd}")
        if target == root or target.startswith(root + os.sep):
            if began is not None:
                began.set()
            time.sleep(delay_s)
        REAL_FSYNC(fd)

    return fsync


def slow_down_fsync(delay_s: float, folder: str | os.PathLike[str]) -> None:
    """Make every later ``os.fsync`` of this process (and of the processes it forks) under
    ``folder`` wait ``delay_s`` seconds first."""
    os.fsync = delayed_fsync(delay_s, folder)


def slow_down_fsync_everywhere(delay_s: float, folder: str | os.PathLike[str]) -> None:
    """:func:`slow_down_fsync` in this process and in every Python process it starts later
    (they inherit the environment that makes ``slow_disk/sitecustomize.py`` do the same)."""
    os.environ[FSYNC_DELAY_ENV] = str(delay_s)
    os.environ[SLOW_FOLDER_ENV] = os.fspath(folder)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(SLOW_DISK), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    slow_down_fsync(delay_s, folder)
