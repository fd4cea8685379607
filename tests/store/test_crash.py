"""Writers killed with SIGKILL at random moments never leave a snapshot that verifies but is
incomplete or wrong, and the snapshot previously at the path survives intact."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvsnap import format as fmt
from kvsnap.errors import KVSnapError
from kvsnap.store import SnapshotReader
from tests.support.store_crash_child import snapshot_data, write_and_maybe_die
from tests.support.store_helpers import write_snapshot

OLD_SEED = 1000


@pytest.fixture(scope="module")
def forkserver() -> multiprocessing.context.ForkServerContext:
    """A forkserver with kvsnap and the child preloaded: children start in milliseconds.

    pytest is preloaded too: every child re-runs the main module (pytest's entry point), which
    is cheap only when pytest is already imported.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["pytest", "kvsnap.store", "tests.support.store_crash_child"])
    return context


def contents(url: str | Path) -> tuple[fmt.SnapshotMetadata, dict[str, bytes]] | None:
    """Metadata and KV bytes of a snapshot that opens and verifies cleanly, else ``None``."""
    try:
        with SnapshotReader(url) as reader:
            if reader.verify():
                return None
            kv = {
                name: reader.read_tensor(name).view(torch.uint8).numpy().tobytes()
                for name in reader.metadata.geometry.tensor_names()
            }
            return reader.metadata, kv
    except KVSnapError:
        return None


def expected(geometry: str, seed: int) -> tuple[fmt.SnapshotMetadata, dict[str, bytes]]:
    metadata, pages = snapshot_data(geometry, seed)
    return metadata, {name: data.tobytes() for name, data in pages.items()}


def run_child(
    context: Any,
    path: Path,
    geometry: str,
    seed: int,
    kill: tuple[Any, ...] | None,
    kill_after_s: float | None,
) -> int | None:
    """Run one writer; SIGKILL it after ``kill_after_s`` unless it ended. Returns its exit code."""
    child = context.Process(
        target=write_and_maybe_die, args=(str(path), geometry, seed, kill, None)
    )
    child.start()
    child.join(kill_after_s)
    # A child that dies at its own kill point between the two calls is already reaped by the
    # fork server; Process.kill tolerates that, a bare os.kill would not.
    if child.is_alive():
        child.kill()
    child.join(30)
    return child.exitcode


KILL_POINTS: list[tuple[Any, ...] | None] = [
    ("call", "_pwrite_all", 0, False),  # before the header
    ("call", "_pwrite_all", 1, True),  # header written
    ("bytes", 1),  # first data chunk written
    ("bytes", 60_000),  # mid-data
    ("call", "fsync", 0, False),  # everything written, nothing synced
    ("call", "fsync", 0, True),  # synced, not renamed
    ("call", "replace", 0, False),  # just before the rename
    ("call", "replace", 0, True),  # renamed, directory not synced
    ("call", "_fsync_directory", 0, True),  # published
    None,  # completes unless the parent's timer strikes first
]


@pytest.mark.parametrize("geometry", ["bf16", "f16-32k"])
def test_sigkill_at_any_moment_leaves_old_or_new_snapshot(
    forkserver: Any, tmp_path: Path, geometry: str
) -> None:
    path = tmp_path / "snap.safetensors"
    old_meta, old_pages = snapshot_data(geometry, OLD_SEED)
    write_snapshot(path, old_meta, old_pages)
    old_bytes = path.read_bytes()
    old = expected(geometry, OLD_SEED)
    rng = np.random.default_rng(7 if geometry == "bf16" else 8)
    # How long one uninterrupted write takes here, to spread the random kills over it.
    started = time.perf_counter()
    assert run_child(forkserver, tmp_path / "timing.safetensors", geometry, 1, None, None) == 0
    duration = time.perf_counter() - started
    outcomes: Counter[str] = Counter()
    runs = 30
    for run in range(runs):
        seed = OLD_SEED + 1 + run
        path.write_bytes(old_bytes)
        kill = KILL_POINTS[run % len(KILL_POINTS)]
        # Half the runs die at a chosen point, all of them may also die at a random instant.
        timer = float(rng.uniform(0, 1.2 * duration)) if run % 2 else None
        exit_code = run_child(forkserver, path, geometry, seed, kill, timer)
        new = expected(geometry, seed)
        found = contents(path)
        assert found is not None, (
            f"run {run} ({kill}, timer {timer}): the snapshot at the path is gone or broken"
        )
        assert found in (old, new), (
            f"run {run}: the snapshot at the path verifies but holds wrong data"
        )
        if exit_code == 0:
            assert found == new, (
                f"run {run}: the writer finished but the old snapshot is still there"
            )
        outcomes["new" if found == new else "old"] += 1
        outcomes[f"exit {exit_code}"] += 1
        # Leftover temporary files are never published; any that verifies is the complete new one.
        for name in os.listdir(tmp_path):
            if ".kvsnap-tmp-" in name:
                leftover = contents(tmp_path / name)
                assert leftover in (None, new), (
                    f"run {run}: a temporary file verifies with wrong data"
                )
                outcomes["temp verifies" if leftover else "temp broken"] += 1
                os.unlink(tmp_path / name)
    assert outcomes["old"] >= 8 and outcomes["new"] >= 3, outcomes
    assert outcomes[f"exit {-signal.SIGKILL}"] >= runs // 2, outcomes


def test_sigkill_during_a_sharded_overwrite_is_never_silently_wrong(
    forkserver: Any, tmp_path: Path
) -> None:
    """Overwriting a sharded snapshot with one of the same shape renames shard after shard under
    new (generation-stamped) names, then the index, the single commit point. A crash before the
    index's rename leaves the old snapshot intact, after it the new one: never a blend, never
    a refusal."""
    geometry = "bf16"
    path = tmp_path / "snap.safetensors"
    old_meta, old_pages = snapshot_data(geometry, OLD_SEED)
    limit = max(p.nbytes for p in old_pages.values()) + 100
    info = write_snapshot(path, old_meta, old_pages, max_shard_bytes=limit)
    saved = {name: Path(name).read_bytes() for name in (*info.files, info.path)}
    old = expected(geometry, OLD_SEED)
    renames = len(info.files) + 1  # every shard, then the index
    outcomes: Counter[str] = Counter()
    for nth in range(renames):
        for after in (False, True):
            for name, data in saved.items():
                Path(name).write_bytes(data)
            pages_seed = 5000 + 2 * nth + after  # same metadata and shapes, other KV bytes
            _, pages = snapshot_data(geometry, OLD_SEED, pages_seed)
            new = (old_meta, {name: data.tobytes() for name, data in pages.items()})
            kill = ("call", "replace", nth, after)
            child = forkserver.Process(
                target=write_and_maybe_die,
                args=(str(path), geometry, OLD_SEED, kill, limit, pages_seed),
            )
            child.start()
            child.join(30)
            assert child.exitcode == -signal.SIGKILL
            found = contents(info.path)
            assert found in (None, old, new), f"rename {nth} (after={after}): a blend verifies"
            outcome = "refused" if found is None else "old" if found == old else "new"
            outcomes[outcome] += 1
            published = nth == renames - 1 and after  # the index's rename happened
            assert outcome == ("new" if published else "old"), (nth, after, outcome)
            for name in os.listdir(tmp_path):
                if ".kvsnap-tmp-" in name:
                    os.unlink(tmp_path / name)
    assert outcomes == Counter({"old": 2 * renames - 1, "new": 1}), outcomes
