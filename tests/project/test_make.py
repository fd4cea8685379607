"""``make test`` says what it does and can leave out the vLLM virtualenv; the vLLM virtualenv
it builds breaks no installed package's requirement on typer (pip's resolver then prints no
red error while building it)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def planned_commands(*arguments: str) -> str:
    """What ``make test`` would run, as if the vLLM setup script had just changed (``-W``), so
    that the plan shows the vLLM virtualenv's build whether or not it exists already."""
    result = subprocess.run(
        ["make", "-n", "-W", "scripts/setup_vllm_venv.sh", "test", *arguments],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_test_builds_the_vllm_venv_unless_asked_not_to() -> None:
    with_vllm = planned_commands()
    assert "setup_vllm_venv.sh" in with_vllm
    assert "3.4 GB" in with_vllm  # it says what it is about to download
    without = planned_commands("SKIP_VLLM=1")
    assert "setup_vllm_venv.sh" not in without
    assert "without real vLLM (SKIP_VLLM=1)" in without
    assert "pytest -q tests" in without


#: Run by the vLLM virtualenv's Python: every installed distribution's requirement on typer
#: that the installed typer does not satisfy.
_BROKEN_TYPER_REQUIREMENTS = """
import json
from importlib import metadata
from packaging.requirements import Requirement
typer = metadata.version("typer")
broken = []
for dist in metadata.distributions():
    for text in dist.requires or []:
        requirement = Requirement(text)
        if requirement.name.lower() != "typer":
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        if not requirement.specifier.contains(typer, prereleases=True):
            broken.append(f"{dist.metadata['Name']} needs {text}, typer {typer} is installed")
print(json.dumps(broken))
"""


@pytest.mark.vllm
def test_the_vllm_venv_breaks_no_requirement_on_typer() -> None:
    result = subprocess.run(
        [str(VLLM_PYTHON), "-c", _BROKEN_TYPER_REQUIREMENTS],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(result.stdout) == []
