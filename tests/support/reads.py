"""The reads a test makes: every ``os.preadv`` recorded as ``(offset, bytes asked)``."""

from __future__ import annotations

import os

import pytest


def record_preadv(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Record every ``os.preadv`` from here on (it still reads): the list fills as they run."""
    reads: list[tuple[int, int]] = []
    real = os.preadv

    def recording(fd: int, buffers: list[memoryview], offset: int) -> int:
        reads.append((offset, sum(len(b) for b in buffers)))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", recording)
    return reads
