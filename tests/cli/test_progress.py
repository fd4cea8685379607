"""``kvsnap capture`` on a terminal shows each phase as it runs (model load, prefill counting
prompts, the write) in one unit of size, and its summary gives the total time and each phase's.

The command runs as a real child process whose stderr is a pseudo-terminal: rich draws its bars
only on a terminal.
"""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: Terminal control sequences (colours, cursor moves) between the words rich draws.
_CONTROL = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def run_on_a_terminal(*arguments: str) -> tuple[int, str, str]:
    """Run ``kvsnap ARGUMENTS`` with stderr on a pseudo-terminal; exit code, stdout, and what
    was drawn on the terminal without control sequences."""
    main, terminal = pty.openpty()
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="160", TERM="xterm")
    child = subprocess.Popen(
        [sys.executable, "-m", "kvsnap.cli", *arguments],
        stdout=subprocess.PIPE,
        stderr=terminal,
        env=env,
    )
    os.close(terminal)
    drawn = bytearray()
    while True:
        try:
            chunk = os.read(main, 1 << 16)
        except OSError:  # the child closed its end
            break
        if not chunk:
            break
        drawn += chunk
    os.close(main)
    stdout = child.stdout.read().decode() if child.stdout else ""
    code = child.wait(timeout=300)
    return code, stdout, _CONTROL.sub("", drawn.decode(errors="replace"))


def test_capture_shows_its_phases_in_one_unit_and_reports_the_total_time(tmp_path: Path) -> None:
    output = tmp_path / "captured.safetensors"
    code, stdout, drawn = run_on_a_terminal(
        "capture", "-o", str(output), "-p", "the first prompt", "-p", "a second prompt"
    )
    assert code == 0, drawn
    assert "loading the model (built-in)" in drawn
    assert re.search(r"prefill\b.*\b[0-2]/2\b.*sequence [12]", drawn), drawn
    assert "prefill" in drawn and "2/2" in drawn
    assert re.search(r"writing\b.*\bKiB\b", drawn), drawn
    # Sizes and speeds in binary units only, as in the summary.
    assert not re.search(r"\d (kB|MB|GB)\b", drawn), drawn
    summary = re.fullmatch(
        r"captured 2 sequence\(s\), \d+ tokens, [\d.]+ KiB → \S+ in ([\d.]+) s "
        r"\(model load ([\d.]+) s, prefill ([\d.]+) s, write ([\d.]+) s\)\n",
        stdout,
    )
    assert summary is not None, stdout
    total, *phases = (float(value) for value in summary.groups())
    # The phases run one after the other and make up the total (each rounded to 0.01 s).
    assert abs(total - sum(phases)) <= 0.02


def _bytes(number: str, unit: str) -> float:
    return float(number) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[unit]


def test_the_write_speed_shown_is_the_speed_of_the_write(tmp_path: Path) -> None:
    """The bar's speed is the bytes written over the time the bar has run: it showed
    11.3 GiB/s for a 256 MiB write on this VM (62.5 GiB/s for a capture's write of 0.68 s),
    the speed of the last few updates rather than of the write."""
    output = tmp_path / "fixture.safetensors"
    shape = ["--layers", "4", "--heads", "8", "--head-dim", "128", "--lengths", "2048,2048"]
    code, _, drawn, times = run_on_a_terminal_timed("fixture", str(output), *shape)
    assert code == 0, drawn
    written = output.stat().st_size
    drawn_at = [when for when, chunk in times if "writing" in chunk]
    bar_seconds = drawn_at[-1] - drawn_at[0]
    speeds = [
        _bytes(number, unit)
        for number, unit in re.findall(r"writing\b[^\n\r]*?([\d.]+) (B|KiB|MiB|GiB)/s", drawn)
    ]
    assert speeds and bar_seconds > 0, drawn
    # No faster than the file over the time the bar was seen drawing (which the bar outlasts
    # by at most a refresh), with room for the terminal's timing.
    assert max(speeds) <= 3 * written / bar_seconds, (speeds, written, bar_seconds)


def run_on_a_terminal_timed(*arguments: str) -> tuple[int, str, str, list[tuple[float, str]]]:
    """:func:`run_on_a_terminal`, with the time each piece of the terminal's output came."""
    main, terminal = pty.openpty()
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="160", TERM="xterm")
    child = subprocess.Popen(
        [sys.executable, "-m", "kvsnap.cli", *arguments],
        stdout=subprocess.PIPE,
        stderr=terminal,
        env=env,
    )
    os.close(terminal)
    pieces: list[tuple[float, str]] = []
    while True:
        try:
            chunk = os.read(main, 1 << 16)
        except OSError:
            break
        if not chunk:
            break
        pieces.append((time.monotonic(), _CONTROL.sub("", chunk.decode(errors="replace"))))
    os.close(main)
    stdout = child.stdout.read().decode() if child.stdout else ""
    code = child.wait(timeout=300)
    return code, stdout, "".join(piece for _, piece in pieces), pieces


def test_restore_counts_every_sequence_on_one_bar_and_shows_generation(tmp_path: Path) -> None:
    snapshot = tmp_path / "three.safetensors"
    prompts = ["-p", "a first prompt " * 30, "-p", "a second one " * 30, "-p", "the third " * 30]
    code, _, drawn = run_on_a_terminal("capture", "-o", str(snapshot), *prompts)
    assert code == 0, drawn
    code, stdout, drawn = run_on_a_terminal(
        "restore", str(snapshot), "--max-new-tokens", "4", "--check"
    )
    assert code == 0, drawn
    totals = {
        _bytes(total, unit)
        for total, unit in re.findall(r"restore\b[^\n\r]*?[\d.]+/([\d.]+) (KiB|MiB)", drawn)
    }
    restored = re.search(r"restored 3 sequence\(s\), ([\d.]+) (KiB|MiB)", stdout)
    assert restored is not None, stdout
    # One total for the three sequences, the one the summary reports (each rounded to 0.1).
    assert len(totals) == 1, totals
    assert abs(totals.pop() - _bytes(*restored.groups())) <= 0.1 * 1024
    # Generation and the check show what runs.
    assert re.search(r"generating\b.*\bsequence seq-[012]", drawn), drawn
    assert "checking seq-" in drawn and "without the snapshot" in drawn


def test_statistics_and_the_diff_show_a_byte_bar(tmp_path: Path) -> None:
    snapshot = tmp_path / "fixture.safetensors"
    code, _, drawn = run_on_a_terminal("fixture", str(snapshot), "--lengths", "3000,2000")
    assert code == 0, drawn
    code, _, drawn = run_on_a_terminal("inspect", str(snapshot), "--stats")
    assert code == 0 and re.search(r"statistics\b.*\b(KiB|MiB)\b", drawn), drawn
    code, _, drawn = run_on_a_terminal("diff", str(snapshot), str(snapshot))
    assert code == 0 and re.search(r"comparing\b.*\b(KiB|MiB)\b", drawn), drawn
