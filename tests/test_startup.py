"""The CLI starts without the heavy libraries a command does not use: ``--help``, ``--version``,
``inspect`` and ``verify`` never import torch (what made every command pay about 2 s before
doing anything). How fast they start is a benchmark figure (``benchmarks/cli_startup.py``),
never a timed test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvsnap.engines.vllm.eviction import ORPHAN_GRACE_S

REPO = Path(__file__).resolve().parent.parent
#: Libraries that take a second or more to import, none of which these commands need.
HEAVY_LIBRARIES = ("torch", "transformers", "triton", "matplotlib")
#: kvsnap's own modules that import them.
HEAVY_MODULES = ("kvsnap.pipeline", "kvsnap.bench", "kvsnap.parted")
#: Runs ``kvsnap ARGS`` in this process, then prints the exit code and the heavy modules loaded.
_RUN = f"""
import json, sys
from kvsnap.cli.app import main
sys.argv = ["kvsnap", *sys.argv[1:]]
try:
    main()
except SystemExit as exit:
    code = exit.code
heavy = sorted(
    name for name in sys.modules
    if name.split(".")[0] in {HEAVY_LIBRARIES!r} or name in {HEAVY_MODULES!r}
)
print(json.dumps({{"code": code, "heavy": heavy}}), file=sys.stderr)
"""


def run_cli(*arguments: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", _RUN, *arguments],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        timeout=120,
    )
    return json.loads(result.stderr.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("startup") / "fixture.safetensors"
    subprocess.run(
        [sys.executable, "-m", "kvsnap.cli", "fixture", str(path)],
        check=True,
        capture_output=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    return str(path)


@pytest.mark.parametrize(
    "arguments",
    [
        ["--help"],
        ["--version"],
        ["inspect", "{snapshot}"],
        ["inspect", "{snapshot}", "--json"],
        ["verify", "{snapshot}"],
        ["verify", "{snapshot}", "--json"],
        ["store", "--help"],
    ],
    ids=lambda arguments: " ".join(arguments),
)
def test_light_commands_import_no_heavy_library(snapshot: str, arguments: list[str]) -> None:
    outcome = run_cli(*(argument.format(snapshot=snapshot) for argument in arguments))
    assert outcome == {"code": 0, "heavy": []}, outcome


def test_a_command_that_computes_still_gets_what_it_needs(snapshot: str) -> None:
    # verify --against compares values with torch: imported when the comparison runs.
    outcome = run_cli("verify", snapshot, "--against", snapshot)
    assert outcome["code"] == 0 and "torch" in outcome["heavy"]


def test_store_prune_shows_the_stores_own_orphan_grace_default() -> None:
    from typer.main import get_command

    from kvsnap.cli.app import app

    prune = get_command(app).commands["store"].commands["prune"]  # type: ignore[attr-defined]
    [option] = [param for param in prune.params if param.name == "orphan_grace_s"]
    assert float(option.show_default) == ORPHAN_GRACE_S
