"""thaw's KV snapshots, read from a file thaw's own ``freeze_kv_cache`` wrote
(fixtures/foreign/thaw, ``scripts/make_thaw_fixtures.py``).

The built-in tiny Llama's bfloat16 prefill of a 48-token prompt in vLLM's cache layout, its
blocks hashed by vLLM's own prefix-cache code, frozen by thaw-vllm 0.6.0 (its Python writer's
single-file form), with kvsnap's capture of the same KV to compare with.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from kvsnap.errors import LayoutError, SnapshotCorruptError
from kvsnap.foreign import convert_to_snapshot, open_foreign, recognise
from kvsnap.snapshot import Snapshot
from tests.support.cli_runs import run_kvsnap

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures" / "foreign" / "thaw"
SNAPSHOT = FIXTURES / "prefix.thawkv"
PROMPT = json.loads((FIXTURES / "prompt.json").read_text())


def test_converted_blocks_equal_the_kv_thaw_froze(tmp_path: Path) -> None:
    """thaw keeps blocks in block-pool order (2, 5, 7); vLLM's hashes put them in the prompt's
    order (7, 2, 5)."""
    assert recognise(SNAPSHOT).name == "thaw-kv"
    out = tmp_path / "converted.safetensors"
    with open_foreign(SNAPSHOT, tokens=PROMPT) as source:
        assert source.verify() == []
        assert source.describe()["block_ids"] == [2, 5, 7]
        [sequence] = source.sequences()
        assert sequence.block_ids == ("2", "0", "1")
        convert_to_snapshot(source, out, engine=source.engine)
    with Snapshot.open(out) as mine, Snapshot.open(FIXTURES / "reference.safetensors") as ref:
        comparison = mine.compare(ref)
    assert comparison.problems == [] and comparison.layers
    assert all(layer.num_mismatches == 0 for layer in comparison.layers)


def test_damaged_snapshots(tmp_path: Path) -> None:
    data = SNAPSHOT.read_bytes()
    truncated = tmp_path / "truncated.thawkv"
    truncated.write_bytes(data[:-10])
    with open_foreign(truncated, tokens=PROMPT) as source:
        [problem] = source.verify()
        assert "the metadata describes" in problem.message
        with pytest.raises(SnapshotCorruptError, match="the metadata describes"):
            source.read_block("0")
    header = tmp_path / "header.thawkv"
    header.write_bytes(data[:40])
    with pytest.raises(SnapshotCorruptError, match="truncated: metadata"):
        open_foreign(header)
    length = int.from_bytes(data[8:12], "little")
    metadata = json.loads(data[12 : 12 + length])
    wrong = tmp_path / "wrong.thawkv"
    edited = json.dumps({**metadata, "block_shape": [2, 16, 3, 32]}).encode()
    wrong.write_bytes(data[:8] + len(edited).to_bytes(4, "little") + edited + data[12 + length :])
    with open_foreign(wrong) as source:
        messages = [problem.message for problem in source.verify()]
    assert "block_bytes is not block_shape's size" in messages
    garbage = tmp_path / "garbage.thawkv"
    garbage.write_bytes(data[:12] + b"\xff" * length + data[12 + length :])
    with pytest.raises(SnapshotCorruptError, match="not JSON"):
        open_foreign(garbage)
    native = tmp_path / "native.thaw"  # thaw-native's region file: recognised, not read
    native.write_bytes(b"THAW" + (1).to_bytes(4, "little") + bytes(4088))
    (tmp_path / "native.thaw.meta").write_bytes(data[: 12 + length])
    assert recognise(native).name == "thaw-kv"
    with pytest.raises(LayoutError, match="thaw's native writer"):
        open_foreign(native)


def test_cli(tmp_path: Path) -> None:
    copy = tmp_path / "prefix.thawkv"
    shutil.copy(SNAPSHOT, copy)
    out = tmp_path / "out.safetensors"
    missing = run_kvsnap("convert", str(copy), "-o", str(out))
    assert missing.returncode == 2 and "--tokens FILE is required" in missing.stderr
    done = run_kvsnap(
        "convert", str(copy), "--tokens", str(FIXTURES / "prompt.json"), "-o", str(out)
    )
    assert done.returncode == 0, done.stderr
    compared = run_kvsnap("verify", str(out), "--against", str(FIXTURES / "reference.safetensors"))
    assert compared.returncode == 0, compared.stdout
    copy.write_bytes(SNAPSHOT.read_bytes()[:-1])
    checked = run_kvsnap("verify", str(copy))
    assert checked.returncode == 1 and "the metadata describes" in checked.stdout
    copy.write_bytes(SNAPSHOT.read_bytes()[:20])
    broken = run_kvsnap("inspect", str(copy))
    assert broken.returncode == 1 and len(broken.stderr.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(
    importlib.util.find_spec("thaw_vllm") is None,
    reason="thaw-vllm is not installed: see scripts/make_thaw_fixtures.py",
)
def test_thaw_writes_what_the_fixtures_hold(tmp_path: Path) -> None:
    subprocess.run(
        [
            str(ROOT / ".venv-vllm" / "bin" / "python"),
            str(ROOT / "scripts" / "make_thaw_fixtures.py"),
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    for committed in FIXTURES.rglob("*"):
        if committed.is_file() and committed.name != "versions.json":
            assert (
                tmp_path / committed.relative_to(FIXTURES)
            ).read_bytes() == committed.read_bytes()
