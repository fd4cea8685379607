"""Opens counted and files rewritten behind a reader's back: for the tests of snapshots kept
open between uses (``kvsnap.engines.open_snapshots``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvsnap.snapshot import Snapshot


def count_snapshot_opens(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths ``Snapshot.open`` is called for from here on (it still opens them)."""
    opened: list[str] = []
    real = Snapshot.open

    def counting(path: Any, **options: Any) -> Snapshot:
        opened.append(str(path))
        return real(path, **options)

    monkeypatch.setattr(Snapshot, "open", counting)
    return opened


def rewrite_in_place_keeping_times(path: Path, *, flip: bool) -> None:
    """Write the file's bytes back in place (the same inode and size), with a byte in the middle
    of its first layer's keys flipped when ``flip``, then put the modification time back: only
    the change time tells the rewrite."""
    status = path.stat()
    data = bytearray(path.read_bytes())
    if flip:
        header_size = int.from_bytes(data[:8], "little")
        begin, end = json.loads(data[8 : 8 + header_size])["layers.0.key"]["data_offsets"]
        data[8 + header_size + (begin + end) // 2] ^= 0x5A
    with open(path, "r+b") as file:
        file.write(bytes(data))
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (status.st_ino, status.st_mtime_ns)
