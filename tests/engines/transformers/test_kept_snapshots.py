"""Restores from a path keep the snapshot open for the next restore of the same file, and serve
a kept one only while the path names the version that was opened: a snapshot replaced by a
rename is read as the new one, a rewrite in place is opened anew (and a changed byte refused),
a removed file is missing, and a restore that failed keeps nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import kvsnap
from kvsnap.engines import transformers as kt
from kvsnap.engines.default_model import build_default_model
from kvsnap.engines.transformers import model as model_module
from kvsnap.errors import SnapshotCorruptError, SnapshotIOError
from tests.support.dynamic_caches import same_kv
from tests.support.file_versions import count_snapshot_opens, rewrite_in_place_keeping_times


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_default_model()


@pytest.fixture(autouse=True)
def _no_kept_snapshots() -> Any:
    model_module.KEPT_SNAPSHOTS.clear()
    yield
    model_module.KEPT_SNAPSHOTS.clear()


def _captured(model: torch.nn.Module, path: Path, seed: int, tokens: int = 40) -> Any:
    ids = torch.randint(
        0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed)
    )
    cache, token_ids = kt.prefill_token_ids(model, [ids.tolist()])[0]
    kt.capture_dynamic_cache(cache, [token_ids], path, model=model)
    return cache, token_ids


def test_a_second_restore_of_a_file_opens_nothing_and_is_bit_exact(
    model: torch.nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "prompt.safetensors"
    cache, token_ids = _captured(model, path, seed=1)
    opened = count_snapshot_opens(monkeypatch)
    for _ in range(3):
        restored, restored_ids = kt.restore_dynamic_cache(path, model=model)
        assert restored_ids == token_ids and same_kv(restored, cache)
    assert opened == [str(path)]
    assert len(model_module.KEPT_SNAPSHOTS) == 1
    kvsnap.clear_caches()
    assert len(model_module.KEPT_SNAPSHOTS) == 0


def test_a_snapshot_replaced_by_a_rename_is_read_as_the_new_one(
    model: torch.nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "prompt.safetensors"
    _captured(model, path, seed=1)
    kt.restore_dynamic_cache(path, model=model)
    # capture publishes by a rename over the old name: a new inode, the same size.
    cache, token_ids = _captured(model, path, seed=2)
    opened = count_snapshot_opens(monkeypatch)
    restored, restored_ids = kt.restore_dynamic_cache(path, model=model)
    assert opened == [str(path)]
    assert restored_ids == token_ids and same_kv(restored, cache)


def test_a_rewrite_in_place_is_opened_anew_and_a_changed_byte_refused(
    model: torch.nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "prompt.safetensors"
    cache, _ = _captured(model, path, seed=3)
    kt.restore_dynamic_cache(path, model=model)
    opened = count_snapshot_opens(monkeypatch)
    rewrite_in_place_keeping_times(path, flip=False)
    restored, _ = kt.restore_dynamic_cache(path, model=model)
    assert opened == [str(path)], "the change time moved: another version"
    assert same_kv(restored, cache)
    rewrite_in_place_keeping_times(path, flip=True)
    with pytest.raises(SnapshotCorruptError):
        kt.restore_dynamic_cache(path, model=model)
    assert opened == [str(path)] * 2
    assert len(model_module.KEPT_SNAPSHOTS) == 0, "a restore that failed keeps nothing"


def test_a_removed_snapshot_is_missing_and_its_descriptor_closed(
    model: torch.nn.Module, tmp_path: Path
) -> None:
    path = tmp_path / "prompt.safetensors"
    _captured(model, path, seed=4)
    kt.restore_dynamic_cache(path, model=model)
    assert len(model_module.KEPT_SNAPSHOTS) == 1
    path.unlink()
    with pytest.raises(SnapshotIOError):
        kt.restore_dynamic_cache(path, model=model)
    assert len(model_module.KEPT_SNAPSHOTS) == 0
    # Removed while another file is restored: its descriptor (holding the file's space) is
    # closed by that restore.
    other = tmp_path / "other.safetensors"
    _captured(model, path, seed=5)
    _captured(model, other, seed=6)
    kt.restore_dynamic_cache(path, model=model)
    path.unlink()
    kt.restore_dynamic_cache(other, model=model)
    assert len(model_module.KEPT_SNAPSHOTS) == 1
    assert model_module.KEPT_SNAPSHOTS.take(str(other), None) is not None
