"""Spare capture files (``store/spare_files.py``) and the release of mappings after the publish
(``store/mapping_release.py``), on real files in /dev/shm and on small mounted tmpfs.

A mapped write (``map_for_device``) that publishes leaves a spare temporary file in its
directory, made in the background; the next mapped write there takes it instead of making its
own file, and its snapshot is the written snapshot byte for byte. CPU machines have no CUDA:
the host copies into the mapping here (``register=False``) and spares are populated, not
registered; tests/pipeline/test_capture_dma.py takes them with the device's copies.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvsnap
from kvsnap.snapshot import Snapshot
from kvsnap.store import SnapshotReader
from kvsnap.store.base import tuning
from kvsnap.store.base.pools import shared_executor
from kvsnap.store.files import publish
from kvsnap.store.hot import mapping_release, spare_files
from kvsnap.store.hot.mapped_file import MappedFile
from kvsnap.store.hot.spare_files import SPARE_SIZE_STEP
from tests.support.store_helpers import (
    build,
    mounted_tmpfs,
    spare_names,
    temp_files,
    write_mapped,
    write_snapshot,
)

pytestmark = pytest.mark.usefixtures("mapped_from_any_size", "spare_capture_files")

REPO = Path(__file__).resolve().parents[2]


def _traced_write(path: Path, metadata, pages) -> list[str]:
    kinds: list[str] = []
    write_mapped(path, metadata, pages, trace=lambda kind, *_: kinds.append(kind))
    return kinds


def _sizes(*snapshots) -> list[int]:
    """The file size of each ``(metadata, pages)`` as a snapshot."""
    from kvsnap import format as fmt

    return [fmt.file_layouts(metadata)[0].file_size for metadata, _ in snapshots]


def test_the_next_mapped_write_takes_the_spare_and_writes_the_same_bytes(shm_dir: Path) -> None:
    first = build("f16-32k", seed=61, extra_blocks=3)
    second = build("f16-32k", seed=62)
    assert _sizes(second)[0] < _sizes(first)[0]  # the spare is cut down to the second file
    kinds = _traced_write(shm_dir / "a.safetensors", *first)
    assert "setup.map.populate" in kinds and "setup.map.spare" not in kinds
    [spare] = spare_names(shm_dir)
    assert spare.startswith(".a.safetensors.kvsnap-tmp-")
    spare_size = (shm_dir / spare).stat().st_size
    assert spare_size == -(-_sizes(first)[0] // SPARE_SIZE_STEP) * SPARE_SIZE_STEP

    kinds = _traced_write(shm_dir / "b.safetensors", *second)
    assert "setup.map.spare" in kinds and "setup.map.populate" not in kinds
    assert not (shm_dir / spare).exists()  # taken: renamed and published as b
    written = shm_dir / "written.safetensors"
    write_snapshot(written, *second)
    assert (shm_dir / "b.safetensors").read_bytes() == written.read_bytes()
    with SnapshotReader(shm_dir / "b.safetensors") as reader:
        assert reader.verify() == []
    # b's spare fits b's size: the spare of a (taken) is replaced, one per directory.
    [after] = spare_names(shm_dir)
    assert after.startswith(".b.safetensors.kvsnap-tmp-")
    assert temp_files(shm_dir) == []


def test_a_capture_too_large_for_the_spare_makes_its_own_file(shm_dir: Path) -> None:
    small = build("f16-32k", seed=63)
    large = build("f16-32k", seed=64, extra_blocks=SPARE_SIZE_STEP // (32 << 10) + 8)
    assert _sizes(large)[0] > -(-_sizes(small)[0] // SPARE_SIZE_STEP) * SPARE_SIZE_STEP
    _traced_write(shm_dir / "small.safetensors", *small)
    [spare] = spare_names(shm_dir)
    kinds = _traced_write(shm_dir / "large.safetensors", *large)
    assert "setup.map.spare" not in kinds and "setup.map.populate" in kinds
    written = shm_dir / "written.safetensors"
    write_snapshot(written, *large)
    assert (shm_dir / "large.safetensors").read_bytes() == written.read_bytes()
    # The small spare made way for one that fits the large capture.
    [after] = spare_names(shm_dir)
    assert after != spare and not (shm_dir / spare).exists()
    assert (shm_dir / after).stat().st_size >= _sizes(large)[0]


def test_a_spare_removed_by_hand_is_replaced_by_a_file_of_its_own(shm_dir: Path) -> None:
    write_mapped(shm_dir / "a.safetensors", *build("f16-32k", seed=77))
    [spare] = spare_names(shm_dir)
    (shm_dir / spare).unlink()  # someone removes it; this process still holds it as a spare
    second = build("f16-32k", seed=78)
    kinds = _traced_write(shm_dir / "b.safetensors", *second)
    assert "setup.map.populate" in kinds  # the file was made as usual, and mapped
    write_snapshot(shm_dir / "written.safetensors", *second)
    assert (shm_dir / "b.safetensors").read_bytes() == (
        shm_dir / "written.safetensors"
    ).read_bytes()


def test_a_spare_is_never_a_snapshot(shm_dir: Path) -> None:
    snapshot = build("f16-32k", seed=65)
    path = shm_dir / "snap.safetensors"
    write_mapped(path, *snapshot)
    published = path.read_bytes()
    [spare] = spare_names(shm_dir)
    spare_path = shm_dir / spare
    # A live writer's temporary file: locked, left alone by every cleanup of the name.
    assert publish.leftover_status(str(spare_path)) is None
    owns = publish.remove_dead_temps(str(shm_dir), lambda name: True, "snap")
    assert owns == [] and spare_path.exists()
    # Writing the same snapshot again (a writer cleans up its name's dead temporaries first)
    # leaves the spare, and the path names the published file, never the spare.
    write_snapshot(path, *snapshot)
    assert path.read_bytes() == published
    with Snapshot.open(path) as snap:
        assert snap.verify() == []
    assert sorted(os.listdir(shm_dir)) == sorted(["snap.safetensors", spare])


def test_clear_caches_removes_the_spares(shm_dir: Path) -> None:
    write_mapped(shm_dir / "snap.safetensors", *build("f16-32k", seed=66))
    [spare] = spare_names(shm_dir)
    held, registered = spare_files.spare_files().held_bytes()
    assert held == (shm_dir / spare).stat().st_size and registered == 0  # no CUDA here
    kvsnap.clear_caches()
    assert os.listdir(shm_dir) == ["snap.safetensors"]
    assert spare_files.spare_files().held_bytes() == (0, 0)


def test_a_spare_replaced_while_its_successor_waits_is_removed_when_dropped(
    shm_dir: Path,
) -> None:
    """A larger capture replaces the directory's spare: the old one is removed by the task
    that makes the new one. Dropped while that task still waits its turn, the task still
    runs, removes the old spare, and makes nothing."""
    import threading

    write_mapped(shm_dir / "small.safetensors", *build("f16-32k", seed=79))
    [old] = spare_names(shm_dir)
    turn = threading.Event()
    blocker = shared_executor("spare", 1).submit(turn.wait)
    large = build("f16-32k", seed=80, extra_blocks=SPARE_SIZE_STEP // (32 << 10) + 8)
    write_mapped(shm_dir / "large.safetensors", *large)  # the old spare does not fit it
    dropping = threading.Thread(
        target=spare_files.spare_files().drop, kwargs={"under": str(shm_dir)}
    )
    dropping.start()
    try:
        time.sleep(0.2)
        assert (shm_dir / old).exists() and dropping.is_alive()  # waits for the task's turn
    finally:
        turn.set()  # a failure here must not leave the spare pool's thread blocked
        dropping.join(30)
        blocker.result()
    assert sorted(os.listdir(shm_dir)) == ["large.safetensors", "small.safetensors"]
    assert spare_files.spare_files().held_bytes() == (0, 0)


def test_no_spares_when_the_bound_is_zero(shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tuning, "SPARE_CAPTURE_FILES_BYTES", 0)
    write_mapped(shm_dir / "snap.safetensors", *build("f16-32k", seed=67))
    assert spare_names(shm_dir) == [] and os.listdir(shm_dir) == ["snap.safetensors"]


def test_mappings_are_released_after_the_publish_and_counted_until_then(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mapping is unmapped on the background pool once the file is published; until then
    its bytes count as pending. Past the bound the writer releases its own mapping."""
    monkeypatch.setattr(tuning, "SPARE_CAPTURE_FILES_BYTES", 0)
    real_close = MappedFile.close
    closing: list[str] = []

    def slow_close(mapped: MappedFile) -> None:
        time.sleep(0.3)
        closing.append(threading_name())
        real_close(mapped)

    monkeypatch.setattr(MappedFile, "close", slow_close)
    metadata, pages = build("f16-32k", seed=68)
    size = _sizes((metadata, pages))[0]
    write_mapped(shm_dir / "later.safetensors", metadata, pages)
    assert mapping_release.pending_bytes() == (size, 0)  # queued, not registered (no CUDA)
    mapping_release.wait_for_releases()
    assert mapping_release.pending_bytes() == (0, 0)
    assert closing == ["kvsnap-release"]
    monkeypatch.setattr(tuning, "PENDING_RELEASE_BYTES", size - 1)
    write_mapped(shm_dir / "now.safetensors", metadata, pages)
    assert mapping_release.pending_bytes() == (0, 0)
    assert closing == ["kvsnap-release", "MainThread"]
    for name in ("later", "now"):
        with SnapshotReader(shm_dir / f"{name}.safetensors") as reader:
            assert reader.verify() == []


