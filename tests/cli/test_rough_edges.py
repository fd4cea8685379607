"""Small roughness a new user met (issue 25): an unwritable ``--plot`` target, ``--debug``
after the command, sizes with units, and a golden-test report naming a file that is gone."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from kvsnap.cli.app import app
from kvsnap.cli.output import UsageError
from kvsnap.cli.store import parse_size
from kvsnap.testing.golden import check_golden

runner = CliRunner()


@pytest.fixture(scope="module")
def fixture_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("rough") / "fixture.safetensors"
    result = runner.invoke(app, ["fixture", str(path), "--lengths", "9"])
    assert result.exit_code == 0, result.stderr
    return str(path)


#: A directory that exists and looks writable to root, yet takes no new file (sysfs).
UNWRITABLE = Path("/sys/kvsnap-plot.png")


@pytest.mark.skipif(not UNWRITABLE.parent.is_dir(), reason="needs Linux's /sys")
def test_a_plot_that_cannot_be_written_is_one_clear_line(fixture_path: str) -> None:
    result = runner.invoke(app, ["inspect", fixture_path, "--plot", str(UNWRITABLE)])
    assert result.exit_code == 2, result.output
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"error: --plot {UNWRITABLE}: ")
    assert ("cannot write the image" in line or "is not writable" in line) and "Errno" not in line
    assert not UNWRITABLE.exists()


@pytest.mark.parametrize(
    "arguments",
    [["verify", "{missing}", "--debug"], ["store", "list", "{missing}", "--debug"]],
    ids=["verify", "store list"],
)
def test_debug_after_the_command_works_as_before_it(tmp_path: Path, arguments: list[str]) -> None:
    missing = str(tmp_path / "missing.safetensors")
    result = runner.invoke(app, [argument.format(missing=missing) for argument in arguments])
    # --debug took effect: the error is raised with its traceback instead of one line.
    assert "No such option" not in result.output
    assert isinstance(result.exception, UsageError), result.output


def test_debug_after_double_dash_stays_an_argument(tmp_path: Path) -> None:
    result = runner.invoke(app, ["verify", "--", "--debug"])
    assert result.exit_code == 2
    assert "--debug: no such file" in result.stderr


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("1073741824", 1 << 30),
        ("1GB", 10**9),
        ("1gb", 10**9),
        ("4.5GiB", int(4.5 * (1 << 30))),
        ("800M", 800 * 10**6),
        ("64 KiB", 64 << 10),
        ("2Ti", 2 << 40),
    ],
)
def test_sizes_take_units(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["-1", "1XB", "GB", "1.2.3G", ""])
def test_what_is_not_a_size_is_refused(text: str) -> None:
    with pytest.raises(typer.BadParameter, match="is not a size"):
        parse_size(text)


def test_store_prune_takes_a_size_with_a_unit(tmp_path: Path) -> None:
    result = runner.invoke(app, ["store", "prune", str(tmp_path), "--max-bytes", "1GB", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"removed": [], "freed_bytes": 0, "bytes": 0, "fits": True}


def test_a_golden_geometry_failure_names_this_runs_kv_not_a_vanished_file(
    tmp_path: Path,
) -> None:
    def kv(heads: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(heads)
        return {
            f"layers.0.{part}": torch.randn(10, heads, 8, generator=generator)
            for part in ("key", "value")
        }

    golden = tmp_path / "golden.safetensors"
    assert check_golden(kv(heads=2), golden).status == "missing"
    result = check_golden(kv(heads=4), golden)
    assert result.status == "mismatch"
    assert "differ in KV geometry" in result.report
    assert "this run's KV is" in result.report and "kvsnap-golden-" not in result.report
    assert not any(os.sep + "kvsnap-golden-" in word for word in result.report.split())
