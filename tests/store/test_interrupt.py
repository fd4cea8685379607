"""Ctrl-C: a real SIGINT sent to a real child process stops a write, keeps the previous file
byte for byte, leaves no temporary file, and (CLI) says so in one line with exit code 130.

The child (``tests/support/interrupt_child.py``) writes to slow storage (each layer-data write
takes a while longer), so the signal lands while the snapshot is being written every time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvsnap.cli.app import app

REPO = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).resolve().parents[1] / "support" / "interrupt_child.py"
#: Generous bound on a child's whole life: a hang fails the test instead of blocking the suite.
CHILD_TIMEOUT_S = 120
#: What ``kvsnap fixture`` writes here: 64 MiB of KV, four 16 MiB staging slots to write.
FIXTURE_ARGS = ["--layers", "8", "--heads", "4", "--lengths", "8000", "--seed", "3"]


def start_child(
    mode: str, marker: Path, delay: float, slowed: str, *arguments: str
) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(CHILD.parent)]))
    return subprocess.Popen(
        [sys.executable, str(CHILD), mode, str(marker), str(delay), slowed, *arguments],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def wait_for(marker: Path, child: subprocess.Popen[str]) -> None:
    """Return once ``marker`` exists; fail if the child ends or takes too long first."""
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while not marker.exists():
        if child.poll() is not None:
            out, err = child.communicate()
            pytest.fail(f"the child ended (exit {child.returncode}) before the phase: {err}{out}")
        if time.monotonic() > deadline:
            child.kill()
            pytest.fail("the child never reached the phase to interrupt")
        time.sleep(0.01)


def temporary_files(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if ".kvsnap-tmp-" in name)


@pytest.fixture
def previous(tmp_path: Path) -> tuple[Path, bytes]:
    """A snapshot already at the path the interrupted command writes, and its bytes."""
    path = tmp_path / "snap.safetensors"
    written = CliRunner().invoke(app, ["fixture", str(path), "--lengths", "40"])
    assert written.exit_code == 0, written.output
    return path, path.read_bytes()


@pytest.mark.parametrize(
    ("command", "slowed", "as_json"),
    [
        ("fixture", "write", False),
        ("fixture", "write", True),
        ("fixture", "synthesize", False),
        ("capture", "write", False),
    ],
    ids=["fixture-mid-write", "fixture-mid-write-json", "fixture-before-the-write", "capture"],
)
def test_ctrl_c_stops_the_command_and_keeps_the_previous_file(
    tmp_path: Path, previous: tuple[Path, bytes], command: str, slowed: str, as_json: bool
) -> None:
    path, old_bytes = previous
    marker = tmp_path / "marker"
    arguments = [str(path), *FIXTURE_ARGS] if command == "fixture" else ["-o", str(path)]
    json_flag = ["--json"] if as_json else []
    # Each write takes 1 s longer (the fixture's: four 16 MiB slots, 4 s and more in all).
    child = start_child("cli", marker, 1.0, slowed, command, *arguments, *json_flag)
    wait_for(marker, child)
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=CHILD_TIMEOUT_S)

    assert child.returncode == 130, (out, err)
    assert err.strip().splitlines() == ["error: interrupted"], err
    assert json.loads(out) == {"ok": False, "error": "interrupted"} if as_json else out == ""
    assert path.read_bytes() == old_bytes
    assert temporary_files(tmp_path) == []


def test_a_second_ctrl_c_while_the_cli_exits_ends_it_without_a_traceback(
    tmp_path: Path, previous: tuple[Path, bytes]
) -> None:
    path, old_bytes = previous
    marker = tmp_path / "marker"
    child = start_child("cli", marker, 1.0, "write+exit", "fixture", str(path), *FIXTURE_ARGS)
    wait_for(marker, child)
    child.send_signal(signal.SIGINT)
    wait_for(marker.with_suffix(".exit"), child)  # the cleanup is done, the process exits
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=CHILD_TIMEOUT_S)

    # Ended by the second SIGINT's default action: what a shell reports as 130 too.
    assert child.returncode == -signal.SIGINT, (out, err)
    assert err.strip().splitlines() == ["error: interrupted"], err
    assert path.read_bytes() == old_bytes
    assert temporary_files(tmp_path) == []


def test_ctrl_c_reaches_a_library_caller_after_the_cleanup_even_when_repeated(
    tmp_path: Path, previous: tuple[Path, bytes]
) -> None:
    path, old_bytes = previous
    marker = tmp_path / "marker"
    child = start_child("library", marker, 2.0, "write", str(path))
    wait_for(marker, child)
    child.send_signal(signal.SIGINT)
    # A second Ctrl-C while the writer waits for its running (slow) write must not cut the
    # cleanup short.
    time.sleep(0.5)
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=CHILD_TIMEOUT_S)

    assert child.returncode == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report == {"interrupted": True, "temps": []}, report
    assert path.read_bytes() == old_bytes
    assert temporary_files(tmp_path) == []


def test_an_abort_waiting_on_a_stuck_write_gives_way_to_a_third_interrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Interrupts while an abort waits for its write are absorbed, two of them; a third ends
    the wait (a write that never returns must not make Ctrl-C powerless), with the temporary
    file already gone."""
    import threading

    import numpy as np

    from kvsnap.store import SnapshotWriter
    from kvsnap.store.write import local_file
    from tests.support.store_helpers import (
        GEOMETRIES,
        make_metadata,
        random_pages,
        shared_prefix_tokens,
    )

    rng = np.random.default_rng(5)
    spec = GEOMETRIES["bf16"]
    metadata = make_metadata(spec, shared_prefix_tokens(rng, spec.block_size, num_sequences=2))
    pages = random_pages(rng, metadata)
    stuck, release, returned = threading.Event(), threading.Event(), threading.Event()
    real = local_file._pwrite_all
    writer = SnapshotWriter(tmp_path / "stuck.safetensors", metadata, direct_io=False)
    held = {file.fd for file in writer._target.files}

    def stuck_write(fd: int, view: memoryview, offset: int) -> None:
        if fd in held:
            stuck.set()
            release.wait(20)
            returned.set()
        real(fd, view, offset)

    monkeypatch.setattr(local_file, "_pwrite_all", stuck_write)
    name = writer.tensor_order()[0]
    writer.write_pages(name, pages[name])
    assert stuck.wait(10)

    main = threading.main_thread().ident
    assert main is not None

    def interrupt_three_times() -> None:
        for _ in range(3):
            time.sleep(0.3)
            signal.pthread_kill(main, signal.SIGINT)  # a real SIGINT, to the main thread

    interrupter = threading.Thread(target=interrupt_three_times)
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            writer.abort()
        assert temporary_files(tmp_path) == []
        assert not returned.is_set()  # the abort gave way while its write was still stuck
    finally:
        release.set()
        interrupter.join(10)
