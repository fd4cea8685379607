"""LMCache's multiprocess-server fs L2, read from files LMCache's own code wrote
(fixtures/foreign/lmcache-fs, ``scripts/make_lmcache_fixtures.py``).

One 96-token prompt (3 chunks of 32) of the built-in tiny Llama (4 layers, 2 KV heads of 32,
bfloat16), stored by LMCache 0.5.6's ``FSL2Adapter`` under its own ``ObjectKey`` and blake3
``TokenHasher`` at TP 1 and 2, with kvsnap's capture of the same KV to compare with.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvsnap.errors import LayoutError, SnapshotCorruptError
from kvsnap.foreign import convert_to_snapshot, open_foreign, recognise
from kvsnap.foreign.lmcache_fs import chunk_hashes
from kvsnap.snapshot import Snapshot
from tests.support.cli_runs import run_kvsnap

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures" / "foreign" / "lmcache-fs"
PROMPT = json.loads((FIXTURES / "prompt.json").read_text())


def test_file_names_are_lmcaches_chunk_hashes() -> None:
    names = {path.name.split("@")[3].split(".")[0] for path in (FIXTURES / "tp2").iterdir()}
    assert set(chunk_hashes(PROMPT, 32)) == names and len(names) == 3
    assert recognise(FIXTURES / "tp2").name == "lmcache-fs"
    assert recognise(next((FIXTURES / "tp1").iterdir())).name == "lmcache-fs"


@pytest.mark.parametrize("tp", [1, 2])
def test_converted_chunks_equal_the_kv_lmcache_held(tmp_path: Path, tp: int) -> None:
    out = tmp_path / "converted.safetensors"
    with open_foreign(FIXTURES / f"tp{tp}", model=str(FIXTURES), tokens=PROMPT) as source:
        assert source.verify() == []
        [deployment] = source.describe()["deployments"]
        assert deployment["world_size"] == tp and deployment["files"] == 3 * tp
        convert_to_snapshot(source, out, engine=source.engine)
    with Snapshot.open(out) as mine, Snapshot.open(FIXTURES / "reference.safetensors") as ref:
        comparison = mine.compare(ref)
    assert comparison.problems == [] and comparison.layers
    assert all(layer.num_mismatches == 0 for layer in comparison.layers)


def test_damage_and_missing_hints(tmp_path: Path) -> None:
    directory = tmp_path / "l2"
    shutil.copytree(FIXTURES / "tp2", directory)
    files = sorted(directory.iterdir())
    files[0].write_bytes(files[0].read_bytes()[:1000])
    files[1].unlink()
    (directory / (files[2].stem + ".tmp")).write_bytes(b"partial")
    with open_foreign(directory) as source:
        messages = [problem.message for problem in source.verify()]
    assert "1000 bytes, the other files have 16384" in messages
    assert "a temporary file of an interrupted write" in messages
    assert any("is missing rank(s)" in message for message in messages)
    with open_foreign(directory, tokens=PROMPT) as source:
        with pytest.raises(LayoutError, match="pass --model DIR"):
            source.sequences()
    with open_foreign(directory, tokens=PROMPT, model=str(FIXTURES)) as source:
        digest = files[0].name.split("@")[3].split(".")[0]
        with pytest.raises(SnapshotCorruptError, match="1000 bytes, a chunk file here has"):
            source.read_block(digest)


def test_cli(tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    common = ["convert", str(FIXTURES / "tp2"), "--model", str(FIXTURES), "-o", str(out)]
    missing = run_kvsnap(*common)
    assert missing.returncode == 2 and "--tokens FILE is required" in missing.stderr
    done = run_kvsnap(*common, "--tokens", str(FIXTURES / "prompt.json"))
    assert done.returncode == 0, done.stderr
    compared = run_kvsnap("verify", str(out), "--against", str(FIXTURES / "reference.safetensors"))
    assert compared.returncode == 0, compared.stdout
    checked = run_kvsnap("verify", str(FIXTURES / "tp1"), "--json")
    payload = json.loads(checked.stdout)
    assert checked.returncode == 0 and payload["ok"]
    assert any("no checksums" in note for note in payload["notes"])


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("lmcache") is None,
    reason="LMCache is not installed: see scripts/make_lmcache_fixtures.py",
)
def test_lmcache_writes_what_the_fixtures_hold(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_lmcache_fixtures.py"), str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    for committed in FIXTURES.rglob("*"):
        if committed.is_file() and committed.name != "versions.json":
            assert (
                tmp_path / committed.relative_to(FIXTURES)
            ).read_bytes() == committed.read_bytes()
