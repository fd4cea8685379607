"""The CLI starts without the heavy libraries a command does not use: ``--help``, ``--version``,
``inspect`` (``--stats`` too), ``verify`` (``--against`` too) and ``diff`` never import torch
(what made every command pay about 2 s before doing anything, and 230 MB of memory), nor do
``inspect`` and ``verify`` of another engine's files. How fast they start is a benchmark figure
(``benchmarks/cli_startup.py``), never a timed test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvsnap.cli.app import app
from kvsnap.engines.vllm.eviction import ORPHAN_GRACE_S

REPO = Path(__file__).resolve().parents[2]
#: Libraries that take a second or more to import, none of which these commands need.
HEAVY_LIBRARIES = ("torch", "transformers", "triton", "matplotlib")
#: kvsnap's own modules that import them.
HEAVY_MODULES = ("kvsnap.pipeline", "kvsnap.bench", "kvsnap.parted")
#: Runs each ``kvsnap ARGS`` of the JSON list in ``argv[1]`` in turn in this one process and
#: prints, per command, its exit code and the heavy modules loaded so far.
_RUN = f"""
import json, sys
from kvsnap.cli.app import main
outcomes = []
for arguments in json.loads(sys.argv[1]):
    sys.argv = ["kvsnap", *arguments]
    try:
        main()
    except SystemExit as exit:
        code = exit.code
    heavy = sorted(
        name for name in sys.modules
        if name.split(".")[0] in {HEAVY_LIBRARIES!r} or name in {HEAVY_MODULES!r}
    )
    outcomes.append({{"command": " ".join(arguments), "code": code, "heavy": heavy}})
print(json.dumps(outcomes), file=sys.stderr)
"""


def run_cli(*commands: list[str]) -> list[dict]:
    """Run ``commands`` one after the other in one fresh interpreter; their outcomes."""
    result = subprocess.run(
        [sys.executable, "-c", _RUN, json.dumps(commands)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        timeout=120,
    )
    return json.loads(result.stderr.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("startup") / "fixture.safetensors"
    assert CliRunner().invoke(app, ["fixture", str(path)]).exit_code == 0
    return str(path)


def test_light_commands_import_no_heavy_library(snapshot: str) -> None:
    commands = [
        ["--help"],
        ["--version"],
        ["inspect", snapshot],
        ["inspect", snapshot, "--json"],
        ["verify", snapshot],
        ["verify", snapshot, "--json"],
        ["store", "--help"],
        # The comparison and the statistics read and reduce KV with numpy alone.
        ["inspect", snapshot, "--stats"],
        ["verify", snapshot, "--against", snapshot],
        ["diff", snapshot, snapshot, "--json"],
    ]
    outcomes = run_cli(*commands)
    assert outcomes == [
        {"command": " ".join(command), "code": 0, "heavy": []} for command in commands
    ]


#: Another engine's files of each format kvsnap reads (fixtures/foreign).
FOREIGN = REPO / "fixtures" / "foreign"
FOREIGN_PATHS = (
    next((FOREIGN / "vllm-fs" / "tp1" / "fs").glob("*/config.json")).parent,  # a namespace
    FOREIGN / "vllm-fs" / "tp2" / "fs",  # a root
    FOREIGN / "llama-state" / "seq-flash.bin",
    FOREIGN / "sglang-hicache" / "layer_first" / "tp1",
    FOREIGN / "lmcache-fs" / "tp1",
    FOREIGN / "thaw" / "prefix.thawkv",
)


def test_inspect_and_verify_of_another_engines_files_import_no_heavy_library() -> None:
    # They read names, sizes and headers (the readers' blocks become tensors only to convert).
    commands = [
        [command, str(path), *json]
        for path in FOREIGN_PATHS
        for command in ("inspect", "verify")
        for json in ((), ("--json",))
    ]
    outcomes = run_cli(*commands)
    assert outcomes == [
        {"command": " ".join(command), "code": 0, "heavy": []} for command in commands
    ]


def test_a_command_that_computes_still_gets_what_it_needs(snapshot: str) -> None:
    # --plot draws with matplotlib: imported when the plot is drawn.
    [outcome] = run_cli(["inspect", snapshot, "--plot", f"{snapshot}.png"])
    assert outcome["code"] == 0 and "matplotlib" in outcome["heavy"]


def test_store_prune_shows_the_stores_own_orphan_grace_default() -> None:
    from typer.main import get_command

    prune = get_command(app).commands["store"].commands["prune"]  # type: ignore[attr-defined]
    [option] = [param for param in prune.params if param.name == "orphan_grace_s"]
    # Shown as a plain number (a string show_default printed as "(600)").
    assert option.help.endswith(f"default {ORPHAN_GRACE_S:g} s.") and not option.show_default
