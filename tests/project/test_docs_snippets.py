"""Every ```python block of README.md and docs/*.md runs as written.

A block whose first line is ``# needs: cuda`` or ``# needs: vllm`` is skipped where that is
missing; one whose first line is ``# run: torchrun ARGS`` is saved to a file and run by
``torchrun ARGS FILE`` (one process per rank, as its document says to run it). A block that
defines ``test_*`` functions is a test module: it runs under pytest (with kvsnap's plugin)
twice, since a first run writes the golden files and fails as documented, and the second must
pass. Every block runs in a fresh directory, so the files it writes vanish.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def _importable(name: str) -> bool:
    """Whether module ``name`` can be imported here (a missing parent package counts as no)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


NEEDS = {
    "cuda": torch.cuda.is_available,
    "vllm": lambda: _importable("vllm.entrypoints"),
}


def _blocks() -> list[pytest.ParameterSet]:
    """One parameter per python block, named ``DOCUMENT:LINE``."""
    params = []
    for document in DOCUMENTS:
        text = document.read_text()
        for match in BLOCK.finditer(text):
            line = text[: match.start()].count("\n") + 1
            params.append(pytest.param(match.group(1), id=f"{document.name}:{line}"))
    return params


def _skip_unless_available(code: str) -> None:
    need = re.match(r"# needs: (\w+)", code)
    if need is None:
        return
    assert need.group(1) in NEEDS, f"unknown '# needs:' marker {need.group(1)!r}"
    if not NEEDS[need.group(1)]():
        pytest.skip(f"needs {need.group(1)}")


def test_the_documents_have_python_blocks() -> None:
    names = {param.id.split(":")[0] for param in _blocks()}
    assert {"README.md", "fixtures.md"} <= names


@pytest.mark.parametrize("code", _blocks())
def test_python_block_runs_as_written(
    code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _skip_unless_available(code)
    monkeypatch.chdir(tmp_path)
    if re.search(r"^def test_", code, re.MULTILINE):
        _run_as_test_module(code, tmp_path)
        return
    launcher = re.match(r"# run: torchrun (.*)\n", code)
    if launcher is not None:
        _run_under_torchrun(code, launcher.group(1).split(), tmp_path)
        return
    exec(compile(code, "<snippet>", "exec"), {"__name__": "__snippet__"})


def _run_under_torchrun(code: str, arguments: list[str], directory: Path) -> None:
    (directory / "snippet.py").write_text(code)
    command = [sys.executable, "-m", "torch.distributed.run", *arguments, "snippet.py"]
    done = subprocess.run(
        command, cwd=directory, capture_output=True, text=True, check=False, timeout=300
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]


def _run_as_test_module(code: str, directory: Path) -> None:
    (directory / "test_snippet.py").write_text(code)
    # -rN: no short summary, whose lines (untruncated where CI is set) repeat each message.
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rN",
        "-p",
        "no:cacheprovider",
        "test_snippet.py",
    ]
    tests = len(re.findall(r"^def test_", code, re.MULTILINE))
    first = subprocess.run(command, cwd=directory, capture_output=True, text=True, check=False)
    assert f"{tests} failed" in first.stdout, first.stdout[-3000:]
    assert first.stdout.count("did not exist; it has been written") == tests, first.stdout[-3000:]
    second = subprocess.run(command, cwd=directory, capture_output=True, text=True, check=False)
    assert second.returncode == 0 and f"{tests} passed" in second.stdout, second.stdout[-3000:]
