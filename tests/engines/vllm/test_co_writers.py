"""A store's co-writers cause misses, never crashes, hangs or deletions outside the store.

Whoever can write a store (its other users in a ``shared_store``, a process gone wrong) can put
files and links where the store keeps its directories and its lock, hold its lock, or open it
to everyone. Real files, links across filesystems (``/dev/shm`` is a tmpfs, the tests' temporary
directory is not), and a real second process holding the lock; the connector's two sides driven
as vLLM drives them (``tests/support/connector_requests.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from kvsnap.cli.store import app as store_app
from kvsnap.engines.vllm import (
    KVSnapConnectorMetadata,
    SaveSpec,
    prune_store,
    read_events,
    store_entries,
)
from kvsnap.engines.vllm.capacity import (
    CAPACITY_LOCK,
    CapacityLockError,
    capacity_lock,
    commit_within_capacity,
)
from kvsnap.engines.vllm.eviction import staged_path
from kvsnap.engines.vllm.open_chunks import CHECKED_CHUNKS
from kvsnap.snapshot import Snapshot
from tests.support.connector_requests import Connector, make_connector, random_prompt
from tests.support.file_versions import rewrite_in_place_keeping_times
from tests.support.reads import record_preadv

SOURCE, TARGET = [0, 1, 2, 3], [8, 9, 10, 11]


def _stored(connector: Connector, prompt: list[int], name: str = "writer") -> list[Path]:
    """Store ``prompt`` (computed into blocks ``SOURCE``); its chunks, in order."""
    connector.store(name, prompt, SOURCE)
    events = read_events(connector.events_path)
    return [Path(e["path"]) for e in events if e["event"] == "save" and e["request"] == name]


def _events(connector: Connector, name: str) -> list[dict]:
    return [event for event in read_events(connector.events_path) if event["event"] == name]


@pytest.fixture
def other_filesystem() -> Iterator[Path]:
    """A directory on ``/dev/shm``, a filesystem other than the tests' temporary one."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    directory = Path(f"/dev/shm/kvsnap-co-writer-{os.getpid()}-{time.monotonic_ns()}")
    directory.mkdir(mode=0o700)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _files(directory: Path) -> dict[Path, bytes]:
    return {path: path.read_bytes() for path in sorted(directory.rglob("*")) if path.is_file()}


@pytest.mark.parametrize("found_by", ["scheduler", "worker"])
def test_a_file_where_quarantine_belongs_costs_a_miss_and_one_warning(
    tmp_path: Path, found_by: str
) -> None:
    # The scheduler finds the damage when it verifies the chunk (vLLM's default policy); a
    # worker finds it when it loads a chunk the scheduler did not verify.
    connector = make_connector(tmp_path / "store", verify=found_by == "scheduler", hand_over=False)
    prompt = random_prompt(seed=5)
    chunks = _stored(connector, prompt)
    quarantine = tmp_path / "store" / "ns" / "quarantine"
    shutil.rmtree(quarantine, ignore_errors=True)
    quarantine.write_text("planted")
    rewrite_in_place_keeping_times(chunks[0], flip=True)
    for number in range(3):
        served = connector.serve(f"r{number}", prompt, TARGET)
        assert served.loaded == []  # a miss, or a load that failed: recomputed either way
        if found_by == "worker":
            assert served.failed == set(TARGET)
    (skipped,) = _events(connector, "quarantine_skipped")  # said once, missed every time
    assert skipped["role"] == found_by and "Not a directory" in skipped["error"]
    assert chunks[0].exists() and quarantine.read_text() == "planted"
    connector.shutdown()