def threading_name() -> str:
    import threading

    return threading.current_thread().name.split("_")[0]


_EXIT_CHILD = textwrap.dedent(
    """
    import sys, time
    from kvsnap.store.base import tuning
    from kvsnap.store.hot.mapped_file import MappedFile
    from kvsnap.store.hot.spare_files import spare_files
    from tests.support.store_helpers import build, write_mapped

    tuning.MAPPED_WRITE_MIN_BYTES = 0
    tuning.SPARE_CAPTURE_FILES_BYTES = 2 << 30
    directory, marker = sys.argv[1], sys.argv[2]
    real_close = MappedFile.close

    def slow_close(mapped):
        if mapped.size != int(sys.argv[3]):
            return real_close(mapped)  # the spare's, at exit
        time.sleep(1.0)
        real_close(mapped)
        open(marker, "w").close()

    MappedFile.close = slow_close
    write_mapped(directory + "/snap.safetensors", *build("f16-32k", seed=69))
    spare_files().wait()
    print(len(spare_files().paths()), flush=True)
    """
)


def test_exit_finishes_the_releases_and_removes_the_spares(shm_dir: Path) -> None:
    """A process that exits right after a mapped write: its release (slowed to 1 s) still
    runs to its end, and its spare file is removed."""
    marker = shm_dir / "released"
    size = _sizes(build("f16-32k", seed=69))[0]
    child = subprocess.run(
        [sys.executable, "-c", _EXIT_CHILD, str(shm_dir), str(marker), str(size)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "1"  # it had a spare when it exited
    assert marker.exists()
    assert sorted(os.listdir(shm_dir)) == ["released", "snap.safetensors"]


def _write_and_die_while_making_the_spare(path: str) -> None:
    """Child: a mapped write whose spare's populating SIGKILLs the process."""
    import threading

    tuning.MAPPED_WRITE_MIN_BYTES = 0
    tuning.SPARE_CAPTURE_FILES_BYTES = 2 << 30
    real_populate = MappedFile.populate

    def populate(mapped: MappedFile, executor, threads: int) -> bool:
        if threading.current_thread().name.startswith("kvsnap-spare"):
            os.kill(os.getpid(), signal.SIGKILL)
        return real_populate(mapped, executor, threads)

    MappedFile.populate = populate  # type: ignore[method-assign]
    write_mapped(path, *build("f16-32k", seed=70))
    time.sleep(60)  # killed by the spare's task before this ends


def test_a_process_killed_while_making_a_spare_leaves_only_a_dead_temporary(
    shm_dir: Path,
) -> None:
    path = shm_dir / "snap.safetensors"
    child = multiprocessing.get_context("fork").Process(
        target=_write_and_die_while_making_the_spare, args=(str(path),)
    )
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    [leftover] = temp_files(shm_dir)
    assert leftover.startswith(".snap.safetensors.kvsnap-tmp-")
    assert publish.leftover_status(str(shm_dir / leftover)) is not None  # a dead writer's
    with SnapshotReader(path) as reader:
        assert reader.verify() == []
    # The next write of the snapshot removes it, as any dead writer's temporary file.
    write_snapshot(path, *build("f16-32k", seed=71))
    assert temp_files(shm_dir) == [] and spare_names(shm_dir) == []


@pytest.fixture
def small_tmpfs() -> Iterator[Path]:
    """An 8 MiB tmpfs: room for a few snapshots of geometry "f16-32k" (skipped where mounting
    needs a root this process is not)."""
    with mounted_tmpfs("8m", "kvsnap-spare-tmpfs-") as directory:
        yield directory


def _fill_then_capture(directory: str) -> dict[str, object]:
    """Child: a mapped write that leaves a spare, the filesystem filled, another mapped write;
    what happened to the spares."""
    from kvsnap.store.hot import spare_files as spares

    tuning.MAPPED_WRITE_MIN_BYTES = 0
    tuning.SPARE_CAPTURE_FILES_BYTES = 2 << 30
    spares.SPARE_SIZE_STEP = 4096  # spares of the files' own sizes, for a small filesystem
    write_mapped(os.path.join(directory, "a.safetensors"), *build("f16-32k", seed=72))
    registry = spares.spare_files()
    registry.wait()
    had_spare = len(registry.paths())
    filler = os.open(os.path.join(directory, "filler"), os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        while True:
            os.write(filler, bytes(1 << 12))
    except OSError as error:
        assert error.errno == errno.ENOSPC
    finally:
        os.close(filler)
    info = write_mapped(os.path.join(directory, "b.safetensors"), *build("f16-32k", seed=72))
    registry.wait()
    return {
        "had_spare": had_spare,
        "mapped": info.mapped,
        "spares_after": len(registry.paths()),
        "failed": registry.counts["failed"],
        "names": sorted(os.listdir(directory)),
    }


def test_a_full_filesystem_drops_the_spare_and_makes_none(small_tmpfs: Path) -> None:
    """The filesystem full: the next capture drops the spare there to make room (and maps its
    own file), and no new spare is made (no room for it and another capture)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        outcome = pool.apply_async(_fill_then_capture, (str(small_tmpfs),)).get(timeout=120)
    assert outcome == {
        "had_spare": 1,
        "mapped": True,
        "spares_after": 0,
        "failed": 1,
        "names": ["a.safetensors", "b.safetensors", "filler"],
    }
    with SnapshotReader(small_tmpfs / "b.safetensors") as reader:
        assert reader.verify() == []
