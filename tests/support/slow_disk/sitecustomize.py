"""Python imports this module at start-up in every process whose ``PYTHONPATH`` names this
folder: with ``KVSNAP_TEST_FSYNC_DELAY_S`` set, every ``fsync`` of the process under the folder
``KVSNAP_TEST_SLOW_FOLDER`` waits that many seconds (``tests/support/slow_fsync.py``). It is
how the slow disk reaches processes a test does not start itself, such as vLLM's engine core
and workers, which vLLM's CPU platform starts with ``spawn``."""

from __future__ import annotations

import os

if os.environ.get("KVSNAP_TEST_FSYNC_DELAY_S"):
    from tests.support.slow_fsync import slow_down_fsync

    slow_down_fsync(
        float(os.environ["KVSNAP_TEST_FSYNC_DELAY_S"]), os.environ["KVSNAP_TEST_SLOW_FOLDER"]
    )
