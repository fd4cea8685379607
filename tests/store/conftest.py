"""Fixtures the store tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.store_helpers import build, write_snapshot


@pytest.fixture
def old_snapshot(tmp_path: Path) -> tuple[Path, bytes]:
    metadata, pages = build("bf16", seed=20)
    path = tmp_path / "snap.safetensors"
    write_snapshot(path, metadata, pages)
    return path, path.read_bytes()
