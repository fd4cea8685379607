"""Who may write a prefix store: private directories and files, refused shared ones."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from kvsnap.engines.vllm import (
    CacheIdentity,
    PrefixStore,
    check_store_directory,
    chunk_sequence_id,
    store_key_chain,
    store_namespace,
)
from kvsnap.engines.vllm.prefix_store import DEFAULT_CHUNK_BLOCKS
from kvsnap.layout import vllm_split_layout
from kvsnap.snapshot import SequenceBlocks, capture
from kvsnap.store.files.publish import file_mode

BLOCK = 4
GEOMETRY = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": BLOCK}


@pytest.fixture
def loose_umask():
    """The common default umask, which alone would leave files world-readable."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_store_is_private_and_so_is_everything_written_in_it(
    tmp_path: Path, loose_umask: None
) -> None:
    root = check_store_directory(tmp_path / "store", shared=False, signed=False)
    assert _mode(root) == 0o700
    store = PrefixStore(root, "ns", chunk_blocks=2)
    tokens = np.arange(2 * BLOCK)
    chain = store_key_chain(tokens, BLOCK, CacheIdentity())
    path = store.chunk_path(chain[1])
    store.chunk_directory(path)
    caches = [torch.randn(4, 2, BLOCK, 2, 8, dtype=torch.bfloat16) for _ in range(2)]
    layout = vllm_split_layout(caches)
    sequence = SequenceBlocks(chunk_sequence_id(0, None, chain[1]), tokens, np.array([0, 1]))
    capture(layout, [sequence], path)
    assert _mode(path) == 0o600
    for directory in (path.parent, path.parent.parent, path.parent.parent.parent):
        assert _mode(directory) == 0o700, directory
    moved = store.quarantine(path)
    assert moved is not None and _mode(moved.parent) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_store_other_users_can_write_is_refused_saying_how_to_fix_it(
    tmp_path: Path, mode: int
) -> None:
    root = tmp_path / "store"
    root.mkdir()
    root.chmod(mode)
    with pytest.raises(PermissionError, match=f"writable by other users \\(mode {mode:o}\\)"):
        check_store_directory(root, shared=False, signed=True)
    with pytest.raises(PermissionError, match="chmod 700"):
        check_store_directory(root, shared=False, signed=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_a_store_another_user_owns_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    os.chown(root, 65534, 65534)
    with pytest.raises(PermissionError, match="belongs to user id 65534"):
        check_store_directory(root, shared=False, signed=False)


def test_a_shared_store_is_accepted_only_with_a_key(tmp_path: Path, loose_umask: None) -> None:
    root = tmp_path / "store"
    root.mkdir()
    root.chmod(0o770)
    with pytest.raises(PermissionError, match="needs a signing key"):
        check_store_directory(root, shared=True, signed=False)
    assert check_store_directory(root, shared=True, signed=True) == root
    # A shared store's directories keep its group bits, whatever the umask.
    store = PrefixStore(root, "ns")
    directory = store.chunk_directory(store.chunks / "ab" / ("ab" * 32 + ".safetensors"))
    assert _mode(directory) == 0o770


def test_new_files_grant_no_more_than_their_directory(tmp_path: Path) -> None:
    for directory_mode, expected in [(0o700, 0o600), (0o750, 0o640), (0o755, 0o644)]:
        directory = tmp_path / f"{directory_mode:o}"
        directory.mkdir()
        directory.chmod(directory_mode)
        assert file_mode(str(directory)) == expected


def test_the_namespace_separates_models_and_every_geometry_field() -> None:
    base = store_namespace("ab" * 16, {**GEOMETRY, "dtype": "bfloat16"})
    assert base.startswith("abababababababab-bfloat16-b4-g")
    assert store_namespace("cd" * 16, {**GEOMETRY, "dtype": "bfloat16"}) != base
    for field, value in [("num_layers", 3), ("num_kv_heads", 1), ("head_dim", 16)]:
        changed = store_namespace("ab" * 16, {**GEOMETRY, "dtype": "bfloat16", field: value})
        assert changed != base, field
    assert store_namespace("ab" * 16, {**GEOMETRY, "dtype": "float16"}) != base


def test_the_namespace_separates_chunk_sizes_and_keeps_the_default_s_name() -> None:
    geometry = {**GEOMETRY, "dtype": "bfloat16"}
    default = store_namespace("ab" * 16, geometry)
    # The default chunk size's name is the name stores were written under before the size
    # was part of it: those stores keep their chunks.
    assert re.fullmatch(r"abababababababab-bfloat16-b4-g[0-9a-f]{8}", default)
    assert store_namespace("ab" * 16, geometry, DEFAULT_CHUNK_BLOCKS) == default
    assert store_namespace("ab" * 16, geometry, 48) == f"{default}-c48"
    assert store_namespace("ab" * 16, geometry, 8) != store_namespace("ab" * 16, geometry, 48)


def test_chunk_names_are_sha256_store_keys(tmp_path: Path) -> None:
    store = PrefixStore(tmp_path, "ns")
    with pytest.raises(ValueError, match="64 hex digits"):
        store.chunk_path("ab" * 16)  # an xxh3-128 name of the old scheme
    key = store_key_chain(np.arange(4), BLOCK, CacheIdentity())[0]
    assert store.chunk_path(key).name == f"{key}.safetensors"