@pytest.mark.parametrize("found_by", ["scheduler", "worker"])
def test_a_chunk_directory_linked_to_another_filesystem_costs_a_miss_and_one_warning(
    tmp_path: Path, other_filesystem: Path, found_by: str
) -> None:
    connector = make_connector(tmp_path / "store", verify=found_by == "scheduler", hand_over=False)
    prompt = random_prompt(seed=6)
    chunks = _stored(connector, prompt)
    # chunks/HH of the first chunk becomes a link to a directory on /dev/shm holding a damaged
    # copy of it: a rename from there into the store's quarantine would fail with EXDEV.
    linked = chunks[0].parent
    planted = other_filesystem / linked.name
    shutil.copytree(linked, planted)
    rewrite_in_place_keeping_times(planted / chunks[0].name, flip=True)
    shutil.rmtree(linked)
    linked.symlink_to(planted, target_is_directory=True)
    assert os.stat(planted).st_dev != os.stat(tmp_path).st_dev
    before = _files(other_filesystem)
    served = connector.serve("r1", prompt, TARGET)
    assert served.loaded == []
    (skipped,) = _events(connector, "quarantine_skipped")
    # The link is not followed: ENOTDIR or ELOOP, by how the directory was asked for.
    assert skipped["role"] == found_by and _refused_link(skipped["error"])
    # Nothing was moved out of, or written into, the directory the link points to.
    assert _files(other_filesystem) == before
    # Nor does a save of the chunk (gone from there now) write through the link: refused, a
    # logged failure.
    with Snapshot.open(planted / chunks[0].name) as snapshot:
        (sequence,) = snapshot.metadata.sequences
    (planted / chunks[0].name).unlink()
    before = _files(other_filesystem)
    save = SaveSpec(
        "again", "persist", str(chunks[0]), sequence.token_ids, np.array(SOURCE[:2]), sequence.id
    )
    connector.worker.wait_for_save(KVSnapConnectorMetadata(saves=[save]))
    connector.worker.wait_for_writes()
    assert _files(other_filesystem) == before
    (failed,) = _events(connector, "save_failed")
    assert failed["path"] == str(chunks[0]) and _refused_link(failed["error"])
    connector.shutdown()


def _refused_link(error: str) -> bool:
    return "Not a directory" in error or "Too many levels of symbolic links" in error


def _outside_chunks(directory: Path) -> list[Path]:
    """Chunk-like files in ``directory``, outside the store: nothing may ever delete them."""
    files = []
    for relative in ("chunks/ab/" + "ab" * 32, "quarantine/cd" + "cd" * 31 + ".1", "ef" * 32):
        path = directory / f"{relative}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(4096))
        os.utime(path, (1, 1))  # unused for decades: the first an LRU pruner would take
        files.append(path)
    return files


def test_prune_and_the_capacity_commit_never_delete_through_links(tmp_path: Path) -> None:
    connector = make_connector(tmp_path / "store")
    root = tmp_path / "store"
    chunks = _stored(connector, random_prompt(seed=7))
    outside = tmp_path / "outside"
    files = _outside_chunks(outside)
    # A namespace that is a link to that directory, a namespace whose chunks/ is one, and a
    # chunks/HH that is one.
    (root / "evil").symlink_to(outside, target_is_directory=True)
    (root / "evil2").mkdir(mode=0o700)
    (root / "evil2" / "chunks").symlink_to(outside / "chunks", target_is_directory=True)
    (root / "ns" / "chunks" / "zz").symlink_to(outside / "chunks" / "ab")
    listed = {entry.path for entry in store_entries(root)}
    assert listed == set(chunks)
    staged = staged_path(chunks[0])
    shutil.copyfile(chunks[1], staged)
    committed, removed = commit_within_capacity(
        root, staged, chunks[0].with_name("f" * 64 + ".safetensors"), 1
    )
    assert not committed and {entry.path for entry in removed} == set(chunks)
    prune_store(root, 0)
    result = CliRunner().invoke(store_app, ["prune", str(root), "--max-bytes", "0", "--json"])
    assert result.exit_code == 0, result.output
    assert all(path.exists() for path in files)
    assert not staged.exists()
    connector.shutdown()


