"""The package as pip installs it: every subpackage listed, the CLI mapped in as ``kvsnap.cli``."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]


def _listed_packages() -> set[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    return set(config["packages"])


def _packages_in_tree() -> set[str]:
    found = {
        ".".join(init.parent.relative_to(REPO).parts)
        for init in (REPO / "kvsnap").rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    return found | {"kvsnap.cli", "kvsnap.schema"}


def test_pyproject_lists_every_package_in_the_tree() -> None:
    assert _listed_packages() == _packages_in_tree()


def test_the_wheel_installs_the_cli_as_kvsnap_cli_and_no_top_level_cli(tmp_path: Path) -> None:
    # Built from a copy, so that setuptools' build/ and egg-info never land in the checkout.
    source = tmp_path / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("kvsnap", "cli"):
        shutil.copytree(REPO / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    wheel_dir = tmp_path / "wheels"
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip_wheel, "-w", str(wheel_dir), str(source)], check=True, capture_output=True)
    (wheel,) = wheel_dir.glob("kvsnap-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert top_level == {"kvsnap", wheel.name.split("-py")[0] + ".dist-info"}
    cli_sources = {path.name for path in (REPO / "cli").glob("*.py")}
    assert {name.split("/")[-1] for name in names if name.startswith("kvsnap/cli/")} == cli_sources
    assert "kvsnap/schema/snapshot-v1.schema.json" in names
    assert "kvsnap/py.typed" in names
