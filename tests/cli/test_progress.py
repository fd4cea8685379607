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