def test_a_lock_link_planted_in_the_store_is_refused_and_creates_nothing(tmp_path: Path) -> None:
    connector = make_connector(tmp_path / "store", store_capacity_bytes=1 << 20)
    root = tmp_path / "store"
    target = tmp_path / "elsewhere" / "created-by-the-engine"
    target.parent.mkdir()
    (root / CAPACITY_LOCK).symlink_to(target)
    prompts = [random_prompt(seed=20 + number) for number in range(3)]
    for number, prompt in enumerate(prompts):
        connector.store(f"w{number}", prompt, SOURCE)
    assert not target.exists() and list(target.parent.iterdir()) == []
    assert not _events(connector, "save") and not list(root.glob("ns/chunks/*/*.safetensors"))
    (said,) = _events(connector, "store_locked")
    assert "a link planted there" in said["error"]
    with pytest.raises(CapacityLockError, match="a link planted there"):
        with capacity_lock(root):
            pass
    assert not target.exists()
    connector.shutdown()


HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
deadline = time.monotonic() + float(sys.argv[3])
while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
    time.sleep(0.01)
"""


def test_a_lock_another_process_holds_skips_saves_and_never_holds_up_a_step(
    tmp_path: Path,
) -> None:
    connector = make_connector(
        tmp_path / "store", store_capacity_bytes=1 << 20, max_pending_writes=1
    )
    root = tmp_path / "store"
    saves = connector.worker._saves
    assert saves is not None
    saves.lock_wait_s = 0.2
    stop = tmp_path / "let-go"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root / CAPACITY_LOCK), str(stop), "30"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        steps = []
        for number in range(12):
            request = f"w{number}"
            prompt = random_prompt(seed=40 + number)
            started = time.perf_counter()
            connector.store(request, prompt, SOURCE)  # the step's saves, written before return
            steps.append(time.perf_counter() - started)
        # Every step's saves were skipped within the wait (the first one) or at once (the rest:
        # the lock is asked for without waiting before anything is copied): no step waited
        # for the holder, which kept the lock for the whole run.
        assert holder.poll() is None
        assert max(steps) < 5 * saves.lock_wait_s, [round(step, 3) for step in steps]
        assert not _events(connector, "save")
        (said,) = _events(connector, "store_locked")
        assert "held the store's lock for more than 0.2 s" in said["error"]
    finally:
        stop.touch()
        holder.wait(timeout=30)
    # Once it lets go, saves commit again.
    connector.store("after", random_prompt(seed=60), SOURCE)
    assert [event["request"] for event in _events(connector, "save")] == ["after", "after"]
    assert not list(root.glob("ns/chunks/*/.*kvsnap-stage*"))
    connector.shutdown()


def test_a_store_opened_to_everyone_without_a_key_stops_serving_and_saving(
    tmp_path: Path,
) -> None:
    connector = make_connector(tmp_path / "store", guard_interval_s=0.0)
    root = tmp_path / "store"
    prompt = random_prompt(seed=8)
    _stored(connector, prompt)
    assert connector.serve("r1", prompt, TARGET).loaded == TARGET
    root.chmod(0o777)
    for number in range(3):
        assert connector.serve(f"open{number}", prompt, TARGET).matched == 0
    connector.store("not-saved", random_prompt(seed=9), SOURCE)
    refused = _events(connector, "store_refused")
    assert [event["role"] for event in refused] == ["scheduler"]  # one error, not one a call
    assert "writable by other users (mode 777)" in refused[0]["error"]
    assert not [e for e in _events(connector, "save") if e["request"] == "not-saved"]
    # The worker refuses the saves already planned, too.
    saves = connector.worker._saves
    assert saves is not None and saves.guard is not None and not saves.guard.allows()
    root.chmod(0o700)
    assert connector.serve("r2", prompt, TARGET).loaded == TARGET
    assert [event["role"] for event in _events(connector, "store_accepted")] == ["scheduler"]
    connector.shutdown()


def test_a_chunk_that_rots_after_its_first_check_is_recomputed_not_failed(
    tmp_path: Path,
) -> None:
    # Under vLLM's default policy ("fail") the scheduler verifies chunks before offering them,
    # and a failed load fails the request: a chunk rewritten in place after it was checked and
    # loaded once, its size and modification time put back, must be a miss.
    for hand_over in (True, False):
        connector = make_connector(tmp_path / f"store-{hand_over}", hand_over=hand_over)
        prompt = random_prompt(seed=10)
        chunks = _stored(connector, prompt)
        assert connector.serve("first", prompt, TARGET).loaded == TARGET
        time.sleep(0.02)  # past a tick of the coarse clock the kernel stamps change times from
        rewrite_in_place_keeping_times(chunks[1], flip=True)
        served = connector.serve("second", prompt, TARGET)
        assert served.failed == set(), hand_over  # no failed load: no failed request
        assert served.loaded == TARGET[:2], hand_over  # the first chunk still serves
        (quarantined,) = _events(connector, "quarantine")
        assert (
            quarantined["path"] == str(chunks[1]) and "failed verification" in quarantined["reason"]
        )
        connector.shutdown()


def test_a_chunk_that_rots_with_no_trace_in_its_times_is_a_miss_for_a_worker_reading_the_file(
    tmp_path: Path,
) -> None:
    # Bit rot read back from the disk moves none of a file's times. A worker that reads the
    # file itself (vLLM's mp executor, any TP > 1: no hand-over) must never meet it as a
    # failed load (under "fail", a failed request): the scheduler verifies a chunk again each
    # time it offers it. The rot is a real rewrite of the file in place, its size and
    # modification time put back; its change time is then taken as the scheduler takes the
    # one its own record of a hit leaves (``touched``), so that nothing in the file's times
    # tells the chunk apart from the version that passed, as with rot on the disk.
    connector = make_connector(tmp_path / "store", hand_over=False)
    prompt = random_prompt(seed=13)
    chunks = _stored(connector, prompt)
    assert connector.serve("first", prompt, TARGET).loaded == TARGET
    rewrite_in_place_keeping_times(chunks[1], flip=True)
    connector.scheduler.checker.touched(str(chunks[1]))
    served = connector.serve("second", prompt, TARGET)
    assert served.failed == set()  # no failed load: no failed request
    assert served.loaded == TARGET[:2]  # the first chunk still serves
    (quarantined,) = _events(connector, "quarantine")
    assert quarantined["path"] == str(chunks[1]) and "failed verification" in quarantined["reason"]
    connector.shutdown()


def test_store_verify_reports_a_chunk_copied_under_another_chunks_name(tmp_path: Path) -> None:
    connector = make_connector(tmp_path / "store")
    chunks = _stored(connector, random_prompt(seed=11))
    connector.shutdown()
    shutil.copyfile(chunks[1], chunks[0])
    result = CliRunner().invoke(store_app, ["verify", str(tmp_path / "store"), "--json"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    (bad,) = [entry for entry in report["entries"] if not entry["ok"]]
    assert bad["state"] == "misnamed" and bad["path"] == str(
        chunks[0].relative_to(tmp_path / "store")
    )
    assert chunks[1].name.removesuffix(".safetensors") in bad["problems"][0]


def test_a_hot_chunk_is_offered_again_from_the_bytes_verified_and_else_verified_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A chunk the scheduler verified and handed over read whole goes back to the hand-over
    # after its load: its next hit reads nothing (no byte the disk could have rotted since);
    # once the hand-over dropped it, the chunk is read and verified again before it is offered.
    connector = make_connector(tmp_path / "store")
    prompt = random_prompt(seed=12)
    chunks = _stored(connector, prompt)
    reads = record_preadv(monkeypatch)
    first = connector.serve("first", prompt, TARGET)
    assert first.loaded == TARGET and len(reads) == len(chunks)  # each read whole, once
    reads.clear()
    connector.scrub(TARGET)
    again = connector.serve("again", prompt, TARGET)
    assert again.loaded == TARGET and reads == []
    assert all(
        torch.equal(loaded.view(torch.int16), stored.view(torch.int16))
        for loaded, stored in zip(connector.blocks(TARGET), connector.blocks(SOURCE), strict=True)
    )
    CHECKED_CHUNKS.clear()  # dropped (the hand-over keeps at most 8)
    third = connector.serve("third", prompt, TARGET)
    assert third.loaded == TARGET
    assert sorted(reads) == sorted((0, chunk.stat().st_size) for chunk in chunks)
    connector.shutdown()
